"""The pure train and eval steps, and the one place they are jitted."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hopperjax.config import LossScaleConfig
from hopperjax.precision import fp8 as fp8_lib
from hopperjax.precision import loss_scale as loss_scale_lib
from hopperjax.trainer.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits: [batch, length, vocab]; targets: [batch, length] -> per-token loss [batch, length].

    Computed in fp32 whatever the compute dtype: log-softmax over a large vocabulary is where
    low precision hurts first.
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    loss_scale: LossScaleConfig | None = None,
) -> tuple[TrainState, Metrics]:
    """One optimizer update on one global batch.

    Args:
      state: the current train state.
      batch: ``inputs`` and ``targets``, each [batch, length] int32.
      loss_scale: growth settings when ``state.loss_scale`` is set (dynamic loss scaling).

    Returns:
      (new state, scalar metrics: loss, lr, grad_norm, param_norm, update_norm, and
      loss_scale / skipped / skipped_total with loss scaling).
    """
    dropout_key = jax.random.fold_in(state.rng, state.step)
    scale = state.loss_scale.scale if state.loss_scale is not None else None

    def loss_fn(params: Any, fp8: Any) -> tuple[jax.Array, jax.Array]:
        logits = model.apply(
            fp8_lib.merge(params, fp8),
            batch["inputs"],
            deterministic=False,
            rngs={"dropout": dropout_key},
        )
        loss = cross_entropy(logits, batch["targets"]).mean()
        return (loss * scale if scale is not None else loss), loss

    # FP8 scales and amax histories are differentiated too: their "gradients" are their updated
    # values (Flax's overwrite-with-gradient convention), taken as is, never given to the optimizer.
    (_, loss), (grads, new_fp8) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.params, state.fp8
    )
    if state.loss_scale is not None:
        grads = loss_scale_lib.unscale(grads, state.loss_scale)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, fp8=new_fp8)
    metrics = {
        "loss": loss,
        "lr": schedule(state.step),
        "grad_norm": optax.global_norm(grads),
        "param_norm": optax.global_norm(params),
        "update_norm": optax.global_norm(updates),
    }
    if state.loss_scale is not None:
        # Non-finite gradients anywhere (a global reduction, so all devices agree): keep the old
        # params, optimizer and FP8 state, shrink the scale. The step counter still advances.
        finite = loss_scale_lib.all_finite(grads)
        kept = loss_scale_lib.select(finite, new_state, state.replace(step=state.step + 1))
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
    return new_state, metrics


def eval_step(state: TrainState, batch: Batch, *, model: nn.Module) -> Metrics:
    """Sums over one batch (so means over many batches are exact): loss_sum, correct, tokens."""
    logits = model.apply(
        fp8_lib.merge(state.params, state.fp8), batch["inputs"], deterministic=True
    )
    loss = cross_entropy(logits, batch["targets"])
    correct = jnp.argmax(logits, axis=-1) == batch["targets"]
    return {
        "loss_sum": loss.sum(),
        "correct": correct.sum().astype(jnp.float32),
        "tokens": jnp.asarray(loss.size, jnp.float32),
    }


def jit_steps(
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    state_shardings: Any,
    batch_sharding: NamedSharding,
    loss_scale: LossScaleConfig | None = None,
) -> tuple[Any, Any]:
    """The jitted train and eval steps with explicit shardings; the train step donates its state.

    Returns:
      (train_step(state, batch) -> (state, metrics), eval_step(state, batch) -> metrics)
    """
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    train = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule, loss_scale=loss_scale),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        functools.partial(eval_step, model=model),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=replicated,
    )
    return train, evaluate
