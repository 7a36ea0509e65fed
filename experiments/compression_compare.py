"""Trains one recipe with each gradient-compression setting and compares them.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/compression_compare.py \\
        --config configs/quickstart.yaml mesh.data=8 [key=value ...] \\
        [--variants none,bf16,int8,int8-noef,int8-stochastic] [--out runs/compression_compare]

A variant is ``none`` (XLA's fp32 all-reduce), ``bf16`` or ``int8`` (error feedback, nearest
rounding), with ``-noef`` (no error feedback) and/or ``-stochastic`` (stochastic rounding).
Writes ``table.md`` (final eval loss and its gap to ``none``, the bytes each device sends per
step and their ratio to ``none``, the collectives' payload types, median step time) and
``eval_curves.png`` / ``train_curves.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import plotting

import hopperjax
from hopperjax import xla_cpu
from hopperjax.inspect import inspect_config

WIRE = "collective_wire_bytes_per_step_per_device"


def variant_overrides(name: str) -> list[str]:
    """``int8-noef-stochastic`` -> the comm.* keys it stands for."""
    scheme, *flags = name.split("-")
    unknown = set(flags) - {"noef", "stochastic"}
    if scheme not in ("none", "bf16", "int8") or unknown or (scheme == "none" and flags):
        raise SystemExit(f"compression_compare: unknown variant {name!r}")
    return [
        f"comm.gradient_compression={scheme}",
        f"comm.error_feedback={'false' if 'noef' in flags else 'true'}",
        f"comm.rounding={'stochastic' if 'stochastic' in flags else 'nearest'}",
    ]


def run_variant(config_path: str, overrides: list[str], name: str, out: Path) -> dict:
    config = hopperjax.load_config(
        config_path, [*overrides, *variant_overrides(name), f"run_dir={out / name}"]
    )
    report = inspect_config(config)
    result = hopperjax.train(config, console="bar")
    train = [r for r in result.history if "loss" in r]
    evals = [r for r in result.history if "eval_loss" in r]
    payloads = sorted(
        {f"{c['kind']} {c['dtype']}" for c in report["collectives"] if c["bytes"] > 64}
    )
    return {
        "variant": name,
        "steps": [r["step"] for r in train],
        "losses": [r["loss"] for r in train],
        "eval_steps": [r["step"] for r in evals],
        "eval_losses": [r["eval_loss"] for r in evals],
        "eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
        "wire_mib": report[WIRE] / 2**20,
        "payloads": ", ".join(payloads),
        "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in train[1:] or train),
    }


def write_table(rows: list[dict], path: Path) -> str:
    base = next((r for r in rows if r["variant"] == "none"), None)
    lines = [
        "| variant | eval loss | vs none | MiB sent/step/device | vs none | payloads | step ms |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        gap = f"{r['eval_loss'] / base['eval_loss'] - 1:+.2%}" if base else "-"
        ratio = f"{r['wire_mib'] / base['wire_mib']:.3f}" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['eval_loss']:.4f} | {gap} | {r['wire_mib']:.3f} | {ratio} | "
            f"{r['payloads']} | {r['step_ms']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[dict], out: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    for key, steps, name in (
        ("eval_losses", "eval_steps", "eval_curves.png"),
        ("losses", "steps", "train_curves.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in rows:
            ax.plot(
                r[steps], r[key], label=r["variant"], marker="o" if key == "eval_losses" else None
            )
        ax.set_xlabel("step")
        ax.set_ylabel(key.replace("_", " ").rstrip("es") if key == "losses" else "eval loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--variants", default="none,bf16,int8,int8-noef,int8-stochastic")
    parser.add_argument("--out", default="runs/compression_compare")
    args = parser.parse_intermixed_args(argv)
    xla_cpu.prepare_script(args.config, args.overrides)  # its XLA flags, before JAX starts
    variants = args.variants.split(",")
    for name in variants:
        variant_overrides(name)
    if jax.device_count() < 2:
        print(
            "compression_compare: needs several devices; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in variants:
        rows.append(run_variant(args.config, args.overrides, name, out))
        print(f"{name}: eval loss {rows[-1]['eval_loss']:.4f}", flush=True)
    print(write_table(rows, out / "table.md"))
    plot(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
