"""The largest global batch that fits device memory, per remat policy, from compiles alone.

    python tools/find_batch.py --config configs/X.yaml [key=value ...] [--budget-gb G]
        [--policies none,dots_no_batch,dots,full] [--microbatches 1,4] [--tolerance 0.05]
        [--measure-steps N] [--json PATH]

Nothing runs on the device: each probe compiles the train step for one batch size and reads
XLA's memory analysis (``hopperjax/memory/budget.py``). Prints a markdown table (largest batch,
peak memory, FLOPs and recompute per policy and microbatch count, the LR the configured scaling
rule gives that batch) and the pick: the largest batch, with the least recompute among ties.
``--measure-steps N`` then runs each row's batch for N steps and prints its throughput, since the
largest batch is not always the fastest once recompute is paid for.
The default budget is the device allocator's limit less ``--headroom``; CPUs need --budget-gb.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from hopperjax import workloads, xla_cpu
from hopperjax.config import ConfigError, load_config
from hopperjax.memory import budget
from hopperjax.parallel import build_mesh
from hopperjax.trainer import measure


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/find_batch.py", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--budget-gb", type=float, help="device memory budget per device, GiB")
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        help="fraction of the device's capacity left free by default (0.05)",
    )
    parser.add_argument(
        "--policies", default=None, help="comma-separated remat policies (default: the config's)"
    )
    parser.add_argument(
        "--microbatches",
        default=None,
        type=_ints,
        help="comma-separated microbatch counts (default: the config's)",
    )
    parser.add_argument("--max-batch", type=int, default=2**20)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="stop when the fit/miss gap is this fraction of the fit (0: exact)",
    )
    parser.add_argument(
        "--measure-steps",
        type=int,
        default=0,
        help="also time this many steps at each row's batch (needs the device)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every probe as JSON")
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts

    try:
        config = load_config(args.config, args.overrides)
        device = build_mesh(config.mesh).devices.flat[0]
        if args.budget_gb is not None:
            budget_bytes = int(args.budget_gb * budget.GIB)
        else:
            budget_bytes = budget.default_budget_bytes(device, args.headroom)
            if budget_bytes is None:
                raise ConfigError(
                    "--budget-gb",
                    f"the {device.platform} backend reports no memory capacity; pass --budget-gb",
                )
        policies = (args.policies or config.remat.policy).split(",")
        counts = args.microbatches or [config.train.microbatches]
        searches = []
        for policy in policies:
            for k in counts:
                variant = config.replace(
                    **{
                        "remat.policy": policy.strip(),
                        "train.microbatches": k,
                        "train.batch_size": k,
                    }
                )
                search = measure.find_largest_batch(
                    variant,
                    budget_bytes=budget_bytes,
                    max_batch_size=args.max_batch,
                    tolerance=args.tolerance,
                )
                searches.append(search)
                print(
                    f"  {policy} x{k}: {search.batch_size} after {len(search.probes)} compiles",
                    file=sys.stderr,
                    flush=True,
                )
    except ConfigError as e:
        print(f"find_batch: config error: {e}", file=sys.stderr)
        return 2

    devices = jax.device_count()
    workload = workloads.from_config(config)
    unit = workload.examples_name
    print(
        f"budget {budget_bytes / budget.GIB:.3f} GiB per device on {device.device_kind}, "
        f"{devices} devices, workload {config.workload} ({unit} per batch row: "
        f"{workload.examples_per_step(1)})"
    )
    print(budget.search_table(searches))
    measured = []
    for s in searches if args.measure_steps else []:
        if s.batch_size is None:
            continue
        run = measure.at_batch(
            config.replace(**{"remat.policy": s.remat, "train.microbatches": s.microbatches}),
            s.batch_size,
        )
        seconds = measure.measure_step_seconds(run, steps=args.measure_steps)
        examples = workload.examples_per_step(s.batch_size)
        model_tflops = s.best.model_flops_per_device * devices / seconds / 1e12
        measured.append(
            {
                "remat": s.remat,
                "microbatches": s.microbatches,
                "batch_size": s.batch_size,
                "step_s": seconds,
                f"{unit}_per_s": examples / seconds,
                "model_tflops": model_tflops,
            }
        )
        print(
            f"measured: remat {s.remat} x{s.microbatches} batch {s.batch_size}: "
            f"{seconds * 1e3:.1f} ms/step, {examples / seconds:,.0f} {unit}/s, "
            f"{model_tflops / devices:.3g} model TFLOP/s per device",
            flush=True,
        )
    fitting = [s for s in searches if s.best is not None]
    if fitting:
        pick = max(fitting, key=lambda s: (s.batch_size, -s.best.flops_per_device))
        print(
            f"pick: remat.policy={pick.remat} train.microbatches={pick.microbatches} "
            f"train.batch_size={pick.batch_size}  (peak LR {pick.learning_rate:.3g} by "
            f"optim.lr_scaling={config.optim.lr_scaling})"
        )
    else:
        print("pick: nothing fits this budget; lower model size or sequence length")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"searches": budget.searches_to_json(searches), "measured": measured}, indent=1
            )
        )
    return 0 if fitting else 1


if __name__ == "__main__":
    sys.exit(main())
