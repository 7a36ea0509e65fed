"""DLRM layouts on 8 (fake) devices: throughput, per-device memory and collectives per layout.

    python experiments/dlrm_layouts.py [--config configs/dlrm_criteo.yaml] [--steps 10]
        [--only NAME ...] [--out runs/dlrm_layouts] [key=value ...]

For each layout (tables replicated, split row-wise over tensor or over every device, placed
whole table-wise, or the mix), one ``tools/bench_loop.py`` (the bare compiled step: examples/s)
and one ``python -m hopperjax.inspect`` (state and temporaries per device, collective bytes by
kind), each in its own process with ``--xla_force_host_platform_device_count`` set (1 for the
single-device row). The data are generated clicks (the recipe's shapes); row-sparse updates on.
Writes ``OUT/table.md`` and ``OUT/results.json``. On one CPU the 8 devices share its cores:
examples/s shows what a partitioning costs in extra work and collectives, not a GPU's scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dta_benchmark import cpu_name

DATA = [
    "data.source=synthetic",
    "data.path=null",
    "data.synthetic_dense=13",
    "data.synthetic_task=clicks",
    "data.synthetic_rows=65536",
    "model.sparse_updates=true",
]
PLACED = ["model.table_placement=tables", "model.table_groups=8"]
EVERYWHERE = ["mesh.data=8", "model.table_sharding=all"]
# name -> (devices, overrides)
LAYOUTS = {
    "1 device": (1, ["mesh.data=1"]),
    "data=8, tables replicated": (8, ["mesh.data=8", "model.table_sharding=tensor"]),
    "rows over tensor=8": (8, ["mesh.data=1", "mesh.tensor=8"]),
    "rows over tensor=4, data=2": (8, ["mesh.data=2", "mesh.tensor=4"]),
    "rows over all, data=8": (8, EVERYWHERE),
    "tables over tensor=8": (8, [*PLACED, "mesh.data=1", "mesh.tensor=8"]),
    "tables over tensor=4, data=2": (8, [*PLACED, "mesh.data=2", "mesh.tensor=4"]),
    "tables over all, data=8": (8, [*PLACED, *EVERYWHERE]),
    "mix (> 65,536 rows by rows), data=8": (
        8,
        [*PLACED, "model.table_wise_max_rows=65536", *EVERYWHERE],
    ),
}


def _json(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])


def measure(args: argparse.Namespace, devices: int, keys: list[str]) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    overrides = [*DATA, *args.overrides, *keys]
    common = ["--config", args.config, *overrides]
    bench = subprocess.run(
        [sys.executable, "tools/bench_loop.py", *common, "--steps", str(args.steps)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    report = subprocess.run(
        [sys.executable, "-m", "hopperjax.inspect", *common],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    bench, report = _json(bench.stdout), _json(report.stdout)
    collectives: dict[str, float] = {}
    for c in report["collectives"]:
        collectives[c["kind"]] = collectives.get(c["kind"], 0.0) + c["bytes"] / 2**20
    return {
        "bare_step_s": bench["bare_step_s"],
        "examples_per_s": report["examples_per_step"] / bench["bare_step_s"],
        "state_mib": report["offload"]["state_bytes_per_device"]["device"] / 2**20,
        "temp_mib": report["memory"]["temp_bytes"] / 2**20,
        "collectives_mib": collectives,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/dlrm_criteo.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None, help="layout names to run")
    parser.add_argument("--out", type=Path, default=Path("runs/dlrm_layouts"))
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (devices, keys) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        results[name] = {"overrides": keys, **measure(args, devices, keys)}
        print(name, json.dumps(results[name]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"DLRM layouts, `{args.config}` (generated clicks, row-sparse updates), {cpu_name()}; "
        "8 fake devices share its cores.",
        "",
        "| layout | examples/s | state MiB/device | step temporaries MiB/device | "
        "collectives MiB/step |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in r["collectives_mib"].items()) or "none"
        lines.append(
            f"| {name} | {r['examples_per_s']:,.0f} | {r['state_mib']:.1f} | "
            f"{r['temp_mib']:.1f} | {kinds} |"
        )
    table = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
