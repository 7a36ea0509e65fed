"""The optax chain: clipping, optimizer, weight-decay mask, warmup + decay schedule, LR scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hopperjax.config import OptimConfig

# Leaves named like this are matrices (Dense kernels, embeddings) and get weight decay; norm
# scales and biases do not. Matching by name, not ndim, because the layer scan adds a leading
# axis that turns every norm scale into a 2-D array.
DECAYED_LEAF_NAMES = frozenset({"kernel", "embedding", "pos_embed"})
# The label of parameters that get the configured optimizer when a workload labels its groups.
DEFAULT_GROUP = "default"


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
    """Linear warmup to the peak, then cosine / linear / constant decay to ``min_lr_ratio * peak``,
    or ``rsqrt``: the inverse-square-root decay of the Transformer and fairseq.

    Warmup is lr = peak * (step + 1) / (warmup + 1), so step 0 already learns and step ``warmup``
    is exactly at the peak (with ``warmup_init_ratio`` r: peak * (r + (1 - r) * that fraction),
    from r x peak); cosine and linear decay reach their floor at ``total_steps``. ``rsqrt``
    ignores ``total_steps``: lr = peak * sqrt((warmup + 1) / (step + 1)) after warmup (peak at
    step ``warmup``, half of it at step ``4 * (warmup + 1) - 1``), never below
    ``min_lr_ratio * peak``.
    """
    peak = peak_learning_rate(config, global_batch_size)
    floor = peak * config.min_lr_ratio
    warmup = config.warmup_steps
    decay_steps = max(1, total_steps - warmup)
    kind = config.schedule

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        start = config.warmup_init_ratio
        warm = peak * (start + (1.0 - start) * (step + 1.0) / (warmup + 1.0))
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if kind == "cosine":
            decayed = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(jnp.pi * progress))
        elif kind == "linear":
            decayed = peak + (floor - peak) * progress
        elif kind == "rsqrt":
            decayed = jnp.maximum(peak * jnp.sqrt((warmup + 1.0) / (step + 1.0)), floor)
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
    config: OptimConfig,
    *,
    total_steps: int,
    global_batch_size: int,
    param_labels: Callable[[Any], Any] | None = None,
    group_optimizers: Callable[[optax.Schedule], dict[str, optax.GradientTransformation]]
    | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns the gradient transformation and the schedule it uses (the step logs the LR).

    ``lars`` multiplies each layer's update by optax's trust coefficient (1e-3) times the
    weight/gradient norm ratio, so it needs a ``base_lr`` about 1000x that of AdamW.

    Per-group optimizers (a workload's ``param_labels``): leaves labelled ``DEFAULT_GROUP`` get
    the configured optimizer, every other label the transformation ``group_optimizers(schedule)``
    gives it, through ``optax.multi_transform``; labels of None: the configured optimizer alone.
    Clipping by the global norm comes first, over all gradients.
    """
    lr = build_schedule(config, total_steps=total_steps, global_batch_size=global_batch_size)
    opt = _optimizer(config, lr)
    if param_labels is not None:
        groups = {DEFAULT_GROUP: opt, **(group_optimizers(lr) if group_optimizers else {})}
        opt = _grouped(opt, groups, param_labels)
    if config.clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(config.clip_norm), opt)
    if config.ema_decay:
        opt = optax.chain(
            opt,
            lookahead_average(
                config.ema_decay, every=config.ema_every, start=config.ema_start,
                ramp=config.ema_ramp, total_steps=total_steps,
            ),
        )  # fmt: skip
    return opt, lr


class LookaheadAverageState(NamedTuple):
    """``count``: updates so far; ``average``: the averaged weights (fp32, like the params)."""

    count: jax.Array
    average: Any


def lookahead_average(
    decay: float, *, every: int = 1, start: int = 0, ramp: float = 0.0, total_steps: int = 1
) -> optax.GradientTransformation:
    """Lookahead weight averaging, the last link of a chain (``optim.ema_*`` keys).

    After update ``n`` (from 1), where ``n >= start`` and ``n % every == 0``, and after the last
    update (``n == total_steps``, so the run ends on the average): the weights the update would
    give, ``w``, move the average, ``avg <- rho avg + (1 - rho) w`` with ``rho = decay (n /
    total_steps) ** ramp`` (the first such update sets ``avg = w``), and the update is replaced
    by one that lands the weights on the new average. Other updates pass unchanged, and the
    average is neither read nor written (a ``lax.cond``: no pass over it on those steps).
    """

    def init(params: Any) -> LookaheadAverageState:
        return LookaheadAverageState(
            count=jnp.zeros((), jnp.int32), average=jax.tree.map(jnp.array, params)
        )

    def update(updates: Any, state: LookaheadAverageState, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("lookahead_average needs the params")
        n = state.count + 1
        sync = (n >= start) & ((n % every == 0) | (n == total_steps))
        # The first sync: the last multiple of ``every`` before ``n`` came before ``start`` (or
        # is 0), so no earlier update synced.
        first = (n - 1) // every * every < max(start, 1)
        rho = jnp.where(first, 0.0, decay * (n.astype(jnp.float32) / total_steps) ** ramp)

        def synced(operands: tuple[Any, Any, Any]) -> tuple[Any, Any]:
            average, params, updates = operands
            average = jax.tree.map(
                lambda a, p, u: (rho * a + (1 - rho) * (p + u)).astype(a.dtype),
                average, params, updates,
            )  # fmt: skip
            landing = jax.tree.map(
                lambda a, p, u: (a - p).astype(u.dtype), average, params, updates
            )
            return landing, average

        def passed(operands: tuple[Any, Any, Any]) -> tuple[Any, Any]:
            average, _, updates = operands
            return updates, average

        updates, average = jax.lax.cond(sync, synced, passed, (state.average, params, updates))
        return updates, LookaheadAverageState(count=n, average=average)

    return optax.GradientTransformation(init, update)


def _grouped(
    opt: optax.GradientTransformation,
    groups: dict[str, optax.GradientTransformation],
    param_labels: Callable[[Any], Any],
) -> optax.GradientTransformation:
    """``optax.multi_transform`` over ``groups`` where ``param_labels`` labels the parameters,
    and ``opt`` alone (its state, not a one-group wrapper's) where it returns None: a workload
    whose groups depend on its config keeps the plain optimizer's state, and the checkpoints
    it wrote before it had groups, in the configs without them."""
    multi = optax.multi_transform(groups, _checked_labels(param_labels, set(groups)))

    def ungrouped(tree: Any) -> bool:  # the labels depend on the tree's structure alone
        return param_labels(tree) is None

    def init(params: Any) -> Any:
        return opt.init(params) if ungrouped(params) else multi.init(params)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        chosen = opt if ungrouped(updates if params is None else params) else multi
        return chosen.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def _checked_labels(param_labels: Callable[[Any], Any], known: set[str]) -> Callable[[Any], Any]:
    def labels(params: Any) -> Any:
        out = param_labels(params)
        unknown = set(jax.tree.leaves(out)) - known
        if unknown:  # a workload bug: its labels and its group_optimizers disagree
            raise ValueError(
                f"parameter labels {sorted(unknown)} have no optimizer; known: {sorted(known)}"
            )
        return out

    return labels


def _optimizer(config: OptimConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    wd = config.weight_decay
    if config.name == "adamw":
        return optax.adamw(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=decay_mask
        )
    if config.name == "lamb":
        return optax.lamb(
            lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd, mask=decay_mask
        )
    if config.name == "lars":
        return optax.lars(
            lr,
            weight_decay=wd,
            weight_decay_mask=decay_mask,
            trust_ratio_mask=decay_mask,
            momentum=config.momentum,
            nesterov=config.nesterov,
        )
    return optax.chain(
        optax.add_decayed_weights(wd, mask=decay_mask),
        optax.sgd(lr, momentum=config.momentum, nesterov=config.nesterov),
    )
