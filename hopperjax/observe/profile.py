"""Profiler windows: a ``jax.profiler`` trace over a few chosen steps, and per-step annotations.

A trace of every step would be huge and would slow the run, so the loop opens one window of
``num_steps`` steps starting at ``start_step`` (after compilation and warm-up, so the trace shows
the steady state). The trace lands in ``log_dir/plugins/profile/<run>/``:

- ``<host>.xplane.pb``: the XSpace that TensorBoard's profile plugin and XProf read;
- ``<host>.trace.json.gz``: the same timeline as Chrome trace-event JSON (read by
  ``tools/profile_summary.py``);
- ``perfetto_trace.json.gz``: that JSON without its ``metadata`` field, which Perfetto's UI
  rejects; written when this JAX's ``start_trace`` takes ``create_perfetto_trace``.

Steps are marked with ``jax.profiler.StepTraceAnnotation`` (XProf's step-time analysis keys on it)
and, where the ``nvtx`` package imports, an NVTX range, so Nsight Systems shows the same steps.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

try:  # Optional: NVTX ranges only matter under Nsight Systems, and nvtx is a GPU-side extra.
    import nvtx as _nvtx
except ImportError:
    _nvtx = None

# Checked once: not every JAX version we may meet has the keyword.
_HAS_PERFETTO_TRACE = (
    "create_perfetto_trace" in inspect.signature(jax.profiler.start_trace).parameters
)


@contextlib.contextmanager
def step_annotation(step: int) -> Iterator[None]:
    """Marks one training step in the profiler timeline (and in Nsight, where nvtx imports).

    Cheap when no trace is running: a TraceMe that nobody records, and an NVTX range that no
    tool listens to, so the loop may wrap every step in it.

    Args:
      step: the step number, shown as ``train <step>`` and used by XProf's per-step analysis.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.profiler.StepTraceAnnotation("train", step_num=step))
        if _nvtx is not None:
            stack.enter_context(_nvtx.annotate(f"step {step}"))
        yield


class ProfileWindow:
    """Traces steps ``start_step .. start_step + num_steps - 1`` into ``log_dir``.

    The loop calls ``before_step(step)`` before dispatching a step and ``after_step(step,
    outputs)`` after; ``close()`` when the run ends. A window with ``enabled=False`` or
    ``num_steps <= 0`` does nothing. The window starts only at exactly ``start_step``: a run
    resumed past it is not traced.

    Args:
      log_dir: where the trace goes (``run_dir/profile``); created when the trace starts.
      start_step: the first traced step.
      num_steps: how many steps to trace.
      enabled: e.g. only on some processes.
    """

    def __init__(
        self, log_dir: str | Path, *, start_step: int, num_steps: int, enabled: bool = True
    ):
        self.log_dir = Path(log_dir)
        self.start_step = start_step
        self.num_steps = num_steps
        self.enabled = enabled and num_steps > 0
        self._active = False  # This window started a trace that is still running.
        self._done = False

    @property
    def active(self) -> bool:
        """Whether this window's trace is running now."""
        return self._active

    @property
    def done(self) -> bool:
        """Whether this window's trace was started and has been stopped (and written)."""
        return self._done

    @property
    def last_step(self) -> int:
        return self.start_step + self.num_steps - 1

    def before_step(self, step: int) -> None:
        """Starts the trace when ``step`` is the window's first step.

        Raises:
          RuntimeError: another ``jax.profiler`` trace is already running in this process.
        """
        if not self.enabled or self._active or self._done or step != self.start_step:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"create_perfetto_trace": True} if _HAS_PERFETTO_TRACE else {}
        if hasattr(jax.profiler, "ProfileOptions"):
            # Python call tracing records every interpreter call (~500k events for two tiny
            # steps) and slows the traced steps 100x; the XLA ops and step markers are what
            # the trace is for.
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            kwargs["profiler_options"] = options
        jax.profiler.start_trace(str(self.log_dir), **kwargs)
        self._active = True

    def after_step(self, step: int, outputs: Any) -> None:
        """Stops the trace after the window's last step, once that step's work has finished.

        Args:
          step: the step just dispatched.
          outputs: that step's outputs (any pytree of arrays). Dispatch is asynchronous: without
            waiting for them the trace would stop before the device has run the last step.
        """
        if not self._active or step != self.last_step:
            return
        jax.block_until_ready(outputs)  # The one deliberate sync: only at the window's end.
        self._stop()

    def close(self) -> None:
        """Stops a trace still running (the run ended inside the window). Never raises."""
        if self._active:
            self._stop()

    def _stop(self) -> None:
        self._active = False
        self._done = True
        # A profiling side effect must not end the run. RuntimeError: "No profile started",
        # someone else stopped the process-wide trace first. ValueError: JAX's Perfetto copy
        # wants exactly one *.trace.json.gz in the newest run folder, which fails when several
        # hosts share log_dir; the xplane.pb and trace.json.gz are already written by then.
        with contextlib.suppress(RuntimeError, ValueError):
            jax.profiler.stop_trace()
