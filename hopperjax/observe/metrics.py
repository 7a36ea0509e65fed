"""Metric sinks: a compact console line, ``metrics.jsonl`` and TensorBoard scalars.

Records are plain dicts of Python numbers, already fetched from the device by the loop at its
log cadence; nothing here touches device arrays, so logging never adds a device sync.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
)


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` line that is not JSON before the last line (the file was edited or
    damaged, not torn by a crash)."""


def read_metrics(path: str | Path, *, torn: list[str] | None = None) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order.

    A last line that is not whole JSON (a crash while appending) is dropped; if ``torn`` is a
    list, a sentence saying so is appended to it.

    Raises:
      MetricsFileError: an earlier line is not JSON (names the file and line).
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise MetricsFileError(f"{path} line {n} is not a JSON record") from None
            if torn is not None:
                torn.append(f"{path} line {n} was cut off mid-record (dropped)")
    return records


def _after_checkpoint(record: dict[str, Any], step: int) -> bool:
    """Train record ``s`` is the update ``s`` -> ``s + 1``; eval record ``s`` is after ``s``."""
    if "loss" in record:
        return record["step"] >= step
    return record["step"] > step


_PERF_KEYS = ("step_time_s", "tflops_per_device", "mfu", "eta_s", "elapsed_s", "profiled")
_DEVICE_KEY = re.compile(r"(gpu|dev)\d+_")


def tb_tag(key: str) -> str:
    """A record key's TensorBoard tag, grouped as TensorBoard shows them: ``eval/`` (the eval
    scores), ``perf/`` (step time, throughput, MFU, ETA), ``gpu/`` (NVML and device-memory
    readings), ``train/`` (loss, lr, norms, everything else)."""
    if key.startswith("eval_"):
        return f"eval/{key.removeprefix('eval_')}"
    if _DEVICE_KEY.match(key):
        return f"gpu/{key}"
    if key in _PERF_KEYS or key.endswith("_per_s"):
        return f"perf/{key}"
    return f"train/{key}"


def _format_console(
    record: dict[str, Any], total_steps: int, examples_name: str = "examples"
) -> str:
    step = record["step"]
    if "eval_loss" in record:
        loss = record["eval_loss"]
        parts = [f"eval  {step:>6d}/{total_steps}", f"loss {loss:.4f}"]
        for key, value in record.items():  # the workload's own scores (accuracy, CI, rm2, ...)
            if not key.startswith("eval_") or key == "eval_loss" or value == loss:
                continue  # a score that is the loss under another name is shown once
            number = f"{value:,.0f}" if float(value).is_integer() else f"{value:.4f}"  # counts
            parts.append(f"{key.removeprefix('eval_')} {number}")
        return " | ".join(parts)
    parts = [  # record s is update s -> s + 1: after it, s + 1 of total_steps are done
        f"step  {step + 1:>6d}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"{record['step_time_s'] * 1e3:.1f} ms/step",
        f"{record[examples_name + '_per_s']:,.0f} {examples_name}/s",
    ]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "eta_s" in record:
        parts.append(f"eta {datetime.timedelta(seconds=round(record['eta_s']))}")
    return " | ".join(parts)


def make_console() -> Console:
    """The console the loop prints to (a function, so that a test can hand in a terminal)."""
    return Console(highlight=False, soft_wrap=True)


def is_live(console: Console) -> bool:
    """Whether ``console`` may animate (spinner, progress bar): a terminal that really is one
    (FORCE_COLOR makes rich call a log file a terminal; it gets plain lines)."""
    if not console.is_terminal:
        return False
    return console.file is not sys.stdout or sys.stdout.isatty()


class MetricsWriter:
    """Writes records to every sink; a writer with ``enabled=False`` (processes > 0) does nothing.

    Args:
      run_dir: ``metrics.jsonl`` and ``tb/`` go here.
      total_steps: for the console's progress display.
      resume_step: on resume, records logged after the checkpoint the run resumes from are
        dropped from ``metrics.jsonl`` (train records of steps >= it, eval records of steps > it);
        the resumed run logs them again.
      enabled: only one process writes.
      console: print a line per record.
      bar: the live progress bar on a terminal (default: with ``console``).
      examples_name: what the throughput counts (the workload's ``examples_name``), for the
        console.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        resume_step: int = 0,
        enabled: bool = True,
        console: bool = True,
        bar: bool | None = None,
        examples_name: str = "examples",
    ):
        self._enabled = enabled
        self._lines = console
        # The bar's label: "train", or in bar-only mode (many runs, one after another) the run's
        # folder name; shown as plain text, never as rich markup or a format string.
        self._label = "train" if bar is None or console else (Path(run_dir).name or "train")
        bar = console if bar is None else bar
        self._examples_name = examples_name
        self._total = total_steps
        self._console = make_console() if (console or bar) and enabled else None
        self._jsonl = None
        self._tb = None
        # On a terminal, a live bar below the log lines (plain lines only elsewhere: CI, logs),
        # started with the first record so that a failing set-up leaves no bar behind.
        self._progress = None
        self._live = bar and self._console is not None and is_live(self._console)
        self._resume_step = resume_step
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        # A fresh start (step 0) keeps nothing: a crashed run's records, step-0 eval included.
        torn: list[str] = []
        kept = [
            r
            for r in read_metrics(path, torn=torn)
            if resume_step and not _after_checkpoint(r, resume_step)
        ]
        for line in torn:
            print(f"hopperjax: {line}", file=sys.stderr)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)  # Atomic: the old log is whole until the trimmed one replaces it.
        self._jsonl = path.open("a")
        from tensorboardX import SummaryWriter  # Deferred: pulls in protobuf, only for writers.

        self._tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        """One record to ``metrics.jsonl`` (as is), TensorBoard (``tb_tag`` groups) and the
        console."""
        if not self._enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = int(record["step"])
        # On TensorBoard's axis, as on the console, a train record of update s stands at s + 1
        # (updates done), beside the eval record made after the same update.
        done = step if "eval_loss" in record else step + 1
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(tb_tag(key), value, done)
        self._tb.flush()
        if self._console is not None and self._lines:
            self._console.print(_format_console(record, self._total, self._examples_name))
        if self._live and "loss" in record:
            if self._progress is None:
                self._start_bar()
            rate = record.get(f"{self._examples_name}_per_s")
            status = f"loss {record['loss']:.4f}" + (
                f" | {rate:,.0f} {self._examples_name}/s" if rate is not None else ""
            )
            if "eta_s" in record:  # the loop's own estimate: rich's needs updates < 30 s apart
                status += f" | eta {datetime.timedelta(seconds=round(record['eta_s']))}"
            self._progress.update(self._task, completed=step + 1, status=status)

    def _start_bar(self) -> None:
        self._progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            console=self._console,
            transient=True,
            # Warnings stay on stderr (rich would fold them into stdout while the bar is live).
            redirect_stderr=False,
        )
        self._task = self._progress.add_task(
            self._label, total=self._total, completed=self._resume_step, status=""
        )
        self._progress.start()

    def info(self, message: str) -> None:
        if self._console is not None and self._lines:
            self._console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
