#!/usr/bin/env bash
# Every GPU check of hopperjax in one call, for a lent H200/H100 (see the device tool's README).
#
#   Here, once per session (fetches the wheels the device image lacks into .whl/, copies Davis and
#   Multi30k from ../shared/data into .data/, packs CIFAR-10 there; both git-ignored):
#     bash tools/gpu_check.sh --fetch-wheels
#   On the device (carry: [".whl", ".data"], timeout_s 480):
#     bash tools/gpu_check.sh
#
# Writes a summary table, logs.tar.gz (every check's log) and the JSON results to $OUT (or
# runs/gpu_check), at most 8 files as the device tool returns them, and prints the table last.
# Plumbing check on a CPU: PYTHON=.venv/bin/python SMOKE=1 bash tools/gpu_check.sh (tiny sizes;
# move .whl aside first: its wheels are for the device's Python 3.12).
# A subset: CHECKS="env find_batch" bash tools/gpu_check.sh (names as in the summary table).
# Budget: under 8 minutes in all. A check is killed at its own timeout or at the global deadline
# (DEADLINE seconds, default 470), whichever comes first, so one hang cannot eat the lease; a
# failed or cut check is reported in the table and the next one still runs (or is skipped).
# Checks run most-wanted first: the GPT step (its cuDNN attention crashed the loop on the second
# H200 run), the loop, the CIFAR-10 recipe; the last ones (find_batch, fp32 CIFAR, GEMMs, the
# d4096 bf16/FP8 pair: FP8 took 117 s to compile on the first H200 run) usually need a second
# call while the machine is warm, if device time allows, e.g. CHECKS="find_batch wide fp8_hlo"
# DEADLINE=280 bash tools/gpu_check.sh (timeout_s 300).
set -uo pipefail
cd "$(dirname "$0")/.."

# Not in the device image (its JAX, flax, optax, orbax, chex, rich, pyyaml, nvidia-ml-py are).
WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5
        flatbuffers==25.12.19)  # jax.export's serialization (the export check)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  grep -qxF '/.data/' .git/info/exclude 2>/dev/null || echo '/.data/' >> .git/info/exclude
  # The datasets from where `python -m hopperjax.data prepare` put them (data/NAME), else from
  # the shared folder beside the checkout.
  source_of() { if [[ -d data/$1 ]]; then echo "data/$1"; else echo "../shared/data/$1"; fi; }
  for name in davis multi30k; do
    if [[ -d $(source_of $name) ]]; then
      mkdir -p .data && rm -rf ".data/$name" && cp -rL "$(source_of $name)" ".data/$name"
    fi
  done
  # CIFAR-10's 60,000 JPEGs (57 MB) as one file of their bytes and an index: the files one by
  # one would not fit the 64 MiB a device call carries (tar or zip headers add 7-35 MB).
  # The JPEG copy first: prepare's PNG folders (lossless) pack to ~130 MB, too much to carry.
  cifar=../shared/data/cifar10
  [[ -d $cifar ]] || cifar=data/cifar10
  if [[ -d $cifar ]]; then
    mkdir -p .data && python3 - "$cifar" .data/cifar10 <<'PY' || exit 1
import gzip, json, pathlib, sys
root, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".jpg", ".png"))
index = []
with open(f"{dest}.pack", "wb") as pack:
    for p in files:
        data = p.read_bytes()
        pack.write(data)
        index.append([str(p.relative_to(root)), len(data)])
pathlib.Path(f"{dest}.index.json.gz").write_bytes(gzip.compress(json.dumps(index).encode()))
size = pathlib.Path(f"{dest}.pack").stat().st_size
if size > 60 * 2**20:
    sys.exit(f"{dest}.pack is {size / 2**20:.0f} MiB: over what a device call carries (64 MiB)")
print(f"packed {len(index):,} images into {dest}.pack")
PY
  fi
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "${WHEELS[@]}"
  exit $?
fi

OUT=${OUT:-runs/gpu_check}
LOGS=$(mktemp -d /tmp/gpu_check_logs.XXXX)
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# Checks compile the same programs more than once (inspect and train; find_batch's last probe and
# its timed run): the persistent cache turns the repeats into loads.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/hopperjax-jax-cache}
PY=${PYTHON:-python3}
if [[ -n "${SMOKE:-}" ]]; then
  SHRINK=(model.d_model=64 model.n_layers=2 model.n_heads=2 data.seq_len=64 train.steps=8
          train.log_every=2 train.eval_every=8)
  PROFILE=(profile.start_step=3 profile.num_steps=2)
  GEMM_SIZES=(--quick)
  ONE_B=(model.d_model=64 model.n_layers=2 model.n_heads=2 data.seq_len=64)
  FIND=(--budget-gb 0.05 --measure-steps 2)
  ATTN_SHAPE=2,64,2,32
  ATTN_PLATFORM=cpu  # the gpu-marked tests are skipped: the plumbing still runs
else
  SHRINK=()
  PROFILE=(profile.start_step=20 profile.num_steps=3)
  GEMM_SIZES=(--batches 4096,16384 --repeats 10 --warmup 3)
  ONE_B=()
  FIND=(--tolerance 0.1 --measure-steps 5)
  ATTN_SHAPE=16,1024,16,64
  ATTN_PLATFORM=cuda  # the tests' conftest would pick the CPU otherwise
fi
status=()
if [[ -z "${CHECKS:-}" || " $CHECKS " == *" train "* || " $CHECKS " == *" wide "* ]]; then
  rm -rf /tmp/gpt_medium /tmp/wide_bf16 /tmp/wide_fp8  # this script's own run dirs: start fresh
fi

check() {  # check NAME SECONDS COMMAND...: runs one check, logs to $LOGS/NAME.log
  local name=$1 limit=$2; shift 2
  if [[ -n "${CHECKS:-}" && " $CHECKS " != *" ${name%%_*} "* && " $CHECKS " != *" $name "* ]]; then
    return
  fi
  local left=$(( ${DEADLINE:-470} - SECONDS ))
  if (( left < 15 )); then
    status+=("$name skipped: deadline")
    return
  fi
  (( limit > left )) && limit=$left
  local start=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  status+=("$name rc=$rc $((SECONDS - start))s")
}

# A real-text corpus of a few MB for the large model (the embedded one is too small for 1k windows).
for _ in $(seq 12); do cat hopperjax/*.py hopperjax/*/*.py README.md; done > /tmp/corpus.txt
BIG=(--config configs/gpt_medium.yaml data.source=text data.path=/tmp/corpus.txt
     run_dir=/tmp/gpt_medium "${SHRINK[@]}")

check env 15 bash -c 'nvidia-smi; '"$PY"' -c "import jax, flax, optax, orbax.checkpoint as o, grain;
print(jax.__version__, flax.__version__, optax.__version__, grain.__version__); print(jax.devices())"'
# cuDNN flash attention (attention: auto on a GPU): the gpu-marked tests (cuDNN equals XLA's
# softmax, values and gradients) and both kernels timed at gpt_medium's attention shape.
# (pytest and pytest-xdist are in the device image; the bench runs whatever the tests say.)
check attention 60 bash -c 'JAX_PLATFORMS=$2 "$0" -m pytest -q -n 0 -p no:cacheprovider -m gpu \
  tests/test_precision.py; t=$?; "$0" tools/attention_bench.py --shape "$1" --dtype bfloat16 \
  --implementations xla,cudnn --repeats 20; b=$?; echo "tests rc=$t bench rc=$b"; exit $((t|b))' \
  "$PY" "${ATTN_SHAPE}" "${ATTN_PLATFORM}"
check train 70 "$PY" -m hopperjax.train "${BIG[@]}" "${PROFILE[@]}"
check profile 15 "$PY" tools/profile_summary.py /tmp/gpt_medium/profile
check bench_loop 30 "$PY" tools/bench_loop.py --config configs/quickstart.yaml precision=bf16 \
  "${SHRINK[@]}" --steps 100
# CIFAR-10 time to 94 % (issue 18), the fast recipe (configs/cifar10_resnet.yaml, ResNet-9, 24
# epochs). The JPEGs are decoded once into shards (tools/convert_images.py, with its host-pipeline
# bench), which each run reads into memory in about a second (decoding took ~40 s a run on the
# first H200 call). Then: bf16 seed 0; the same with the other initializer (the recipe's choice,
# measured); the airbench recipe's seed 0; fp16 (dynamic loss scaling) for the precision
# comparison; bf16 seeds 1 and 2 of both recipes.
# Each benchmark writes results.json after every run, so a cut check keeps what finished.
# Needs .data/cifar10.pack (see --fetch-wheels); unpacked to /tmp/cifar10.
CIFAR_DATA=""
if [[ -f .data/cifar10.pack ]]; then
  CIFAR_DATA=1
  "$PY" - .data/cifar10 /tmp/cifar10 <<'PY'
import gzip, json, pathlib, sys
src, root = sys.argv[1], pathlib.Path(sys.argv[2])
with open(f"{src}.pack", "rb") as pack:
    for name, size in json.loads(gzip.decompress(pathlib.Path(f"{src}.index.json.gz").read_bytes())):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(pack.read(size))
PY
  CIFAR_SHORT=()
  [[ -n "${SMOKE:-}" ]] && CIFAR_SHORT=(model.width=8 train.steps=6 train.eval_every=3
                                        train.log_every=3 train.checkpoint_every=3)
  CIFAR_OTHER_INIT=(model.init=he)  # the recipe's is torch
  AIRBENCH_EVAL=(train.eval_every=100)
  [[ -n "${SMOKE:-}" ]] && AIRBENCH_EVAL=()
  CIFAR=(experiments/cifar10_benchmark.py --data /tmp/cifar10_shards data.source=shards
         train.eval_every=98 "${CIFAR_SHORT[@]}")
  check convert_images 60 "$PY" tools/convert_images.py --source folder --path /tmp/cifar10 \
    --out /tmp/cifar10_shards --bench --bench-workers 0,2 --bench-batches 20
  check cifar 80 "$PY" "${CIFAR[@]}" --seeds 0 --precisions bf16 --out "$LOGS/cifar"
  check cifar_init 75 "$PY" "${CIFAR[@]}" --seeds 0 --precisions bf16 --out "$LOGS/cifar_init" \
    "${CIFAR_OTHER_INIT[@]}"
  # The airbench recipe (configs/cifar10_airbench.yaml; docs/images.md has its CPU run): its
  # time to 94 % in bf16, evaluated every 2 epochs; seeds 1 and 2 after the ResNet-9 checks.
  AIRBENCH=("${CIFAR[@]}" --config configs/cifar10_airbench.yaml --precisions bf16
            --out "$LOGS/airbench" "${AIRBENCH_EVAL[@]}")
  check cifar_airbench 50 "$PY" "${AIRBENCH[@]}" --seeds 0
else
  status+=("cifar skipped: no .data/cifar10.pack")
fi
if [[ -n "$CIFAR_DATA" ]]; then
  check cifar_fp16 75 "$PY" "${CIFAR[@]}" --seeds 0 --precisions fp16 --out "$LOGS/cifar"
  check cifar_seeds 60 "$PY" "${CIFAR[@]}" --seeds 1,2 --precisions bf16 --out "$LOGS/cifar"
  check airbench_seeds 60 "$PY" "${AIRBENCH[@]}" --seeds 1,2
fi
# Does the ResNet-9 step wait for input? bench_loop on the recipe's shapes (50,000 generated
# images in memory, as a decoded folder is): loop vs bare step, host pipeline batches/s vs steps/s,
# the on-device augmentation's share of the step, and the bytes a batch moves to the device.
IMAGE_BENCH=(data.source=synthetic data.path=null data.synthetic_images=50000 --steps 100)
[[ -n "${SMOKE:-}" ]] && IMAGE_BENCH=(data.source=synthetic data.path=null model.width=8
  data.synthetic_images=2048 train.log_every=5 train.batch_size=64 --steps 10 --chunk 5
  --pipeline-batches 10)
check bench_image 45 "$PY" tools/bench_loop.py --config configs/cifar10_resnet.yaml precision=bf16 \
  "${IMAGE_BENCH[@]}"
# Recommendation (issue 20): the CPU-scaled Criteo DLRM (26 hashed tables, Kaggle MLP shapes) on
# generated clicks in bf16: bare step vs full loop, pipeline throughput, examples/s.
DLRM_BENCH=(data.source=synthetic data.path=null data.synthetic_dense=13 data.synthetic_task=clicks
  data.synthetic_rows=262144 --steps 100)
[[ -n "${SMOKE:-}" ]] && DLRM_BENCH=(data.source=synthetic data.path=null data.synthetic_dense=13
  data.synthetic_task=clicks data.synthetic_rows=4096 train.batch_size=256 train.log_every=5
  --steps 10 --chunk 5 --pipeline-batches 10)
check bench_dlrm 45 "$PY" tools/bench_loop.py --config configs/dlrm_criteo.yaml precision=bf16 \
  "${DLRM_BENCH[@]}"
# INT8 inference (issue 21) on the GPT trained above (/tmp/gpt_medium, bf16): each scheme's eval
# loss and jitted predict latency against the bf16 model (experiments/quantize_compare.py), then
# the W8A8 model exported for cuda and timed through its JAX-only loader at batch 8.
check int8 40 "$PY" experiments/quantize_compare.py --run-dir /tmp/gpt_medium --eval-batches 4 \
  --calibration-batches 2 --out "$LOGS/int8"
[[ -f "$LOGS/int8/results.json" ]] && cp "$LOGS/int8/results.json" "$OUT/int8.json"
EXPORT_PLATFORM=cuda
[[ -n "${SMOKE:-}" ]] && EXPORT_PLATFORM=cpu  # a CPU cannot run a module lowered for cuda
check export 40 bash -c 'rm -rf /tmp/gpt_int8 && "$0" -m hopperjax.export --run-dir /tmp/gpt_medium \
  --out /tmp/gpt_int8 --quantize w8a8 --platforms "$1" && "$0" - <<'"'"'PY'"'"'
import sys, time, numpy as np
sys.path.insert(0, "/tmp/gpt_int8")
import load_artifact
model = load_artifact.load("/tmp/gpt_int8")
batch = {k: np.zeros([8 if n == "batch" else n for n in v["shape"]], v["dtype"])
         for k, v in model.inputs.items()}
np.asarray(model(batch))
start = time.perf_counter()
for _ in range(20):
    out = np.asarray(model(batch))
print(f"exported w8a8 GPT, batch 8: {1e3 * (time.perf_counter() - start) / 20:.2f} ms/call", out.shape)
PY' "$PY" "$EXPORT_PLATFORM"
# Data movement on one GPU (issue 22): HBM copy against the H200's 4.8 TB/s, host<->device from
# pinned memory against PCIe 5 x16's ~64 GB/s per direction (tools/collective_bench.py).
COPY_SIZES=(--max-size 1GiB --repeats 5)
[[ -n "${SMOKE:-}" ]] && COPY_SIZES=(--max-size 1MiB --repeats 2)
check copy_bw 30 "$PY" tools/collective_bench.py --devices 1 "${COPY_SIZES[@]}" --out-dir "$LOGS"
# Translation (issue 19): the Multi30k recipe in bf16, cut to 1,000 steps, then beam-search BLEU
# and chrF on test_2016_flickr (experiments/translation_benchmark.py). Needs .data/multi30k.
MT_SHORT=(train.steps=1000 train.eval_every=500)
[[ -n "${SMOKE:-}" ]] && MT_SHORT=(train.steps=10 train.eval_every=10 model.d_model=32
  model.n_heads=2 model.encoder_layers=1 model.decoder_layers=1 model.mlp_dim=64
  model.vocab_size=1000 data.generate_pairs=10)
if [[ -d .data/multi30k ]]; then
  check translation 90 "$PY" experiments/translation_benchmark.py --out "$LOGS/translation" \
    data.path=.data/multi30k precision=bf16 "${MT_SHORT[@]}"
else
  status+=("translation skipped: no .data/multi30k")
fi
check inspect 30 "$PY" -m hopperjax.inspect "${BIG[@]}" --format table
# The DTA recipe: one run of DeepDTA's protocol on Davis (valid fold 0, test fold scored once) in
# bf16, cut to a fixed step count: wall time and test scores on the GPU. Needs .data/davis (see
# --fetch-wheels). The first H200 run did 1,600 of 2,000 steps in 88 s.
DTA_SHORT=(train.steps=1000)
[[ -n "${SMOKE:-}" ]] && DTA_SHORT=(train.steps=20 train.eval_every=10)
if [[ -d .data/davis ]]; then
  check dta_bf16 75 "$PY" experiments/dta_benchmark.py --data .data/davis --folds 0 \
    --out "$LOGS/dta_bf16" precision=bf16 "${DTA_SHORT[@]}"
  [[ -f "$LOGS/dta_bf16/results.json" ]] && cp "$LOGS/dta_bf16/results.json" "$OUT/dta_bf16.json"
else
  status+=("dta_bf16 skipped: no .data/davis")
fi
# The largest batch per remat policy for a ~1B GPT that fits the H200 (compile-only search, then
# 5 timed steps at each): what remat buys in batch and what its recompute costs in throughput.
check find_batch 110 "$PY" tools/find_batch.py --config configs/gpt_1b.yaml "${ONE_B[@]}" \
  --policies none,full "${FIND[@]}" --json "$OUT/find_batch.json"
if [[ -n "$CIFAR_DATA" ]]; then
  check cifar_fp32 90 "$PY" "${CIFAR[@]}" --seeds 0 --precisions fp32 --out "$LOGS/cifar"
fi
check gemm 60 "$PY" tools/gemm_bench.py --dtypes bf16,fp8 "${GEMM_SIZES[@]}" --out-dir "$LOGS"
# FP8 vs bf16 on a GEMM-heavy model (d_model 4096): step time, and whether XLA emitted cuBLASLt
# FP8 GEMMs (custom-call __cublas$lt$matmul$f8) for the quantize -> dot -> dequantize pattern.
WIDE=("${BIG[@]}" model.d_model=4096 model.n_layers=4 model.n_heads=32 train.batch_size=8
      train.steps=12 train.log_every=4 train.eval_every=12 train.eval_batch_size=4
      train.eval_batches=1 "${SHRINK[@]}")
check wide_bf16 75 "$PY" -m hopperjax.train "${WIDE[@]}" precision=bf16 run_dir=/tmp/wide_bf16
check wide_fp8 170 "$PY" -m hopperjax.train "${WIDE[@]}" precision=fp8 run_dir=/tmp/wide_fp8
check fp8_hlo 30 bash -c '"$0" -m hopperjax.inspect "${@}" precision=fp8 --hlo /tmp/fp8.hlo \
  --format table > /dev/null && echo "cuBLASLt fp8 GEMM calls: $(grep -c "__cublas\$lt\$matmul\$f8" /tmp/fp8.hlo)"' \
  "$PY" "${WIDE[@]}"
[[ -f "$LOGS/translation/results.json" ]] && cp "$LOGS/translation/results.json" \
  "$OUT/translation.json"
[[ -f "$LOGS/cifar/results.json" ]] && cp "$LOGS/cifar/results.json" "$OUT/cifar10.json"
[[ -f "$LOGS/cifar_init/results.json" ]] && cp "$LOGS/cifar_init/results.json" \
  "$OUT/cifar10_other_init.json"
[[ -f "$LOGS/airbench/results.json" ]] && cp "$LOGS/airbench/results.json" \
  "$OUT/cifar10_airbench.json"
tar czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude='checkpoints' --exclude='tb' . 2>/dev/null

"$PY" - "$OUT" "$LOGS" "${status[@]}" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out, logs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
print("| check | result |\n|---|---|")
for line in sys.argv[3:]:
    print(f"| {line.split()[0]} | {' '.join(line.split()[1:])} |")
attention = logs / "attention.log"
reports = [x for x in attention.read_text().splitlines() if x.startswith("{")] if attention.exists() else []
if reports:
    r = json.loads(reports[-1])
    ms = ", ".join(f"{k} {v:.2f} ms" for k, v in r["ms"].items())
    err = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_err_vs_xla"].items()) or "-"
    skipped = "; ".join(f"{k}: {v}" for k, v in r["skipped"].items()).replace("|", "/") or "-"
    print(f"| attention {'x'.join(map(str, r['shape']))} {r['dtype']} fwd+bwd | {ms}; "
          f"error vs xla {err}; skipped {skipped} |")
metrics = pathlib.Path("/tmp/gpt_medium/metrics.jsonl")
if metrics.exists():
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"mfu"' in x][1:]
    if rows:
        best = max(rows, key=lambda r: r["mfu"])
        print(f"| gpt_medium bf16 | {best['step_time_s']*1e3:.1f} ms/step, "
              f"{best['tokens_per_s']:,.0f} tok/s, {best['tflops_per_device']:.1f} TFLOP/s, "
              f"MFU {best['mfu']:.1%} |")
found = out / "find_batch.json"
if found.exists():
    for m in json.loads(found.read_text())["measured"]:
        print(f"| 1B remat {m['remat']} | largest batch {m['batch_size']}: "
              f"{m['step_s']*1e3:.0f} ms/step, {m['tokens_per_s']:,.0f} tok/s, "
              f"{m['model_tflops']:.1f} model TFLOP/s |")
for p in ("bf16",):
    dta = out / f"dta_{p}.json"
    if dta.exists():
        r = json.loads(dta.read_text())[0]
        t = r["test"]
        print(f"| DTA Davis {p} | {r['train_s']:.0f} s train, test MSE {t['mse']:.3f}, "
              f"CI {t['ci']:.3f} |")
bench = logs / "bench_image.log"
text = bench.read_text() if bench.exists() else ""
if "\n{" in text:
    r = json.loads(text[text.index("\n{") + 1 : text.rindex("}") + 1])
    print(f"| ResNet-9 input, bf16 | bare step {r['bare_step_s'] * 1e3:.1f} ms, loop/bare "
          f"{r['loop_over_bare']:.2f}, host pipeline {r['host_batches_per_s']:.0f} batches/s "
          f"({r['pipeline_over_step']:.1f}x the step's rate), augmentation "
          f"{r['preprocess_share_of_step']:.1%} of the step, {r['batch_bytes_to_device'] / 2**20:.2f} "
          f"MiB to the device per batch |")
convert = logs / "convert_images.log"
rates = [json.loads(x) for x in convert.read_text().splitlines() if x.startswith("{")] if convert.exists() else []
if rates:
    cells = ", ".join(f"{r['source']} w{r['workers']} {r['images_per_s']:,}" for r in rates)
    print(f"| CIFAR-10 host pipeline, images/s (batches of 512) | {cells} |")
for cifar, net, label in ((out / "cifar10.json", "ResNet-9", ""),
                          (out / "cifar10_other_init.json", "ResNet-9", ", other init"),
                          (out / "cifar10_airbench.json", "airbench", "")):
    if not cifar.exists():
        continue
    for r in json.loads(cifar.read_text()):
        at = (f"94 % at step {r['target_step']}, {r['target_s']:.1f} s"
              if r["target_step"] is not None else "94 % not reached")
        print(f"| CIFAR-10 {net} {r['precision']} seed {r['seed']}{label} | test accuracy "
              f"{r['accuracy']:.2%}; {at}; {r['train_s']:.1f} s training ({r['step_s'] * 1e3:.1f} "
              f"ms/step), {r['compile_s']:.0f} s compile, {r.get('data_s', 0):.0f} s reading "
              f"data, {r['wall_s']:.0f} s wall |")
mt = out / "translation.json"
if mt.exists():
    for r in json.loads(mt.read_text()):
        print(f"| Multi30k T5 bf16, {r['step']} steps | test_2016_flickr BLEU {r['test']['bleu']:.2f}, "
              f"chrF {r['test']['chrf']:.2f}; {r['train_s']:.0f} s training "
              f"({r['step_s'] * 1e3:.1f} ms/step), {r['decode_s']:.0f} s decoding |")
for p in ("bf16", "fp8"):
    wide = pathlib.Path(f"/tmp/wide_{p}/metrics.jsonl")
    rows = [json.loads(x) for x in wide.read_text().splitlines() if '"mfu"' in x][1:] if wide.exists() else []
    if rows:
        ms = sorted(r["step_time_s"] for r in rows)[len(rows) // 2] * 1e3
        print(f"| d4096 {p} | {ms:.1f} ms/step, MFU {rows[-1]['mfu']:.1%} |")
PY
