"""The training loop: the only place with side effects (I/O, logging, checkpoints, signals).

Everything it drives is built first from the config (mesh, model, optimizer, data, compiled
steps); the loop then feeds batches to the compiled step, fetches metrics from the device only at
log steps, evaluates and checkpoints on its cadence, and resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from hopperjax import config as config_lib
from hopperjax.checkpoint import Checkpointer
from hopperjax.config import Config, ConfigError
from hopperjax.data import DevicePrefetcher, make_iterator
from hopperjax.observe import MetricsWriter
from hopperjax.trainer.components import Components, build_components
from hopperjax.trainer.state import TrainState, create_train_state

# Keys whose change makes an existing checkpoint unusable (parameter or optimizer-state shapes).
_STATE_SHAPING_PREFIXES = ("model.", "optim.name")


@dataclasses.dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
      state: the final train state (on the mesh).
      run_dir: where config, metrics and checkpoints were written.
      history: the records this invocation logged (train and eval), as in ``metrics.jsonl``.
    """

    state: TrainState
    run_dir: Path
    history: list[dict[str, Any]]


class _PreemptionFlag:
    """Turns SIGTERM into a request to checkpoint and stop at the end of the current step.

    Known compromise: each process decides alone; agreeing across hosts on the stop step belongs
    with multi-host support.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _PreemptionFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _check_resumable(config: Config, path: Path) -> None:
    """A resumed run must build the same state shapes as the run that wrote the checkpoints."""
    if not path.exists():
        return
    before = _flatten(yaml.safe_load(path.read_text()) or {})
    now = _flatten(config_lib.to_dict(config))
    for key, value in now.items():
        if key.startswith(_STATE_SHAPING_PREFIXES) and before.get(key, value) != value:
            raise ConfigError(
                key,
                f"changed from {before[key]!r} to {value!r}, but {path.parent} "
                f"holds checkpoints of the old value; use a new run_dir",
            )


def _write_config(config: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(config_lib.dump_yaml(config))
    tmp.replace(path)


def _summarize(
    fetched: list[dict[str, Any]],
    *,
    step: int,
    seconds: float,
    tokens_per_step: int,
    steps_left: int,
) -> dict[str, Any]:
    """Reduces a log window's fetched metrics: means, except the LR at the window's end."""
    record: dict[str, Any] = {"step": step}
    for key in fetched[0]:
        values = [float(m[key]) for m in fetched]
        record[key] = values[-1] if key == "lr" else float(np.mean(values))
    step_time = seconds / len(fetched)
    record["step_time_s"] = step_time
    record["tokens_per_s"] = tokens_per_step / step_time
    record["eta_s"] = steps_left * step_time
    return record


def _evaluate(eval_step: Any, state: TrainState, parts: Components) -> dict[str, float]:
    """Mean loss and next-token accuracy over ``train.eval_batches`` batches (default: all)."""
    limit = parts.config.train.eval_batches
    batches = DevicePrefetcher(
        iter(parts.datasets.eval), parts.batch_sharding, parts.config.data.device_prefetch
    )
    totals = None
    try:
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                break
            sums = eval_step(state, batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    finally:
        batches.close()
    totals = jax.device_get(totals)
    loss = float(totals["loss_sum"] / totals["tokens"])
    return {
        "eval_loss": loss,
        "eval_accuracy": float(totals["correct"] / totals["tokens"]),
        "eval_perplexity": math.exp(min(loss, 50.0)),
    }


@contextlib.contextmanager
def _closing(*closables: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for c in closables:
            c.close()


def train(
    config: Config, *, devices: Sequence[jax.Device] | None = None, console: bool = True
) -> TrainResult:
    """Trains (or resumes) the run that ``config`` describes.

    Args:
      config: a validated Config (``load_config``).
      devices: devices for the mesh; default all.
      console: print progress lines.

    Raises:
      ConfigError: a value that only turns out bad against the devices or the data.
      FloatingPointError: the loss became NaN/Inf (names the steps).
    """
    run_dir = config.run_path
    primary = jax.process_index() == 0
    t = config.train
    parts = build_components(config, devices=devices)
    if primary:
        _check_resumable(config, run_dir / "config.yaml")
        _write_config(config, run_dir / "config.yaml")

    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        every=t.checkpoint_every,
        keep=t.keep_checkpoints,
        async_save=t.async_checkpoint,
    )
    with _closing(checkpointer):
        train_iterator = make_iterator(parts.datasets.train, config)
        start = checkpointer.latest_step() or 0
        if start:
            state, data_state = checkpointer.restore(start, parts.abstract_state)
            train_iterator.set_state(data_state)
        else:
            # Created outside the mesh context: flax's scan evaluates constant parameter inits
            # eagerly, and a mesh in scope would make it constrain concrete arrays.
            state, _ = create_train_state(
                parts.model,
                parts.tx,
                parts.mesh,
                seed=config.seed,
                example_tokens=parts.batch_spec(t.batch_size)["inputs"],
                shardings=parts.state_shardings,
            )
        compile_start = time.perf_counter()
        train_step = parts.lower_train_step().compile()
        eval_step = parts.lower_eval_step().compile()
        compile_s = time.perf_counter() - compile_start

        writer = MetricsWriter(
            run_dir, total_steps=t.steps, resume_step=start, enabled=primary, console=console
        )
        num_params = sum(x.size for x in jax.tree.leaves(parts.abstract_state.params))
        writer.info(
            f"hopperjax: {num_params:,} params | mesh {dict(parts.mesh.shape)} | "
            f"{config.precision} | compiled in {compile_s:.1f}s | "
            + (f"resumed at step {start}" if start else "fresh start")
            + f" | {run_dir}"
        )
        batches = DevicePrefetcher(
            train_iterator, parts.batch_sharding, config.data.device_prefetch
        )
        with _closing(batches, writer), _PreemptionFlag() as preemption:
            state, history = _loop(
                state,
                start,
                parts,
                train_step,
                eval_step,
                batches,
                checkpointer,
                writer,
                preemption,
            )
        checkpointer.wait()
    return TrainResult(state=state, run_dir=run_dir, history=history)


def _loop(
    state: TrainState,
    start: int,
    parts: Components,
    train_step: Any,
    eval_step: Any,
    batches: DevicePrefetcher,
    checkpointer: Checkpointer,
    writer: MetricsWriter,
    preemption: _PreemptionFlag,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Steps from ``start`` to the end (or ``stop_after``, or SIGTERM); logs, evals, saves."""
    config, t = parts.config, parts.config.train
    end = t.stop_after or t.steps
    if start >= end:
        writer.info(f"hopperjax: nothing to do, the run is at step {start} (end {end})")
    tokens_per_step = t.batch_size * config.data.seq_len
    history: list[dict[str, Any]] = []
    window: list[dict[str, jax.Array]] = []
    window_start = time.perf_counter()
    for step in range(start, end):
        state, metrics = train_step(state, next(batches))
        window.append(metrics)
        done = step + 1
        if done % t.log_every == 0 or done == end or preemption.requested:
            fetched = jax.device_get(window)  # The loop's one device sync per log window.
            record = _summarize(
                fetched,
                step=step,
                tokens_per_step=tokens_per_step,
                seconds=time.perf_counter() - window_start,
                steps_left=end - done,
            )
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(
                    f"loss is {record['loss']} in steps {step - len(window) + 1}-{step}; "
                    f"the last checkpoint is step {checkpointer.latest_step()}"
                )
            writer.write(record)
            history.append(record)
            window = []
        if done % t.eval_every == 0 or done == t.steps:
            record = {"step": done, **_evaluate(eval_step, state, parts)}
            writer.write(record)
            history.append(record)
        stopping = done == end or preemption.requested
        checkpointer.save(done, state, batches.get_state(), force=stopping)
        if stopping:
            if preemption.requested:
                writer.info(f"hopperjax: SIGTERM: checkpointed step {done} and stopped")
            break
        if not window:  # Eval and checkpoint time stay out of the step time.
            window_start = time.perf_counter()
    return state, history
