"""What the benchmark scripts read back from a run directory: its checkpoints and step times."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of a run directory's committed checkpoints, in order (an unfinished save is a
    temporary directory whose name is not a number)."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def steps_seconds(records: list[dict[str, Any]]) -> float:
    """The training steps' time over every process of a run: each logged window's mean step time
    (``step_time_s``) times the steps it covers; without compiles, evaluations and restarts.
    ``records``: the run's train records that carry ``step_time_s``, in step order."""
    previous = [-1] + [r["step"] for r in records[:-1]]
    return float(
        sum(r["step_time_s"] * (r["step"] - p) for r, p in zip(records, previous, strict=True))
    )
