"""nanoGPT's CPU recipe on character-level Tiny Shakespeare, run by hopperjax, beside the peer.

    python experiments/nanogpt_parity.py --data data/tinyshakespeare/input.txt
        [--config configs/shakespeare_char_cpu.yaml] [--seeds 0,1,2] [--out runs/nanogpt_parity]
        [key=value ...]

Each seed trains the recipe through ``hopperjax.train`` with ``train.sync_every_step=true``:
every step is waited for, as PyTorch's eager steps are, and timed on its own (input included).
Reports, per seed and over the seeds: validation loss at steps 0, 250, ..., 2000 (20 random
batches of 12 x 64, as nanoGPT's ``estimate_loss``), the loss over the whole validation split
(windows of 64 in strides of 64: every character but the last few a target once), the median
step time without the first step and without the evaluations, tokens/s, compile time and wall
time. Writes ``table.md``, ``results.json`` and ``loss_curve.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plotting

import hopperjax
from hopperjax.checkpoint import Checkpointer
from hopperjax.data import DevicePrefetcher
from hopperjax.trainer import build_components

# nanoGPT (PyTorch 2.13, fp32) on a 2-core machine of this kind, as given in the issue.
PEER = {
    "val_loss_2000": 1.8857,
    "step_ms": "55-60",
    "tokens_per_s": "13,000-14,000",
    "wall": "about 2 min",
}


def full_validation_loss(config: hopperjax.Config, run_dir: Path, step: int) -> float:
    """Mean next-character loss over the whole validation split, from checkpoint ``step``."""
    whole = config.replace(
        **{"data.sampling": "windows", "train.eval_batches": None, "train.eval_batch_size": 2}
    )
    parts = build_components(whole)
    checkpointer = Checkpointer(run_dir / "checkpoints", every=1, keep=1, async_save=False)
    state, _ = checkpointer.restore(step, parts.abstract_state)
    checkpointer.close()
    eval_step = parts.lower_eval_step().compile()
    batches = DevicePrefetcher(iter(parts.datasets.eval), parts.batch_sharding, 2)
    outputs = jax.device_get([eval_step(state, batch) for batch in batches])
    return parts.workload.summarize(outputs)["eval_loss"]


def run_seed(config_path: str, overrides: list[str], seed: int, out: Path) -> dict:
    if (out / f"seed{seed}").exists():  # it would resume the finished run and time nothing
        raise SystemExit(f"{out / f'seed{seed}'} exists: choose another --out or remove it")
    config = hopperjax.load_config(
        config_path,
        [
            *overrides,
            f"seed={seed}",
            "train.sync_every_step=true",
            f"run_dir={out / f'seed{seed}'}",
        ],
    )
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    wall_s = time.perf_counter() - start
    train = [r for r in result.history if "loss" in r]
    evals = [r for r in result.history if "eval_loss" in r]
    times = [t for r in train for t in r["step_times_s"]][1:]  # step 0 pays one-time costs
    median_s = statistics.median(times)
    tokens = config.train.batch_size * config.data.seq_len
    return {
        "seed": seed,
        "eval": [(r["step"], r["eval_loss"]) for r in evals],
        "full_val_loss": full_validation_loss(config, result.run_dir, config.train.steps),
        "median_step_ms": median_s * 1e3,
        "tokens_per_s": tokens / median_s,
        "compile_s": result.compile_s,
        "wall_s": wall_s,
        "train_loss": [(r["step"], r["loss"]) for r in train],
    }


def write_table(runs: list[dict], header: str, path: Path) -> str:
    def spread(values: list[float], fmt: str) -> str:
        if len(values) == 1:
            return format(values[0], fmt)
        return f"{np.mean(values):{fmt}} ± {np.std(values):{fmt}}"

    steps = [s for s, _ in runs[0]["eval"]]
    by_step = {s: [dict(r["eval"])[s] for r in runs] for s in steps}
    lines = [
        header,
        "",
        f"| | hopperjax ({len(runs)} seed{'s' if len(runs) > 1 else ''}) | nanoGPT (peer) |",
        "|---|---:|---:|",
    ]
    for s in steps:
        # The peer's figure is its step-2,000 loss: shown only beside our step 2,000.
        peer = f"{PEER['val_loss_2000']:.4f}" if s == 2000 else "–"
        lines.append(f"| val loss, step {s} (20 batches) | {spread(by_step[s], '.4f')} | {peer} |")
    lines += [
        f"| val loss, whole split | {spread([r['full_val_loss'] for r in runs], '.4f')} | – |",
        f"| median step time (ms) | {spread([r['median_step_ms'] for r in runs], '.1f')} | "
        f"{PEER['step_ms']} |",
        f"| tokens/s | {spread([r['tokens_per_s'] for r in runs], ',.0f')} | "
        f"{PEER['tokens_per_s']} |",
        f"| compile (s) | {spread([r['compile_s'] for r in runs], '.1f')} | – |",
        f"| wall time (s) | {spread([r['wall_s'] for r in runs], '.0f')} | {PEER['wall']} |",
        "",
        "| seed | val loss @ last step | whole-split val loss | median ms/step | wall s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['eval'][-1][1]:.4f} | {r['full_val_loss']:.4f} | "
            f"{r['median_step_ms']:.1f} | {r['wall_s']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(runs: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        steps, losses = zip(*r["train_loss"], strict=True)
        ax.plot(steps, losses, linewidth=0.5, alpha=0.5, label=f"train, seed {r['seed']}")
        steps, losses = zip(*r["eval"], strict=True)
        ax.plot(steps, losses, marker="o", label=f"val, seed {r['seed']}")
    ax.axhline(PEER["val_loss_2000"], color="black", linestyle="--", label="nanoGPT val @ 2000")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_ylim(1.0, 4.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="Tiny Shakespeare's input.txt")
    parser.add_argument("--config", default="configs/shakespeare_char_cpu.yaml")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default="runs/nanogpt_parity")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.path={args.data}", *args.overrides]
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        runs.append(run_seed(args.config, overrides, seed, out))
        r = runs[-1]
        print(f"seed {seed}: val {r['eval'][-1][1]:.4f} (whole split {r['full_val_loss']:.4f}), "
              f"{r['median_step_ms']:.1f} ms/step, {r['wall_s']:.0f} s", flush=True)  # fmt: skip
        (out / "results.json").write_text(json.dumps(runs))
    header = (
        f"{args.config} {' '.join(overrides)}; {jax.device_count()} "
        f"{jax.devices()[0].device_kind} device(s)"
    )
    print(write_table(runs, header, out / "table.md"))
    plot(runs, out / "loss_curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
