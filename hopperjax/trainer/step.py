"""The pure train and eval steps, and the one place they are jitted."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hopperjax.config import LossScaleConfig
from hopperjax.parallel import compress
from hopperjax.precision import loss_scale as loss_scale_lib
from hopperjax.trainer import rows as rows_lib
from hopperjax.trainer.state import TrainState, model_variables
from hopperjax.workloads.base import Workload

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
Fetch = Callable[[TrainState, str], Any]

# Streams of the per-step key ``fold_in(state.rng, step)``: dropout uses the key itself (so runs
# without preprocessing draw what they always drew); preprocessing folds in its own stream.
PREPROCESS_STREAM = 1
# Eval preprocessing: one fixed key per run (eval is deterministic: the same batches, the same
# result at every evaluation).
EVAL_STREAM = 2
# Stochastic rounding of compressed gradients; the data groups' dropout keys.
COMPRESS_STREAM = 3
GROUP_STREAM = 4


def preprocess_key(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The key ``workload.preprocess`` gets at train step ``step``."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), PREPROCESS_STREAM)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    workload: Workload,
    loss_scale: LossScaleConfig | None = None,
    microbatches: int = 1,
    fetch: Fetch | None = None,
    compression: compress.Compression | None = None,
) -> tuple[TrainState, Metrics]:
    """One optimizer update on one global batch.

    Args:
      state: the current train state.
      batch: the workload's fields as they come from the host (``workload.batch_fields``).
      workload: preprocessing, model inputs and loss; its ``mutable`` collections of
        ``state.model_state`` are updated by the forward pass.
      loss_scale: growth settings when ``state.loss_scale`` is set (dynamic loss scaling).
      microbatches: K > 1 runs the batch as K microbatches in a loop and accumulates their fp32
        gradients into the one update (the same update, a K-th of the activation memory).
      fetch: ``fetch(state, field)`` copies a host-offloaded state field to the device
        (``memory/offload.py``); None when nothing is offloaded.
      compression: reduce the gradients over ``data`` in bf16 / int8 (``parallel/compress.py``):
        each data group computes its own gradient (its loss the mean over its rows), and the
        groups' mean is taken by explicit collectives. None: XLA's fp32 all-reduce.

    Returns:
      (new state, scalar metrics: loss, lr, grad_norm, param_norm, update_norm,
      loss_scale / skipped / skipped_total with loss scaling, comm_residual_norm with error
      feedback).
    """
    offloading = fetch is not None
    fetch = fetch or (lambda s, field: getattr(s, field))
    step_key = jax.random.fold_in(state.rng, state.step)
    scale = state.loss_scale.scale if state.loss_scale is not None else None
    params = fetch(state, "params")
    batch = workload.preprocess(batch, preprocess_key(state.rng, state.step), train=True)
    mutable = list(workload.mutable)
    row_updates = workload.row_updates()
    lookups = row_updates.lookups(batch) if row_updates is not None else {}
    deltas = rows_lib.zero_deltas(params, lookups) if lookups else None

    def loss_fn(
        params: Any, fp8: Any, deltas: Any, model_state: Any, batch: Batch, key: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        variables = model_variables(params, fp8, model_state)
        if deltas is not None:  # row-sparse tables: see models/row_table.py
            variables = {**variables, **deltas}
        inputs = workload.model_inputs(batch)
        if mutable:
            outputs, updates = model.apply(
                variables, *inputs, deterministic=False, rngs={"dropout": key}, mutable=mutable
            )
            model_state = {**(model_state or {}), **updates}
        else:
            outputs = model.apply(variables, *inputs, deterministic=False, rngs={"dropout": key})
        loss = workload.loss(outputs, batch)
        # A microbatch's loss counts 1/K of the batch's, so its gradients (and the gradient
        # amaxes FP8 records) are its true share of the full-batch gradient.
        weighted = loss / microbatches if microbatches > 1 else loss
        return (weighted * scale if scale is not None else weighted), (loss, model_state)

    # FP8 scales and amax histories are differentiated too: their "gradients" are their updated
    # values (Flax's overwrite-with-gradient convention), taken as is, never given to the optimizer.
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)
    row_grads = None
    comm_state = state.comm
    if compression is not None:  # (build_components refuses row-sparse tables with it)
        loss, model_state, grads, new_fp8 = _group_gradients(
            grad_fn, params, state.fp8, state.model_state, batch, step_key, microbatches,
            compression.ways,
        )  # fmt: skip
        if state.loss_scale is not None:  # residuals in true units, whatever the scale does
            grads = loss_scale_lib.unscale(grads, state.loss_scale)
        grads, comm_state = compression.reduce(
            grads, state.comm, jax.random.fold_in(step_key, COMPRESS_STREAM)
        )
    elif microbatches == 1:
        (_, (loss, model_state)), (grads, new_fp8, row_grads) = grad_fn(
            params, state.fp8, deltas, state.model_state, batch, step_key
        )
    else:  # (build_components refuses row-sparse tables with more than one microbatch)
        loss, model_state, grads, new_fp8 = _accumulate(
            grad_fn, params, state.fp8, state.model_state, batch, step_key, microbatches
        )
    finite = None
    if state.loss_scale is not None:
        if compression is None:  # (compressed gradients were unscaled before the reduction)
            grads = loss_scale_lib.unscale(grads, state.loss_scale)
        row_grads = loss_scale_lib.unscale(row_grads, state.loss_scale)
        # Non-finite gradients anywhere (a global reduction, so all devices agree).
        finite = loss_scale_lib.all_finite((grads, row_grads))
    opt_state = state.opt_state
    if offloading:
        # The barrier makes the optimizer state's copy from host memory wait for the gradients,
        # so it does not sit in device memory next to the activations.
        grads, opt_state = jax.lax.optimization_barrier((grads, opt_state))
    old = state.replace(step=state.step + 1, params=params)
    old = old.replace(opt_state=fetch(old.replace(opt_state=opt_state), "opt_state"))
    updates, opt_state = tx.update(grads, old.opt_state, params)
    params = optax.apply_updates(params, updates)
    if lookups:
        params, model_state = rows_lib.apply_row_updates(
            params, model_state, lookups, row_grads[rows_lib.ROW_DELTAS], row_updates,
            finite=finite,
        )  # fmt: skip
    new_state = old.replace(
        params=params, opt_state=opt_state, fp8=new_fp8, model_state=model_state, comm=comm_state
    )
    metrics = {
        "loss": loss,
        "lr": schedule(state.step),
        "grad_norm": optax.global_norm(grads),
        "update_norm": optax.global_norm(updates),
    }
    if comm_state is not None:
        metrics["comm_residual_norm"] = optax.global_norm(comm_state)
    if state.loss_scale is not None:
        # Non-finite gradients: keep the old params, optimizer, FP8 and model state, shrink the
        # scale. The step counter advances. (Row-sparse tables were gated in place above.)
        kept = loss_scale_lib.select(finite, new_state, old)
        if lookups:
            params, model_state = rows_lib.keep_tables(
                (kept.params, kept.model_state), (new_state.params, new_state.model_state), lookups
            )
            kept = kept.replace(params=params, model_state=model_state)
        new_state = kept.replace(
            loss_scale=loss_scale_lib.adjust(
                state.loss_scale,
                finite,
                growth_interval=loss_scale.growth_interval,
                factor=loss_scale.factor,
            )
        )
        metrics["loss_scale"] = state.loss_scale.scale
        metrics["skipped"] = (~finite).astype(jnp.float32)
        metrics["skipped_total"] = new_state.loss_scale.skipped.astype(jnp.float32)
    # Of the parameters the step leaves (a skipped step keeps the old ones).
    # (Row-sparse tables left out: reading every row each step would cost what their sparse
    # update saves.)
    metrics["param_norm"] = optax.global_norm(rows_lib.without_tables(new_state.params, lookups))
    return new_state, metrics


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    """[B, ...] -> [K, B/K, ...] where microbatch k holds rows k, k+K, k+2K, ...

    Strided rather than contiguous so that every microbatch is spread over all the devices that
    share the batch axis: each device splits its own rows, no data moves.
    """

    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0] // microbatches
        x = x.reshape(rows, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))

    return jax.tree.map(split, batch)


def _accumulate(
    grad_fn: Any,
    params: Any,
    fp8: Any,
    model_state: Any,
    batch: Batch,
    key: jax.Array,
    microbatches: int,
) -> tuple[jax.Array, Any, Any, Any]:
    """Mean loss, model state, gradients and FP8 meta over K microbatches, run one after another
    in a scan.

    ``grad_fn`` weights each microbatch's loss by 1/K, so the summed gradients are the
    full-batch gradients. They are summed in fp32 whatever the parameter dtype. FP8 meta is
    combined with a max, not a sum: every microbatch starts from the same amax history, so the
    elementwise max of their updated histories is the history the full batch would have produced
    (and the scales, computed from the old history, agree). Model state (e.g. BatchNorm
    statistics) threads through the microbatches in order, as K smaller steps would update it.
    """
    parts = split_microbatches(batch, microbatches)

    def body(carry: tuple[Any, Any, Any, jax.Array], xs: tuple[Batch, jax.Array]):
        grad_sum, fp8_max, state, loss_sum = carry
        micro, index = xs
        (_, (loss, state)), (grads, new_fp8, _) = grad_fn(
            params, fp8, None, state, micro, jax.random.fold_in(key, index)
        )
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        fp8_max = jax.tree.map(jnp.maximum, fp8_max, new_fp8)
        return (grad_sum, fp8_max, state, loss_sum + loss), None

    init = (
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        jax.tree.map(lambda x: jnp.full(x.shape, -jnp.inf, x.dtype), fp8),
        model_state,
        jnp.zeros((), jnp.float32),
    )
    (grad_sum, new_fp8, model_state, loss_sum), _ = jax.lax.scan(
        body, init, (parts, jnp.arange(microbatches))
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_sum, params)
    return loss_sum / microbatches, model_state, grads, new_fp8


def _group_gradients(
    grad_fn: Any,
    params: Any,
    fp8: Any,
    model_state: Any,
    batch: Batch,
    key: jax.Array,
    microbatches: int,
    ways: int,
) -> tuple[jax.Array, Any, Any, Any]:
    """Loss, model state, FP8 meta and one gradient per ``data`` group, nothing reduced across
    the groups: the gradients get a leading axis of ``ways``, sharded over ``data``.

    A ``vmap`` over the batch cut into ``ways`` row blocks (the blocks the ``data`` axis holds),
    with ``spmd_axis_name='data'``; inside, the model is traced with rules that leave ``data``
    out (``batch`` -> ``fsdp`` only), so each group runs as a run on its own devices would.
    Group g draws its dropout from ``fold_in(fold_in(key, GROUP_STREAM), g)``. The loss
    returned is the groups' mean, model state (BatchNorm statistics) the groups' mean, FP8 meta
    their max (as ``_accumulate``).
    """
    rules = compress.data_group_rules(nn.get_logical_axis_rules())
    parts = jax.tree.map(lambda x: x.reshape(ways, x.shape[0] // ways, *x.shape[1:]), batch)

    group_keys = jax.random.fold_in(key, GROUP_STREAM)

    def group(part: Batch, index: jax.Array) -> tuple[jax.Array, Any, Any, Any]:
        group_key = jax.random.fold_in(group_keys, index)
        with nn.logical_axis_rules(rules):
            if microbatches == 1:
                (_, (loss, state)), (grads, new_fp8, _) = grad_fn(
                    params, fp8, None, model_state, part, group_key
                )
                return loss, state, grads, new_fp8
            return _accumulate(grad_fn, params, fp8, model_state, part, group_key, microbatches)

    loss, state, grads, new_fp8 = jax.vmap(group, spmd_axis_name=compress.DATA_AXIS)(
        parts, jnp.arange(ways)
    )

    def mean(x: jax.Array) -> jax.Array:
        return (
            jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[0]
        )

    return (
        jnp.mean(loss),
        jax.tree.map(mean, state),
        grads,
        jax.tree.map(lambda x: jnp.max(x, axis=0), new_fp8),
    )


def eval_step(
    state: TrainState,
    batch: Batch,
    *,
    model: nn.Module,
    workload: Workload,
    fetch: Fetch | None = None,
) -> Metrics:
    """The workload's eval outputs of one batch (LM: loss_sum, correct, tokens), from its
    ``predict`` on the preprocessed batch."""
    params = fetch(state, "params") if fetch is not None else state.params
    key = jax.random.fold_in(state.rng, EVAL_STREAM)
    batch = workload.preprocess(batch, key, train=False)
    outputs = workload.predict(model, model_variables(params, state.fp8, state.model_state), batch)
    return workload.eval_outputs(outputs, batch)


def jit_steps(
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_shardings: Any,
    batch_sharding: Any,
    workload: Workload,
    loss_scale: LossScaleConfig | None = None,
    microbatches: int = 1,
    fetch: Fetch | None = None,
    compression: compress.Compression | None = None,
) -> tuple[Any, Any]:
    """The jitted train and eval steps with explicit shardings; the train step donates its state.

    ``state_shardings`` may put state fields in host memory; ``fetch`` then brings them over.

    Returns:
      (train_step(state, batch) -> (state, metrics), eval_step(state, batch) -> metrics)
    """
    replicated = NamedSharding(jax.tree.leaves(batch_sharding)[0].mesh, PartitionSpec())
    train = jax.jit(
        functools.partial(
            train_step,
            model=model,
            tx=tx,
            schedule=schedule,
            workload=workload,
            loss_scale=loss_scale,
            microbatches=microbatches,
            fetch=fetch,
            compression=compression,
        ),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        functools.partial(eval_step, model=model, workload=workload, fetch=fetch),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=replicated,
    )
    return train, evaluate
