"""Dynamic loss scaling: keeps small fp16 (or fp8) gradients from flushing to zero.

The loss is multiplied by ``scale`` before differentiation and the gradients divided by it after.
A non-finite gradient anywhere (checked over the global arrays, so every device agrees) means the
scale overflowed: the update is skipped and the scale divided by ``factor``. After
``growth_interval`` finite steps in a row the scale grows by ``factor``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LossScaleState:
    """Lives in TrainState, so it is checkpointed with the run.

    Attributes:
      scale: [] fp32 current loss scale.
      good_steps: [] int32 finite steps since the last change.
      skipped: [] int32 updates skipped for non-finite gradients, over the whole run.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array

    @classmethod
    def create(cls, init_scale: float) -> LossScaleState:
        return cls(
            scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
        )


def all_finite(tree: Any) -> jax.Array:
    """[] bool: every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def unscale(grads: Any, state: LossScaleState) -> Any:
    inverse = 1.0 / state.scale
    return jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)


def adjust(
    state: LossScaleState, finite: jax.Array, *, growth_interval: int, factor: float
) -> LossScaleState:
    """The next state after a step whose gradients were (not) ``finite``."""
    grow = finite & (state.good_steps + 1 >= growth_interval)
    scale = jnp.where(
        finite, jnp.where(grow, state.scale * factor, state.scale), state.scale / factor
    )
    good_steps = jnp.where(finite & ~grow, state.good_steps + 1, 0)
    return LossScaleState(
        scale=scale.astype(jnp.float32),
        good_steps=good_steps.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
    )


def select(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where the step's gradients were finite, else ``old`` (the skipped update)."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
