"""The optax chain: clipping, optimizer, weight-decay mask, warmup + decay schedule, LR scaling."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hopperjax.config import OptimConfig

# Leaves named like this are matrices (Dense kernels, embeddings) and get weight decay; norm
# scales and biases do not. Matching by name, not ndim, because the layer scan adds a leading
# axis that turns every norm scale into a 2-D array.
DECAYED_LEAF_NAMES = frozenset({"kernel", "embedding", "pos_embed"})


def peak_learning_rate(config: OptimConfig, global_batch_size: int) -> float:
    """``base_lr`` scaled from ``base_batch_size`` to the actual global batch.

    linear: lr = base_lr * B / B0 (Goyal et al. 2017); sqrt: lr = base_lr * sqrt(B / B0), the usual
    rule for adaptive optimizers; none: lr = base_lr.
    """
    base_batch = config.base_batch_size or global_batch_size
    ratio = global_batch_size / base_batch
    if config.lr_scaling == "linear":
        return config.base_lr * ratio
    if config.lr_scaling == "sqrt":
        return config.base_lr * math.sqrt(ratio)
    return config.base_lr


def build_schedule(
    config: OptimConfig, *, total_steps: int, global_batch_size: int
) -> optax.Schedule:
    """Linear warmup to the peak, then cosine / linear / constant decay to ``min_lr_ratio * peak``.

    Warmup is lr = peak * (step + 1) / (warmup + 1), so step 0 already learns and step ``warmup``
    is exactly at the peak; decay reaches its floor at ``total_steps``.
    """
    peak = peak_learning_rate(config, global_batch_size)
    floor = peak * config.min_lr_ratio
    warmup = config.warmup_steps
    decay_steps = max(1, total_steps - warmup)
    kind = config.schedule

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1.0) / (warmup + 1.0)
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if kind == "cosine":
            decayed = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * progress))
        elif kind == "linear":
            decayed = peak + (floor - peak) * progress
        else:
            decayed = jnp.full_like(progress, peak)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay (see ``DECAYED_LEAF_NAMES``)."""

    def is_decayed(path: tuple[Any, ...], _: Any) -> bool:
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        return bool(names) and names[-1] in DECAYED_LEAF_NAMES

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def build_optimizer(
    config: OptimConfig, *, total_steps: int, global_batch_size: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns the gradient transformation and the schedule it uses (the step logs the LR).

    ``lars`` multiplies each layer's update by optax's trust coefficient (1e-3) times the
    weight/gradient norm ratio, so it needs a ``base_lr`` about 1000x that of AdamW.
    """
    lr = build_schedule(config, total_steps=total_steps, global_batch_size=global_batch_size)
    wd = config.weight_decay
    if config.name == "adamw":
        opt = optax.adamw(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=decay_mask
        )
    elif config.name == "lamb":
        opt = optax.lamb(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=decay_mask
        )
    elif config.name == "lars":
        opt = optax.lars(
            lr,
            weight_decay=wd,
            weight_decay_mask=decay_mask,
            trust_ratio_mask=decay_mask,
            momentum=config.momentum,
            nesterov=config.nesterov,
        )
    else:
        opt = optax.chain(
            optax.add_decayed_weights(wd, mask=decay_mask),
            optax.sgd(lr, momentum=config.momentum, nesterov=config.nesterov),
        )
    if config.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(config.clip_norm), opt)
    return opt, lr
