"""The end of a run: a summary with the next commands, and loss curves in ``run_dir/plots``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def summary_lines(
    run_dir: Path,
    records: list[dict[str, Any]],
    checkpoint_steps: list[int],
    next_commands: list[str],
) -> list[str]:
    """What a finished invocation prints: where it ended, its best eval, where its checkpoints
    and plots are, and what to run next (the workload's commands first)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    where = shlex.quote(str(run_dir))
    lines = []
    if train:
        last = train[-1]
        lines.append(
            f"hopperjax: done at step {int(last['step']) + 1} | last train loss "
            f"{last['loss']:.4f}"
            + (
                f" | best eval loss {min(r['eval_loss'] for r in evals):.4f} at step "
                f"{int(min(evals, key=lambda r: r['eval_loss'])['step'])}"
                if evals
                else ""
            )
        )
    if checkpoint_steps:
        shown = ", ".join(str(s) for s in checkpoint_steps)
        lines.append(f"  checkpoints: {run_dir / 'checkpoints'} (steps {shown})")
    plots = run_dir / "plots"
    if plots.is_dir():
        lines.append(f"  plots:       {plots}")
    lines.append(f"  metrics:     {run_dir / 'metrics.jsonl'}")
    lines.append("  next:")
    for command in [
        *next_commands,
        f"tensorboard --logdir {where}/tb",
        f"python -m hopperjax.inspect --config {where}/config.yaml --format table",
        f"python -m hopperjax.export --run-dir {where} --out {where}/export",
    ]:
        lines.append(f"    {command}")
    return lines


def write_plots(run_dir: Path, records: list[dict[str, Any]]) -> list[Path]:
    """``run_dir/plots/loss.png`` (train and eval loss against step) and, when the eval records
    carry scores besides the loss, ``eval.png``; nothing without matplotlib (the ``viz``
    extra). Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train and not evals:
        return []
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] + 1 for r in train], [r["loss"] for r in train], label="train")
    if evals:
        steps = [r["step"] for r in evals]
        ax.plot(steps, [r["eval_loss"] for r in evals], marker="o", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    written.append(out / "loss.png")
    scores = sorted(
        {k for r in evals for k, v in r.items() if k.startswith("eval_") and k != "eval_loss"}
        - {"eval_elapsed_s"}
    )
    scores = [k for k in scores if all(isinstance(r.get(k), int | float) for r in evals)]
    if scores:
        fig, axes = plt.subplots(1, len(scores), figsize=(4 * len(scores), 3.5), squeeze=False)
        for ax, key in zip(axes[0], scores, strict=True):
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], marker="o")
            ax.set_title(key.removeprefix("eval_"))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "eval.png", dpi=110)
        plt.close(fig)
        written.append(out / "eval.png")
    return written
