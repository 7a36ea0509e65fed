"""The training loop: the only place with side effects (I/O, logging, checkpoints, signals).

Everything it drives is built first from the config (mesh, model, optimizer, data, compiled
steps); the loop then feeds batches to the compiled step, fetches metrics from the device only at
log steps, evaluates and checkpoints on its cadence, and resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import config as config_lib
from hopperjax import files, xla_cpu
from hopperjax.checkpoint import Checkpointer, CheckpointError
from hopperjax.config import Config, ConfigError
from hopperjax.data import DevicePrefetcher, make_iterator, position_problem, run_alone
from hopperjax.memory import budget, host_heap
from hopperjax.observe import MetricsWriter, read_metrics, summary
from hopperjax.observe import metrics as metrics_lib
from hopperjax.observe.flops import Throughput
from hopperjax.observe.gpu import GpuMonitor, device_memory_stats
from hopperjax.observe.profile import ProfileWindow, step_annotation
from hopperjax.parallel import process_agrees
from hopperjax.trainer.components import Components, build_components
from hopperjax.trainer.resume import check_resumable
from hopperjax.trainer.state import TrainState

# Steps the host may dispatch beyond the one the device is running. Unbounded run-ahead (the
# host only syncs at log steps) can deadlock XLA:CPU, whose device threads block in a collective
# of a later step while an earlier step's participant waits for a thread.
_MAX_STEPS_AHEAD = 2
# Metrics logged as their value at the window's end rather than the window's mean.
_LAST_OF_WINDOW = ("lr", "loss_scale", "skipped_total")
# Below this the loss scale has halved on every step for a long while: gradients overflow even
# unscaled, so no update can be applied again; the run stops instead of skipping forever.
MIN_LOSS_SCALE = 1.0


@dataclasses.dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
      state: the final train state (on the mesh).
      run_dir: where config, metrics and checkpoints were written.
      history: the records this invocation logged (train and eval), as in ``metrics.jsonl``.
      compile_s: seconds spent compiling the train and eval steps.
      data_s: seconds spent building the run's parts: reading (and decoding) the data, mostly.
      start_step: the step this invocation started from: 0, or the checkpoint it resumed (for
        a run directory already at its end, that end).
    """

    state: TrainState
    run_dir: Path
    history: list[dict[str, Any]]
    compile_s: float = 0.0
    data_s: float = 0.0
    start_step: int = 0


class _PreemptionFlag:
    """Turns SIGTERM, and the first Ctrl-C (SIGINT), into a request to checkpoint and stop at the
    end of the current step; a second Ctrl-C aborts at once (KeyboardInterrupt)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.requested: str | None = None  # the signal's name once one arrived
        self._say = say
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _PreemptionFlag:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._say(
                "hopperjax: Ctrl-C: checkpointing and stopping after this step (again: abort)"
            )
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _summarize(
    fetched: list[dict[str, Any]],
    *,
    step: int,
    seconds: float,
    throughput: Throughput,
    steps_left: int,
) -> dict[str, Any]:
    """Reduces a log window's fetched metrics: means, except the LR at the window's end."""
    record: dict[str, Any] = {"step": step}
    for key in fetched[0]:
        values = [float(m[key]) for m in fetched]
        record[key] = values[-1] if key in _LAST_OF_WINDOW else float(np.mean(values))
    step_time = seconds / len(fetched)
    record["step_time_s"] = step_time
    record.update(throughput.rates(step_time))
    record["eta_s"] = steps_left * step_time
    return record


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _evaluate(eval_step: Any, state: TrainState, parts: Components) -> dict[str, float]:
    """The workload's eval metrics over ``train.eval_batches`` batches (default: all)."""
    limit = parts.config.train.eval_batches
    batches = DevicePrefetcher(
        iter(parts.datasets.eval),
        parts.batch_sharding,
        parts.config.data.device_prefetch,
        blocks=parts.batch_blocks,
    )
    outputs = []
    try:
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                break
            run = run_alone if i == 0 else _call  # a compiled step's first run: see run_alone
            outputs.append(run(eval_step, state, batch))
    finally:
        batches.close()
    # One transfer for the whole evaluation, not one per batch.
    return parts.workload.summarize(jax.device_get(outputs))


@contextlib.contextmanager
def _closing(*closables: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for c in closables:
            c.close()


@dataclasses.dataclass
class _SideEffects:
    """What the loop talks to besides the compiled steps."""

    writer: MetricsWriter
    checkpointer: Checkpointer
    batches: DevicePrefetcher
    preemption: _PreemptionFlag
    profiler: ProfileWindow
    monitor: GpuMonitor | None


def train(
    config: Config,
    *,
    devices: Sequence[jax.Device] | None = None,
    console: bool | Literal["bar"] = True,
) -> TrainResult:
    """Trains (or resumes) the run that ``config`` describes.

    A run directory already at its end (``train.steps``, or ``train.stop_after``) is left as it
    is: nothing is compiled or written, and the result holds its final state and its logged
    history.

    Args:
      config: a Config (``load_config``, or built in Python: validated here again).
      devices: devices for the mesh; default all.
      console: True prints a line per log step and eval (with a spinner and a live bar on a
        terminal) and the end-of-run summary; ``"bar"``, for scripts that train many runs, prints
        one line when the run starts and one when it ends, and the live bar between them on a
        terminal; False prints nothing.

    Raises:
      ConfigError: a value that only turns out bad against the devices, the data or the run
        directory (another process trains in it, it is not writable, its checkpoints were made
        by another config).
      CheckpointError: a checkpoint could not be written, or none verifies.
      FloatingPointError: the loss, the state or the loss scale became unusable (names the steps
        and the last good checkpoint).
    """
    config_lib.validate(config)  # again: a config built or changed in Python skips load_config
    # For library callers; the CLI has applied it already (xla_cpu.py).
    line = xla_cpu.apply_or_say(config.cpu_convolutions)
    if console and xla_cpu.unsaid(line):
        print(line, file=sys.stderr, flush=True)
    run_dir = config.run_path
    primary = jax.process_index() == 0
    with contextlib.ExitStack() as stack:
        if primary:  # one process writes the run directory, so one holds its lock
            try:
                stack.enter_context(files.exclusive(run_dir))
            except files.Busy as e:
                raise ConfigError(
                    "run_dir",
                    f"{run_dir} is in use by process {e.pid}; wait for it or use another run_dir",
                ) from None
            except OSError as e:
                raise ConfigError("run_dir", f"cannot write to {run_dir}: {e.strerror}") from None
        return _train(config, run_dir, devices, console=console, primary=primary)


def _train(
    config: Config,
    run_dir: Path,
    devices: Sequence[jax.Device] | None,
    *,
    console: bool | Literal["bar"],
    primary: bool,
) -> TrainResult:
    t = config.train
    bar = bool(console)
    lines = bar and console != "bar"  # "bar": a line at each end of the run, the live bar between
    build_start = time.perf_counter()
    with _phase(bar and primary, "reading the data, building the model"):
        parts = build_components(config, devices=devices)  # reads (and decodes) the data
    build_s = time.perf_counter() - build_start

    def warn(message: str) -> None:
        if primary:
            print(message, file=sys.stderr, flush=True)

    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        every=t.checkpoint_every,
        keep=t.keep_checkpoints,
        async_save=t.async_checkpoint,
        primary=primary,
    )
    # Installed before anything slow (restore, compile): a SIGTERM or Ctrl-C that arrives before
    # the first step still checkpoints and stops after it, rather than killing the process.
    preemption = _PreemptionFlag(say=lambda m: print(m, flush=True) if bar and primary else None)
    with _closing(checkpointer), preemption:
        start = checkpointer.resume_step(info=warn) or 0
        # Every process checks (each would otherwise wait for the others in a collective).
        restart = check_resumable(config, run_dir, parts.abstract_state, checkpointer, start)
        end = t.stop_after or t.steps
        if start and start >= end:
            return _finished(config, run_dir, parts, checkpointer, start, bar and primary, restart)
        if primary:
            # Artifacts first: a workload that refuses the data (a vocabulary the checkpoints
            # were not trained with) leaves the run directory as it was.
            parts.workload.write_artifacts(parts.datasets, run_dir, resuming=start > 0)
            resolved = dataclasses.replace(config, run_dir=str(run_dir))
            files.write_text(run_dir / "config.yaml", config_lib.dump_yaml(resolved))
        compile_start = time.perf_counter()
        with _phase(bar and primary, "compiling the train and eval steps"):
            train_step = parts.lower_train_step().compile()
            eval_step = parts.lower_eval_step().compile()
        compile_s = time.perf_counter() - compile_start
        _check_fits(train_step, parts.mesh.devices.flat[0])  # before anything is allocated
        train_iterator = make_iterator(parts.datasets.train, config.data)
        if start:
            state, data_state = _restore(checkpointer, start, parts, restart)
            if restart and bar and primary:
                kept = parts.abstract_state.comm is not None
                print(
                    f"hopperjax: gradient-compression residuals "
                    f"{'restart at zero' if kept else 'of the checkpoint dropped'}: their layout "
                    f"(step {start}) does not fit this mesh or comm.* setting"
                )
            # One batch per step: a position past that was edited, and would skip data.
            problem = position_problem(data_state, batches_consumed=start)
            if problem is not None:
                raise CheckpointError(f"checkpoint step {start} in {run_dir}: {problem}")
            train_iterator.set_state(data_state)
        else:
            state = parts.init_state()
        heap = host_heap.keep_step_memory(
            t.host_heap_pad_mib, compiled_steps=(train_step, eval_step)
        )

        writer = MetricsWriter(
            run_dir,
            total_steps=t.steps,
            resume_step=start,
            enabled=primary,
            console=lines,
            bar=bar,
            examples_name=parts.workload.examples_name,
        )
        if console == "bar" and primary:
            print(
                f"hopperjax: {run_dir}: {'resuming at step ' + str(start) if start else 'training'}"
                f" to step {end} (set up {build_s:.0f} s, compiled {compile_s:.0f} s)",
                flush=True,
            )
        throughput = parts.throughput()
        num_params = sum(x.size for x in jax.tree.leaves(parts.abstract_state.params))
        writer.info(
            f"hopperjax: {num_params:,} params | mesh {dict(parts.mesh.shape)} | "
            f"{config.precision} | set up in {build_s:.1f}s (data read) | "
            f"compiled in {compile_s:.1f}s | "
            f"peak {throughput.peak_tflops_per_device:.3g} TFLOP/s/device "
            f"({parts.peak_source}) | "
            + (f"resumed at step {start}" if start else "fresh start")
            + f" | {heap.describe()} | {run_dir}"
        )
        if config.optim.warmup_steps >= t.steps:
            writer.info(
                f"hopperjax: warning: optim.warmup_steps={config.optim.warmup_steps} >= "
                f"train.steps={t.steps}: the learning rate never gets past its warmup"
            )
        effects = _SideEffects(
            writer=writer,
            checkpointer=checkpointer,
            batches=DevicePrefetcher(
                train_iterator,
                parts.batch_sharding,
                config.data.device_prefetch,
                blocks=parts.batch_blocks,
            ),
            preemption=preemption,
            profiler=ProfileWindow(
                run_dir / "profile",
                start_step=config.profile.start_step,
                num_steps=config.profile.num_steps,
                enabled=config.profile.num_steps > 0,
            ),
            # On CPU there is nothing to sample; on a GPU without NVML the monitor says so once.
            monitor=GpuMonitor(config.monitor.interval_s, log=writer.info)
            if config.monitor.gpu and jax.default_backend() == "gpu"
            else None,
        )
        if effects.monitor is not None:
            effects.monitor.start()
        closables = [effects.batches, writer, effects.profiler]
        closables += [effects.monitor] if effects.monitor is not None else []
        with _closing(*closables):
            state, history = _loop(state, start, parts, train_step, eval_step, throughput, effects)
        checkpointer.wait()
        if primary and lines:
            _finish_report(run_dir, parts, checkpointer, stopped_by=preemption.requested)
        elif primary and console == "bar":
            ending = _ending(history, time.perf_counter() - build_start)
            if preemption.requested is not None:
                ending = f"stopped by {preemption.requested} (checkpointed) | {ending}"
            print(f"hopperjax: {run_dir}: {ending}", flush=True)
    return TrainResult(
        state=state,
        run_dir=run_dir,
        history=history,
        compile_s=compile_s,
        data_s=build_s,
        start_step=start,
    )


def _ending(history: list[dict[str, Any]], seconds: float) -> str:
    """One line for the end of a run: its last step, train loss and eval scores, its time."""
    parts = []
    train = [r for r in history if "loss" in r]
    evals = [r for r in history if "eval_loss" in r]
    if train:
        parts.append(f"step {int(train[-1]['step']) + 1}, loss {train[-1]['loss']:.4f}")
    if evals:
        parts.append(
            ", ".join(
                f"{k} {v:.4f}"
                for k, v in evals[-1].items()
                if k.startswith("eval_") and isinstance(v, float)
            )
        )
    return " | ".join([*parts, f"{seconds:.0f} s in all"])


@contextlib.contextmanager
def _phase(active: bool, message: str) -> Iterator[None]:
    """A spinner naming a slow phase (data, compile) on a terminal; nothing elsewhere."""
    terminal = metrics_lib.make_console()
    if not active or not metrics_lib.is_live(terminal):
        yield
        return
    with terminal.status(f"hopperjax: {message} ..."):
        yield


def _finish_report(
    run_dir: Path, parts: Components, checkpointer: Checkpointer, *, stopped_by: str | None
) -> None:
    """For a console run: plots of the whole run (``run_dir/plots``) and the summary with the
    next commands; a run stopped by a signal only says where it stopped (its grace period is
    not spent on plots). Never fails the run: what cannot be drawn is left out."""
    try:
        records = read_metrics(run_dir / "metrics.jsonl", torn=[])
        if stopped_by is None:
            summary.write_plots(run_dir, records)
        lines = summary.summary_lines(
            run_dir,
            records,
            checkpointer.all_steps(),
            parts.workload.next_commands(run_dir),
            total_steps=parts.config.train.steps,
            single_device=parts.mesh.size == 1,
        )
    except Exception as e:
        print(f"hopperjax: end-of-run report skipped: {e}", file=sys.stderr)
        return
    print("\n".join(lines), flush=True)


def _restore(
    checkpointer: Checkpointer, step: int, parts: Components, restart: tuple[str, ...]
) -> tuple[TrainState, Any]:
    """The checkpoint of ``step`` on ``parts``' shardings; the ``restart`` fields (see
    ``check_resumable``) are not read but created as zeros of their new layout."""
    if not restart:
        return checkpointer.restore(step, parts.abstract_state)
    abstract = parts.abstract_state.replace(**dict.fromkeys(restart))
    state, data_state = checkpointer.restore(step, abstract, partial=True)
    fresh = {
        field: jax.tree.map(
            lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding),
            getattr(parts.abstract_state, field),
        )
        for field in restart
    }
    return state.replace(**fresh), data_state


def _check_fits(train_step: Any, device: jax.Device) -> None:
    """Raises ConfigError when the compiled step needs more memory than a device has (on CPU,
    the host's RAM shared by its devices), before the state is created."""
    needed = budget.compiled_memory(train_step).get("peak_estimate_bytes")
    capacity = budget.device_capacity_bytes(device)
    if capacity is None and device.platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        capacity = ram // jax.local_device_count()
    if needed and capacity and needed > capacity:
        raise ConfigError(
            "model",
            f"the compiled train step needs {needed / 2**30:,.1f} GiB per device and a "
            f"{device.device_kind} device has {capacity / 2**30:,.1f} GiB; use a smaller model or "
            f"batch, shard the state (mesh.fsdp), or remat / offload",
        )


def _last_good(checkpointer: Checkpointer) -> str:
    """Names the checkpoint to go back to, once the saves in flight are on disk."""
    with contextlib.suppress(CheckpointError):
        checkpointer.wait()
    return checkpointer.describe_last_good()


def _finished(
    config: Config,
    run_dir: Path,
    parts: Components,
    checkpointer: Checkpointer,
    step: int,
    console: bool,
    restart: tuple[str, ...] = (),
) -> TrainResult:
    """The result of a run directory already at its end; nothing is compiled or written.
    ``restart``: state fields whose checkpointed layout does not fit (zeros are returned)."""
    t = config.train
    if step >= t.steps:
        where, todo = f"complete at step {step}", "raise train.steps to train on"
    else:
        where = f"stopped at step {step} (train.stop_after={t.stop_after})"
        todo = "raise or remove train.stop_after to go on"
    if console:
        print(f"hopperjax: {run_dir} is {where}: nothing to do; {todo}, or use a new run_dir")
    state, _ = _restore(checkpointer, step, parts, restart)
    history = [
        r for r in read_metrics(run_dir / "metrics.jsonl", torn=[]) if int(r["step"]) <= step
    ]
    return TrainResult(state=state, run_dir=run_dir, history=history, start_step=step)


def _loop(
    state: TrainState,
    start: int,
    parts: Components,
    train_step: Any,
    eval_step: Any,
    throughput: Throughput,
    fx: _SideEffects,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Steps from ``start`` to the end (or ``stop_after``, or SIGTERM); logs, evals, saves."""
    t = parts.config.train
    end = t.stop_after or t.steps
    if start >= end:
        fx.writer.info(f"hopperjax: nothing to do, the run is at step {start} (end {end})")
    history: list[dict[str, Any]] = []
    loop_start = time.perf_counter()  # eval records carry the seconds since (time to accuracy)
    if start == 0 and t.eval_at_start:
        record = {"step": 0, **_evaluate(eval_step, state, parts), "elapsed_s": 0.0}
        fx.writer.write(record)
        history.append(record)
    window: list[dict[str, jax.Array]] = []
    step_times: list[float] = []  # with train.sync_every_step: each step's own wall time
    window_start = step_start = time.perf_counter()
    for step in range(start, end):
        fx.profiler.before_step(step)
        batch = next(fx.batches)
        with step_annotation(step):
            run = run_alone if step == start else _call  # first run: see run_alone
            state, metrics = run(train_step, state, batch)
        if t.sync_every_step:
            jax.block_until_ready(metrics)
            step_times.append(time.perf_counter() - step_start)
        fx.profiler.after_step(step, metrics)
        window.append(metrics)
        if len(window) > _MAX_STEPS_AHEAD:
            # Bounded run-ahead: the device still has the next step queued, so this costs no
            # device time, and host memory for pending steps stays flat.
            jax.block_until_ready(window[-1 - _MAX_STEPS_AHEAD])
        done = step + 1
        log_step = done % t.log_every == 0 or done == end
        # Every process must stop at the same step: with several, they agree at log steps only
        # (one tiny collective per window rather than per step).
        if jax.process_count() == 1:
            preempted = fx.preemption.requested is not None
        else:
            preempted = log_step and process_agrees(fx.preemption.requested is not None)
        if log_step or preempted:
            fetched = jax.device_get(window)  # The loop's one device sync per log window.
            record = _summarize(
                fetched,
                step=step,
                throughput=throughput,
                seconds=time.perf_counter() - window_start,
                steps_left=end - done,
            )
            first = step - len(window) + 1
            # With loss scaling a non-finite step is expected now and then: it is skipped.
            if not math.isfinite(record["loss"]) and not parts.policy.loss_scaling:
                raise FloatingPointError(
                    f"loss is {record['loss']} in steps {first}-{step}; "
                    f"{_last_good(fx.checkpointer)}"
                )
            if record.get("loss_scale", MIN_LOSS_SCALE) < MIN_LOSS_SCALE:
                raise FloatingPointError(
                    f"the loss scale fell to {record['loss_scale']:.3g} by step {step} (below "
                    f"{MIN_LOSS_SCALE:g}): every recent update was skipped for non-finite "
                    f"gradients ({record['skipped_total']:.0f} skipped in all); "
                    f"{_last_good(fx.checkpointer)}"
                )
            if t.sync_every_step:
                record["step_times_s"] = step_times
                step_times = []
            in_window = range(step - len(window) + 1, step + 1)
            if fx.profiler.active or (fx.profiler.enabled and fx.profiler.last_step in in_window):
                record["profiled"] = 1  # Tracing overhead is inside this window's step time.
            if fx.monitor is not None:
                record.update(fx.monitor.snapshot())
            record.update(device_memory_stats())
            fx.writer.write(record)
            history.append(record)
            window = []
        if done % t.eval_every == 0 or done == t.steps:
            record = {"step": done, **_evaluate(eval_step, state, parts)}
            if t.generate_every and (done % t.generate_every == 0 or done == t.steps):
                record.update(parts.generation_metrics(state))
            # Training, evals and saves so far in this process (compile excluded, and a resumed
            # run counts from its restart).
            record["elapsed_s"] = round(time.perf_counter() - loop_start, 3)
            fx.writer.write(record)
            history.append(record)
        stopping = done == end or preempted
        fx.checkpointer.save(done, state, fx.batches.get_state(), force=stopping)
        if stopping:
            if preempted:
                name = fx.preemption.requested or "a peer's signal"
                fx.writer.info(f"hopperjax: {name}: checkpointed step {done} and stopped")
            break
        if not window:  # Eval and checkpoint time stay out of the step time.
            window_start = time.perf_counter()
        step_start = time.perf_counter()  # ... and out of the next step's own time
    return state, history
