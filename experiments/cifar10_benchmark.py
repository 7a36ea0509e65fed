"""CIFAR-10 to a target accuracy: seeds x precisions of one image recipe, a table and a plot.

    python experiments/cifar10_benchmark.py [--config configs/cifar10_resnet.yaml]
        [--data data/cifar10] [--seeds 0,1,2] [--precisions bf16]
        [--target 0.94] [--out runs/cifar10_benchmark] [key=value ...]

Each run is one ``hopperjax.train`` of the recipe (seed and precision set, the test split
evaluated every ``train.eval_every`` steps). Per run it records the final test accuracy, the first
evaluation at or above ``--target`` (its step and seconds of training since the first step:
evaluations and saves included, compile excluded), the compile time, the median step time and the
whole call's wall time (loading, decoding and compiling included), of which reading the data
took ``data_s``. Runs already in
``OUT/results.json`` are kept, so the benchmark can run one seed at a time and resumes where it
stopped (a run that did not finish starts again from scratch: its times must be one uninterrupted
run). Writes ``table.md`` (mean +- std of the final accuracy per precision, then a row per run),
``results.json`` and ``accuracy.png`` (test accuracy against training time, one line per run).
Order: every precision of the first seed, then the next seed, so a cut benchmark still compares
precisions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plotting
from dta_benchmark import cpu_name

import hopperjax
from hopperjax import xla_cpu


def run_one(config_path: str, overrides: list[str], seed: int, precision: str, out: Path,
            target: float) -> dict:  # fmt: skip
    name = f"{precision}_seed{seed}"
    config = hopperjax.load_config(
        config_path, [*overrides, f"seed={seed}", f"precision={precision}", f"run_dir={out / name}"]
    )
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    wall_s = time.perf_counter() - start
    evals = [r for r in result.history if "eval_accuracy" in r]
    if not evals:
        raise SystemExit(f"{name}: no evaluation ran; set train.eval_every <= train.steps")
    reached = next((r for r in evals if r["eval_accuracy"] >= target), None)
    step_times = [r["step_time_s"] for r in result.history if "step_time_s" in r]
    return {
        "name": name,
        "seed": seed,
        "precision": precision,
        "steps": config.train.steps,
        "accuracy": evals[-1]["eval_accuracy"],
        "best_accuracy": max(r["eval_accuracy"] for r in evals),
        "target": target,
        "target_step": reached["step"] if reached else None,
        "target_s": reached["elapsed_s"] if reached else None,
        "train_s": evals[-1]["elapsed_s"],
        "compile_s": result.compile_s,
        "data_s": result.data_s,
        "step_s": float(np.median(step_times)) if step_times else None,
        "wall_s": wall_s,
        "curve": [(r["step"], r["elapsed_s"], r["eval_accuracy"]) for r in evals],
    }


def write_table(runs: list[dict], header: str, path: Path) -> str:
    lines = [header, "", "| precision | runs | final test accuracy | runs at target |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for precision in dict.fromkeys(r["precision"] for r in runs):
        mine = [r for r in runs if r["precision"] == precision]
        acc = np.array([r["accuracy"] for r in mine]) * 100
        hit = sum(r["target_step"] is not None for r in mine)
        lines.append(
            f"| {precision} | {len(mine)} | {acc.mean():.2f} % ± {acc.std():.2f} | "
            f"{hit} of {len(mine)} |"
        )
    lines += [
        "",
        "| run | final acc | best acc | target reached at (step, s) | train s | compile s | "
        "data s | s/step | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        at = (f"{r['target_step']}, {r['target_s']:.1f}" if r["target_step"] is not None
              else f"not reached ({r['target']:.1%})")  # fmt: skip
        step = "–" if r["step_s"] is None else f"{r['step_s']:.4f}"
        lines.append(
            f"| {r['name']} | {r['accuracy']:.2%} | {r['best_accuracy']:.2%} | {at} | "
            f"{r['train_s']:.1f} | {r['compile_s']:.1f} | {r.get('data_s', 0):.1f} | {step} | "
            f"{r['wall_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(runs: list[dict], target: float, path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        _, seconds, acc = zip(*r["curve"], strict=True)
        ax.plot(seconds, np.array(acc) * 100, marker=".", label=r["name"])
    ax.axhline(target * 100, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("training time, s (compile excluded)")
    ax.set_ylabel("test accuracy, %")
    ax.set_ylim(max(0, target * 100 - 30), 100)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/cifar10_resnet.yaml")
    parser.add_argument("--data", default=None, help="data.path (the recipe's when omitted)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--precisions", default="bf16")
    parser.add_argument("--target", type=float, default=0.94)
    parser.add_argument("--out", default="runs/cifar10_benchmark")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = ([f"data.path={args.data}"] if args.data else []) + args.overrides
    plan = [(int(s), p) for s in args.seeds.split(",") for p in args.precisions.split(",")]
    results = out / "results.json"
    done = {r["name"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    for seed, precision in plan:
        name = f"{precision}_seed{seed}"
        if name in done:
            print(f"{name}: kept from {results}", flush=True)
            continue
        if (out / name).exists():
            print(f"{name}: discarding an unfinished run", flush=True)
            shutil.rmtree(out / name)
        r = done[name] = run_one(args.config, overrides, seed, precision, out, args.target)
        at = (f"step {r['target_step']} ({r['target_s']:.1f} s)" if r["target_step"] is not None
              else "never")  # fmt: skip
        print(f"{name}: test accuracy {r['accuracy']:.2%} (best {r['best_accuracy']:.2%}); "
              f"{args.target:.0%} at {at}; {r['train_s']:.1f} s training, "
              f"{r['compile_s']:.1f} s compile, {r['wall_s']:.1f} s wall", flush=True)  # fmt: skip
        partial = results.with_suffix(".json.tmp")
        partial.write_text(json.dumps(list(done.values())))
        partial.replace(results)
    runs = [done[f"{p}_seed{s}"] for s, p in plan]
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    header = (
        f"{args.config} {' '.join(overrides)}; {len(runs)} runs on {jax.device_count()} "
        f"{jax.default_backend()} device(s), {host}; target {args.target:.1%}"
    )
    print(write_table(runs, header, out / "table.md"))
    plot(runs, args.target, out / "accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
