"""TrainState and its creation directly on the mesh (never materialized on one device)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from hopperjax.parallel import LOGICAL_AXIS_RULES, Rules
from hopperjax.parallel.compress import Compression
from hopperjax.precision.fp8 import FP8_COLLECTION
from hopperjax.precision.loss_scale import LossScaleState


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pytree, checkpointed whole.

    Attributes:
      step: [] int32, updates done so far.
      params: model parameters (fp32 master weights).
      opt_state: optimizer state, sharded like the parameters it mirrors.
      rng: [2] uint32 base key; step ``s`` uses ``fold_in(rng, s)``.
      fp8: FP8 scales and amax histories (``precision/fp8.py``), or None without FP8.
      loss_scale: dynamic loss-scaling state, or None when the policy does not scale.
      model_state: the model's other variable collections (``{collection: tree}``, e.g.
        BatchNorm statistics), updated by the train step where the workload lists them as
        ``mutable``; None when the model has none.
      comm: gradient-compression residuals (``parallel/compress.py``: one row per device), or
        None without compression or without error feedback.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    fp8: Any = None
    loss_scale: LossScaleState | None = None
    model_state: Any = None
    comm: Any = None


def split_variables(variables: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A model's variables -> (params, FP8 collection or None, other collections or None)."""
    fp8 = {k: v for k, v in variables.items() if k == FP8_COLLECTION}
    other = {k: v for k, v in variables.items() if k not in ("params", FP8_COLLECTION)}
    return variables["params"], fp8 or None, other or None


def model_variables(params: Any, fp8: Any, model_state: Any) -> dict[str, Any]:
    """The variables dict ``model.apply`` takes."""
    return {"params": params, **(fp8 or {}), **(model_state or {})}


def _zero_inputs(example: Any) -> tuple[Any, ...]:
    """Zeros shaped like ``example``: one ShapeDtypeStruct (tokens) or a tuple of input trees."""
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), example)
    return zeros if isinstance(zeros, tuple) else (zeros,)


def _init_boxed(
    model: nn.Module,
    tx: optax.GradientTransformation,
    seed: int,
    example_inputs: Any,
    loss_scale: float | None,
    compression: Compression | None = None,
) -> TrainState:
    """Initializes a state whose leaves still carry logical-axis metadata (``nn.Partitioned``)."""
    root = jax.random.PRNGKey(seed)
    init_key, train_key = jax.random.split(root)
    params, fp8, model_state = split_variables(model.init(init_key, *_zero_inputs(example_inputs)))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=train_key,
        fp8=fp8,
        loss_scale=None if loss_scale is None else LossScaleState.create(loss_scale),
        model_state=model_state,
        comm=None if compression is None else compression.init_state(),
    )


def initializer(
    model: nn.Module,
    tx: optax.GradientTransformation,
    *,
    seed: int,
    example_inputs: Any,
    loss_scale: float | None = None,
    compression: Compression | None = None,
) -> Callable[[], TrainState]:
    """The function that makes a fresh state, leaves still boxed with their logical axes.

    Pass the same object to ``shardings_of`` (its shapes) and ``init_sharded`` (its arrays):
    JAX keys its trace cache on the function (and the context: call both outside a mesh, or
    both inside the same one), so the model's init is traced once for both.

    Args:
      example_inputs: shape/dtype of the model's input (see ``create_train_state``).
      loss_scale: initial loss scale when the policy scales the loss, else None.
      compression: the run's gradient compression, whose residuals join the state (at zero).
    """
    return functools.partial(_init_boxed, model, tx, seed, example_inputs, loss_scale, compression)


def shardings_of(
    init: Callable[[], TrainState], mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES
) -> tuple[Any, Any]:
    """Shapes before arrays: ``init``'s abstract state and its NamedShardings from ``rules``
    (the run's table: ``parallel.merge_rules`` of the workload's and ours).

    Returns:
      (abstract state of ``jax.ShapeDtypeStruct`` with shardings attached, sharding tree).
    """
    boxed = jax.eval_shape(init)
    logical_specs = nn.get_partition_spec(boxed)
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        shardings,
    )
    return abstract, shardings


def init_sharded(init: Callable[[], TrainState], shardings: Any) -> TrainState:
    """Runs ``init`` with its outputs placed by ``shardings`` (the unboxed state's tree, e.g.
    from ``shardings_of``): each device computes only its own shards.

    Raises:
      ValueError: ``shardings`` is not one sharding per array of the state (e.g. a prefix tree).
    """
    boxed = jax.eval_shape(init)  # the cached trace when shardings_of saw the same ``init``
    # The boxes are pytree nodes around the arrays: the same leaves, in the same order. The
    # arrays are taken out of them by structure, not by ``nn.meta.unbox``, which under a mesh
    # would constrain each one again (and so move host-offloaded fields back to the device).
    arrays, placements = jax.tree.leaves(boxed), jax.tree.leaves(shardings)
    if len(placements) != len(arrays):
        raise ValueError(
            f"shardings: {len(placements)} shardings for the state's {len(arrays)} arrays; pass "
            "the state's whole sharding tree (shardings_of)"
        )
    placed = jax.tree.unflatten(jax.tree.structure(boxed), placements)
    state = jax.jit(init, out_shardings=placed)()
    return jax.tree.unflatten(jax.tree.structure(shardings), jax.tree.leaves(state))


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    seed: int,
    example_inputs: Any,
    shardings: Any = None,
    loss_scale: float | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
    compression: Compression | None = None,
) -> tuple[TrainState, Any]:
    """Creates the initial state already sharded: each device computes only its own shards.

    Args:
      example_inputs: shape/dtype of the model's input, e.g. ``ShapeDtypeStruct((B, T), int32)``,
        or a tuple of such trees for a model with several (or structured) inputs.
      shardings: the state's sharding tree if already derived (``shardings_of``).
      loss_scale: initial loss scale when the policy scales the loss, else None.
      rules: the logical-axis rules, when ``shardings`` is not given.
      compression: the run's gradient compression, whose residuals join the state (at zero).

    Returns:
      (state, sharding tree of the state).

    Raises:
      ValueError: ``shardings`` is not the state's whole sharding tree.
    """
    init = initializer(
        model,
        tx,
        seed=seed,
        example_inputs=example_inputs,
        loss_scale=loss_scale,
        compression=compression,
    )
    if shardings is None:
        _, shardings = shardings_of(init, mesh, rules)
    return init_sharded(init, shardings), shardings
