"""The pure train and eval steps, and the one place they are jitted."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

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
) -> tuple[TrainState, Metrics]:
    """One optimizer update on one global batch.

    Args:
      state: the current train state.
      batch: ``inputs`` and ``targets``, each [batch, length] int32.

    Returns:
      (new state, scalar metrics: loss, lr, grad_norm, param_norm, update_norm).
    """
    dropout_key = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params: Any) -> jax.Array:
        logits = model.apply(
            {"params": params}, batch["inputs"], deterministic=False, rngs={"dropout": dropout_key}
        )
        return cross_entropy(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "lr": schedule(state.step),
        "grad_norm": optax.global_norm(grads),
        "param_norm": optax.global_norm(params),
        "update_norm": optax.global_norm(updates),
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def eval_step(state: TrainState, batch: Batch, *, model: nn.Module) -> Metrics:
    """Sums over one batch (so means over many batches are exact): loss_sum, correct, tokens."""
    logits = model.apply({"params": state.params}, batch["inputs"], deterministic=True)
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
) -> tuple[Any, Any]:
    """The jitted train and eval steps with explicit shardings; the train step donates its state.

    Returns:
      (train_step(state, batch) -> (state, metrics), eval_step(state, batch) -> metrics)
    """
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    train = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule),
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
