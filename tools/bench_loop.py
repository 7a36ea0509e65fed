"""Is the loop free? Times, in one process, on one config:

(a) the bare compiled train step on batches already on the device,
(b) the full hopperjax loop (input pipeline, device prefetch, metrics at the default cadence;
    checkpoints only at the end, outside the timed windows),
(c) the input pipeline alone (host batches, and host batches assembled on the devices),
(d) the workload's on-device preprocessing alone (augmentation, normalization: the part of (a)
    that a host pipeline such as DALI would otherwise do), and the bytes a batch moves from host
    to device,

and prints one JSON object. Targets: loop / bare <= 1.05 and pipeline >= 5x what the step consumes.

    python tools/bench_loop.py --config configs/quickstart.yaml [key=value ...] [--steps 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time

import jax

import hopperjax
from hopperjax import xla_cpu
from hopperjax.data import DevicePrefetcher, make_iterator
from hopperjax.memory import host_heap
from hopperjax.trainer import build_components


def _time_chunks(run_chunk, *, chunks: int) -> list[float]:
    times = []
    for _ in range(chunks):
        start = time.perf_counter()
        run_chunk()
        times.append(time.perf_counter() - start)
    return times


def bare_step_seconds(
    config: hopperjax.Config, *, steps: int, chunk: int
) -> tuple[float, dict[str, float]]:
    """Median per-step time of the compiled step alone, batches resident on the devices, with
    the loop's host heap setting (``train.host_heap_pad_mib``); and (d) on the same batches."""
    parts = build_components(config)
    state = parts.init_state()
    step = parts.lower_train_step().compile()
    heap = host_heap.keep_step_memory(config.train.host_heap_pad_mib, compiled_steps=[step])
    print(heap.describe(), file=sys.stderr)
    batches = DevicePrefetcher(
        make_iterator(parts.datasets.train, config.data),
        parts.batch_sharding,
        depth=2,
        blocks=parts.batch_blocks,
    )
    resident = [next(batches) for _ in range(4)]
    batches.close()
    feed = itertools.cycle(resident)
    holder = {"state": state}

    def run_chunk() -> None:
        for _ in range(chunk):
            holder["state"], metrics = step(holder["state"], next(feed))
        jax.block_until_ready(metrics)

    run_chunk()  # warm-up
    times = _time_chunks(run_chunk, chunks=max(1, steps // chunk))
    return statistics.median(times) / chunk, preprocess_cost(parts, resident, steps=steps)


def preprocess_cost(parts, batches: list, *, steps: int) -> dict[str, float]:
    """(d): median seconds of the jitted ``workload.preprocess`` (train mode) on resident
    batches, and the bytes of one batch as it travels from the host."""
    fn = jax.jit(lambda batch, key: parts.workload.preprocess(batch, key, train=True))
    key = jax.random.key(0)
    jax.block_until_ready(fn(batches[0], key))
    times = []
    for i in range(max(3, steps // 4)):
        start = time.perf_counter()
        jax.block_until_ready(fn(batches[i % len(batches)], key))
        times.append(time.perf_counter() - start)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(batches[0]))
    return {"preprocess_s": statistics.median(times), "batch_bytes_to_device": nbytes}


def loop_step_seconds(config: hopperjax.Config, *, steps: int) -> float:
    """Median of the loop's own logged step times, first window (warm-up) excluded."""
    t = config.train
    with tempfile.TemporaryDirectory() as run_dir:
        run = config.replace(**{
            "run_dir": run_dir,
            "train.steps": steps + t.log_every,
            "train.stop_after": None,
            "train.eval_every": steps + t.log_every,
            "train.checkpoint_every": 10 * (steps + t.log_every),
        })  # fmt: skip
        result = hopperjax.train(run, console=False)
    times = [r["step_time_s"] for r in result.history if "step_time_s" in r][1:]
    return statistics.median(times)


def pipeline_batches_per_second(config: hopperjax.Config, *, batches: int) -> dict[str, float]:
    parts = build_components(config)
    host = make_iterator(parts.datasets.train, config.data)
    next(host)
    start = time.perf_counter()
    for _ in range(batches):
        next(host)
    host_rate = batches / (time.perf_counter() - start)

    device = DevicePrefetcher(
        make_iterator(parts.datasets.train, config.data),
        parts.batch_sharding,
        depth=config.data.device_prefetch,
        blocks=parts.batch_blocks,
    )
    jax.block_until_ready(next(device))
    start = time.perf_counter()
    for _ in range(batches):
        last = next(device)
    jax.block_until_ready(last)
    device_rate = batches / (time.perf_counter() - start)
    device.close()
    return {"host_batches_per_s": host_rate, "device_batches_per_s": device_rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--steps", type=int, default=60, help="timed steps for (a) and (b)")
    parser.add_argument("--chunk", type=int, default=10, help="steps per timed chunk in (a)")
    parser.add_argument("--pipeline-batches", type=int, default=200)
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts
    config = hopperjax.load_config(args.config, args.overrides)

    bare, preprocess = bare_step_seconds(config, steps=args.steps, chunk=args.chunk)
    loop = loop_step_seconds(config, steps=args.steps)
    pipeline = pipeline_batches_per_second(config, batches=args.pipeline_batches)
    consumed = 1.0 / bare
    report = {
        "config": config.name,
        "devices": jax.device_count(),
        "bare_step_s": bare,
        "loop_step_s": loop,
        "loop_over_bare": loop / bare,
        "step_batches_per_s": consumed,
        **pipeline,
        "pipeline_over_step": min(pipeline.values()) / consumed,
        **preprocess,
        "preprocess_share_of_step": preprocess["preprocess_s"] / bare,
    }
    report["ok"] = report["loop_over_bare"] <= 1.05 and report["pipeline_over_step"] >= 5.0
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
