"""The end of a run: a summary with the next commands, and loss curves in ``run_dir/plots``."""

from __future__ import annotations

import importlib.util
import math
import shlex
from pathlib import Path
from typing import Any

from hopperjax import files


def summary_lines(
    run_dir: Path,
    records: list[dict[str, Any]],
    checkpoint_steps: list[int],
    next_commands: list[str],
    *,
    total_steps: int | None = None,
    single_device: bool = True,
) -> list[str]:
    """What a finished invocation prints: where it ended (train record ``s`` is update
    ``s`` -> ``s + 1``), its best eval, where its checkpoints and plots are, and what to run next
    (the workload's commands first; ``inspect`` of the saved config only for a one-device mesh,
    which any shell can rebuild)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if _finite(r.get("eval_loss"))]
    where = shlex.quote(str(run_dir))
    lines = []
    if train:
        last = train[-1]
        done = int(last["step"]) + 1
        ended = "done" if total_steps is None or done >= total_steps else "stopped"
        head = f"hopperjax: {ended} at step {done}"
        head += f" of {total_steps}" if total_steps is not None and done < total_steps else ""
        head += f" | last train loss {last['loss']:.4f}"
        if evals:
            best = min(evals, key=lambda r: r["eval_loss"])
            head += f" | best eval loss {best['eval_loss']:.4f} at step {int(best['step'])}"
        lines.append(head)
    if checkpoint_steps:
        shown = ", ".join(str(s) for s in checkpoint_steps)
        lines.append(f"  checkpoints: {run_dir / 'checkpoints'} (steps {shown})")
    plots = run_dir / "plots"
    viz = "the viz extra: pip install -e '.[viz]'"
    if plots.is_dir():
        lines.append(f"  plots:       {plots}")
    elif importlib.util.find_spec("matplotlib") is None:
        lines.append(f"  plots:       none without matplotlib ({viz})")
    lines.append(f"  metrics:     {run_dir / 'metrics.jsonl'}")
    board = f"tensorboard --logdir {where}/tb"
    if importlib.util.find_spec("tensorboard") is None:
        board += f"   # {viz}"
    commands = [*next_commands, board]
    if single_device:
        commands.append(f"python -m hopperjax.inspect --config {where}/config.yaml --format table")
    commands.append(f"python -m hopperjax.export --run-dir {where} --out {where}/export")
    lines.append("  next:")
    lines.extend(f"    {command}" for command in commands)
    return lines


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _score_keys(evals: list[dict[str, Any]]) -> list[str]:
    """The eval scores worth a panel: every ``eval_*`` key but the loss, over the records that
    carry it (generation metrics come only every ``generate_every``), counts left out."""
    keys = sorted({k for r in evals for k in r if k.startswith("eval_") and k != "eval_loss"})
    out = []
    for key in keys:
        values = [r[key] for r in evals if _finite(r.get(key))]
        counts = all(float(v).is_integer() and v > 1 for v in values)  # eval_pairs, tokens
        if values and not counts:
            out.append(key)
    return out


def write_plots(run_dir: Path, records: list[dict[str, Any]]) -> list[Path]:
    """``run_dir/plots/loss.png`` (train and eval loss against step) and, when the eval records
    carry scores besides the loss, ``eval.png``; nothing without matplotlib (the ``viz``
    extra). Figures are drawn without pyplot, so a notebook's backend is left alone; each file
    appears whole or not at all. Returns the files written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []
    train = [r for r in records if _finite(r.get("loss"))]
    evals = [r for r in records if _finite(r.get("eval_loss"))]
    if not train and not evals:
        return []
    out = run_dir / "plots"
    written = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        files.atomic_write(path, lambda temp: fig.savefig(temp, dpi=110, format="png"))
        written.append(path)

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    if train:  # after update s the loss of record s was seen: plotted at s + 1 updates
        ax.plot([r["step"] + 1 for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "loss.png")
    scores = _score_keys(evals)
    if scores:
        fig = Figure(figsize=(4 * len(scores), 3.5))
        for i, key in enumerate(scores):
            ax = fig.add_subplot(1, len(scores), i + 1)
            have = [r for r in evals if _finite(r.get(key))]
            ax.plot([r["step"] for r in have], [r[key] for r in have], "o-")
            ax.set_title(key.removeprefix("eval_"))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        save(fig, "eval.png")
    return written
