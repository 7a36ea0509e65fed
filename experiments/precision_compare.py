"""Trains one model under each precision policy and compares them.

    python experiments/precision_compare.py --config configs/quickstart.yaml [key=value ...]
        [--policies fp32,bf16,fp16,fp8] [--out runs/precision_compare]

Writes ``table.md`` (final train loss, eval loss and its gap to fp32, every other metric of the
workload's last eval (accuracy, say) and its difference from fp32's, median step time,
per-device temporary and argument bytes from the compiled step) and ``loss_curves.png``. Any
workload: the image recipe's precision comparison is
``--config configs/cifar10_resnet.yaml --policies fp32,bf16,fp16`` (a GPU run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import plotting

import hopperjax
from hopperjax import xla_cpu
from hopperjax.inspect import inspect_config


def run_policy(config_path: str, overrides: list[str], policy: str, out: Path) -> dict:
    config = hopperjax.load_config(
        config_path, [*overrides, f"precision={policy}", f"run_dir={out / policy}"]
    )
    report = inspect_config(config)
    result = hopperjax.train(config, console="bar")
    train = [r for r in result.history if "loss" in r]
    evals = [r for r in result.history if "eval_loss" in r]
    return {
        "policy": policy,
        "steps": [r["step"] for r in train],
        "losses": [r["loss"] for r in train],
        "final_loss": train[-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
        "evals": {
            k: v
            for k, v in (evals[-1] if evals else {}).items()
            if k.startswith("eval_") and k != "eval_loss"
        },
        "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in train[1:] or train),
        "temp_mib": report["memory"]["temp_bytes"] / 2**20,
        "argument_mib": report["memory"]["argument_bytes"] / 2**20,
    }


def write_table(rows: list[dict], path: Path) -> str:
    fp32 = next((r for r in rows if r["policy"] == "fp32"), None)
    reference = fp32["eval_loss"] if fp32 else None
    extra = list(dict.fromkeys(k for r in rows for k in r.get("evals", {})))
    lines = [
        "| policy | final train loss | eval loss | vs fp32 | "
        + "".join(f"{k} | vs fp32 | " for k in extra)
        + "step ms | temp MiB | args MiB |",
        "|---|---:|---:|---:|" + "---:|---:|" * len(extra) + "---:|---:|---:|",
    ]
    for r in rows:
        gap = f"{(r['eval_loss'] / reference - 1):+.2%}" if reference else "-"
        cells = ""
        for k in extra:
            value = r.get("evals", {}).get(k)
            base = fp32.get("evals", {}).get(k) if fp32 else None
            diff = f"{value - base:+.4f}" if value is not None and base is not None else "-"
            cells += f"{'-' if value is None else f'{value:.4f}'} | {diff} | "
        lines.append(
            f"| {r['policy']} | {r['final_loss']:.4f} | {r['eval_loss']:.4f} | {gap} | {cells}"
            f"{r['step_ms']:.1f} | {r['temp_mib']:.1f} | {r['argument_mib']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(r["steps"], r["losses"], label=r["policy"])
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--policies", default="fp32,bf16,fp16,fp8")
    parser.add_argument("--out", default="runs/precision_compare")
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_policy(args.config, args.overrides, p, out) for p in args.policies.split(",")]
    print(write_table(rows, out / "table.md"))
    plot(rows, out / "loss_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
