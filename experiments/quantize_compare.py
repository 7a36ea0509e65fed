"""INT8 post-training quantization against the float model, per trained run.

    python experiments/quantize_compare.py --run-dir R [--run-dir R2 ...]
        [--schemes weight,w8a8,w8a8_static] [--calibration-batches 8] [--eval-batches N]
        [--latency-repeats 20] [--out runs/quantize_compare]

For each run (its newest verified checkpoint, restored without optimizer state): the float
model's eval metrics (the workload's own, over the eval split, plus its generation metrics,
e.g. BLEU), then for each INT8 scheme (``hopperjax/infer/quantize.py``) the same metrics, their
relative change, the parameter bytes, and the median latency of one jitted ``predict`` on an eval
batch. ``w8a8_static`` calibrates on the first ``--calibration-batches`` training batches, to
``--calibration-percentile`` of the input magnitudes (100: the largest).
Writes ``OUT/table.md`` and ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dta_benchmark import cpu_name

import hopperjax
from hopperjax.infer import restore_params
from hopperjax.infer.evaluate import evaluate, first_batches, latency
from hopperjax.infer.quantize import DEFAULT_PERCENTILE, quantize_restored, weight_bytes
from hopperjax.precision.int8 import SCHEMES
from hopperjax.trainer.components import build_datasets

# The metrics each workload is judged by (the first present is the table's headline).
HEADLINE = (
    "eval_bleu",
    "eval_perplexity",
    "eval_mse",
    "eval_rmse",
    "eval_auc",
    "eval_accuracy",
    "eval_loss",
)


def compare(run_dir: str, args: argparse.Namespace) -> dict:
    restored = restore_params(run_dir)
    datasets = build_datasets(restored.config, workload=restored.workload)
    calibration = first_batches(datasets.train, args.calibration_batches)
    probe = first_batches(datasets.eval, 1)[0]
    rows = []
    for scheme in ("float", *args.schemes):
        start = time.perf_counter()
        model = restored
        if scheme != "float":
            model = quantize_restored(restored, scheme, calibration,
                                      percentile=args.calibration_percentile)  # fmt: skip
        convert_s = time.perf_counter() - start
        metrics = evaluate(model, datasets, limit=args.eval_batches)
        rows.append({
            "scheme": scheme,
            "metrics": metrics,
            "param_bytes": weight_bytes(model.variables),
            "latency_ms": 1e3 * latency(model, probe, repeats=args.latency_repeats),
            "convert_s": convert_s,
        })  # fmt: skip
        print(run_dir, scheme, json.dumps(rows[-1]), flush=True)
    return {"run_dir": run_dir, "workload": restored.config.workload, "step": restored.step,
            "rows": rows}  # fmt: skip


def table(results: list[dict], header: str) -> str:
    lines = [header, ""]
    for result in results:
        float_row = result["rows"][0]
        keys = [k for k in HEADLINE if k in float_row["metrics"]]
        keys += [k for k in ("eval_ci", "eval_chrf") if k in float_row["metrics"]]
        lines += [
            f"**{result['workload']}** (`{result['run_dir']}`, step {result['step']})", "",
            "| scheme | " + " | ".join(k.removeprefix("eval_") for k in keys)
            + " | change of " + keys[0].removeprefix("eval_") + " | param bytes | latency ms |",
            "|---|" + "---:|" * (len(keys) + 3),
        ]  # fmt: skip
        base = float_row["metrics"][keys[0]]
        for row in result["rows"]:
            m = row["metrics"]
            change = 100 * (m[keys[0]] / base - 1) if base else float("nan")
            lines.append(
                f"| {row['scheme']} | " + " | ".join(f"{m[k]:.4f}" for k in keys)
                + f" | {change:+.2f} % | {row['param_bytes']:,} | {row['latency_ms']:.2f} |"
            )  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", action="append", required=True)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--calibration-batches", type=int, default=8)
    parser.add_argument("--calibration-percentile", type=float, default=DEFAULT_PERCENTILE)
    parser.add_argument("--eval-batches", type=int, default=None)
    parser.add_argument("--latency-repeats", type=int, default=20)
    parser.add_argument("--out", default="runs/quantize_compare")
    args = parser.parse_args(argv)
    args.schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown:
        print(f"quantize_compare: --schemes: unknown {unknown}; choose from {SCHEMES}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        results = [compare(run_dir, args) for run_dir in args.run_dir]
    except hopperjax.ConfigError as e:
        print(f"quantize_compare: {e}", file=sys.stderr)
        return 2
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    header = (
        f"INT8 post-training quantization against the float model; {jax.default_backend()}, "
        f"{host}; latency: one jitted predict on an eval batch"
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, header)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
