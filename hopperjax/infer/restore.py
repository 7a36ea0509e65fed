"""A run's model and trained variables, restored without its optimizer state or its data.

Sampling, export and serving need the parameters (and the model's other variables: FP8 scales,
BatchNorm statistics), not the optimizer state that doubles or triples a checkpoint, nor a
dataset. The model is rebuilt from the run's ``config.yaml``, its variables' shapes come from
``jax.eval_shape`` of its init, and only those arrays are read from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, SingleDeviceSharding

from hopperjax import workloads
from hopperjax.checkpoint import Checkpointer, newest_verified, verify
from hopperjax.config import Config, ConfigError, load_config
from hopperjax.parallel import merge_rules
from hopperjax.precision import policy_from_config
from hopperjax.trainer.components import example_inputs
from hopperjax.trainer.state import model_variables, split_variables
from hopperjax.workloads.base import Workload


@dataclasses.dataclass(frozen=True)
class Restored:
    """A trained model, ready for ``workload.predict(model, variables, batch)``.

    Attributes:
      variables: ``{"params": ..., <other collections>}`` as ``model.apply`` takes them.
      step: the checkpoint's step.
      averaged: from ``restore_params``, the checkpoints whose mean ``params`` are (oldest
        first, ``step`` the last; ``(step,)`` without averaging); empty when made otherwise.
    """

    config: Config
    workload: Workload
    model: nn.Module
    variables: dict[str, Any]
    step: int
    averaged: tuple[int, ...] = ()

    @property
    def params(self) -> Any:
        return self.variables["params"]


def restore_params(
    run_dir: str | Path,
    step: int | None = None,
    *,
    mesh: Mesh | None = None,
    average: int = 1,
) -> Restored:
    """The model of ``run_dir`` and its variables at checkpoint ``step`` (default: the newest).

    Args:
      run_dir: a hopperjax run directory (``config.yaml`` and ``checkpoints/``).
      step: which checkpoint; None: the newest.
      mesh: lay the variables out over this mesh by the run's logical-axis rules; None: all on
        the first device.
      average: checkpoint averaging: the parameters are the mean of the ``average`` kept
        checkpoints up to ``step`` (it included), each of which must verify; the model's other
        variables (BatchNorm statistics, FP8 scales) are ``step``'s. 1: ``step``'s own.

    Raises:
      ConfigError: not a run directory, no such checkpoint (names ``--run-dir`` or ``--step``);
        ``average`` below 1, fewer than ``average`` checkpoints up to ``step``, or one of them
        that does not verify (names ``--average``).
    """
    if average < 1:
        raise ConfigError("--average", f"expected a positive number of checkpoints, got {average}")
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("--run-dir", f"{run_dir} has no config.yaml: not a hopperjax run")
    # Its own config: validated when the run was made; its data files need not be here.
    config = load_config(run_dir / "config.yaml", validate_values=False)
    workload = workloads.from_config(config)
    policy = policy_from_config(config, default_fp8_layers=workload.default_fp8_layers)
    model = workload.build_model(policy, config.remat)
    boxed = abstract_variables(model, workload, config)
    if mesh is not None:
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(boxed), mesh, merge_rules(workload.axis_rules())
        )
    else:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), boxed)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        nn.meta.unbox(shardings),
    )
    params, fp8, model_state = split_variables(abstract)
    wanted = {"params": params, "fp8": fp8, "model_state": model_state}
    wanted = {k: v for k, v in wanted.items() if v is not None}

    checkpointer = Checkpointer(run_dir / "checkpoints", every=1, keep=1, async_save=False)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise ConfigError("--run-dir", f"{run_dir / 'checkpoints'} holds no checkpoint")
        if step is not None and step not in steps:
            raise ConfigError(
                "--step", f"no checkpoint of step {step} in {run_dir} (there are {sorted(steps)})"
            )
        # The newest checkpoint that verifies (or the one asked for, if it verifies).
        asked = step
        step, problems = newest_verified(
            checkpointer.directory, [asked] if asked is not None else steps
        )
        if step is None:
            said = "; ".join(f"step {s}: {p}" for s, p in problems)
            raise ConfigError(
                "--step" if asked is not None else "--run-dir",
                f"no checkpoint in {run_dir} verifies ({said})",
            )
        for bad, problem in problems:
            print(f"hopperjax: skipped checkpoint step {bad}: {problem}", file=sys.stderr)
        averaged = [s for s in sorted(steps) if s <= step][-average:]
        if len(averaged) < average:
            raise ConfigError(
                "--average",
                f"{average} checkpoints asked for, {run_dir} keeps {len(averaged)} up to step "
                f"{step} ({averaged})",
            )
        for earlier in averaged[:-1]:  # each one averaged in must verify as the last did
            if (problem := verify(checkpointer.directory / str(earlier))) is not None:
                raise ConfigError("--average", f"checkpoint step {earlier} of {run_dir}: {problem}")
        restored = checkpointer.restore_subtrees(step, wanted)
        params = restored["params"]
        if average > 1:  # a running sum: one earlier checkpoint on the device at a time
            total = jax.tree.map(_widen, params)
            for earlier in averaged[:-1]:
                more = checkpointer.restore_subtrees(earlier, {"params": wanted["params"]})
                total = jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, more["params"])
            params = jax.tree.map(lambda t, x: _narrow(t / average, x), total, params)
    finally:
        checkpointer.close()
    variables = model_variables(params, restored.get("fp8"), restored.get("model_state"))
    return Restored(config, workload, model, variables, step, tuple(averaged))


def _widen(x: jax.Array) -> jax.Array:
    """A parameter as checkpoint averaging sums it: floats in at least float32 (a bf16 running
    sum loses digits), anything else as it is (``_narrow`` keeps the last checkpoint's)."""
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        return x
    return x.astype(jax.numpy.promote_types(x.dtype, jax.numpy.float32))


def _narrow(mean: jax.Array, last: jax.Array) -> jax.Array:
    if not jax.numpy.issubdtype(last.dtype, jax.numpy.floating):
        return last
    return mean.astype(last.dtype)


def abstract_variables(model: nn.Module, workload: Workload, config: Config) -> Any:
    """Shapes and dtypes of ``model``'s variables (boxed with their logical axes), from
    ``jax.eval_shape`` of its init on a batch of the run's fields: no data, no compute."""
    fields = workload.batch_fields(config.train.batch_size, None)
    spec = {name: jax.ShapeDtypeStruct(f.shape, f.dtype) for name, f in fields.items()}
    inputs = example_inputs(workload, spec)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *_zeros(inputs)))


def _zeros(example: tuple[Any, ...]) -> tuple[Any, ...]:
    return jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), example)
