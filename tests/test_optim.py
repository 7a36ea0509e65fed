"""Optimizer tests: LR scaling, schedules, weight-decay mask, every optimizer, gradient clipping."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hopperjax
from hopperjax.config import OptimConfig
from hopperjax.models.gpt import GPT, GPTConfig
from hopperjax.optim import build_optimizer, build_schedule, decay_mask, peak_learning_rate

RTOL = 1e-6  # schedules are evaluated in float32


# ------------------------------------------------------------------------------------------------
# Peak learning rate


@pytest.mark.parametrize(
    "scaling,batch,expected",
    [
        ("linear", 128, 0.004),
        ("linear", 16, 0.0005),
        ("sqrt", 128, 0.001 * 2.0),
        ("sqrt", 8, 0.001 * 0.5),
        ("none", 128, 0.001),
    ],
)
def test_peak_learning_rate_scaling(scaling, batch, expected):
    config = OptimConfig(base_lr=1e-3, base_batch_size=32, lr_scaling=scaling)
    assert peak_learning_rate(config, batch) == pytest.approx(expected, rel=1e-12)


def test_peak_learning_rate_formulas_at_odd_ratio():
    """B/B0 = 3/7: linear gives base*3/7, sqrt base*sqrt(3/7)."""
    linear = OptimConfig(base_lr=0.3, base_batch_size=7, lr_scaling="linear")
    sqrt = dataclasses.replace(linear, lr_scaling="sqrt")
    assert peak_learning_rate(linear, 3) == pytest.approx(0.3 * 3 / 7, rel=1e-12)
    assert peak_learning_rate(sqrt, 3) == pytest.approx(0.3 * math.sqrt(3 / 7), rel=1e-12)


@pytest.mark.parametrize("scaling", ["linear", "sqrt", "none"])
def test_no_base_batch_size_means_no_scaling(scaling):
    config = OptimConfig(base_lr=2e-3, base_batch_size=None, lr_scaling=scaling)
    for batch in (1, 32, 1024):
        assert peak_learning_rate(config, batch) == pytest.approx(2e-3, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# Schedules


def _lrs(config: OptimConfig, total_steps: int, batch: int = 32) -> np.ndarray:
    schedule = build_schedule(config, total_steps=total_steps, global_batch_size=batch)
    return np.array([float(schedule(s)) for s in range(total_steps + 5)])


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "rsqrt"])
def test_warmup(kind):
    """lr(s) = peak * (s + 1) / (w + 1) for s < w, and lr(w) == peak, whatever the decay."""
    config = OptimConfig(
        base_lr=1e-3,
        base_batch_size=16,
        lr_scaling="linear",
        warmup_steps=5,
        schedule=kind,
        min_lr_ratio=0.1,
    )
    peak = 2e-3  # batch 32 / base 16
    lrs = _lrs(config, total_steps=30)
    for s in range(5):
        assert lrs[s] == pytest.approx(peak * (s + 1) / 6, rel=RTOL), s
    assert lrs[5] == pytest.approx(peak, rel=RTOL)
    assert np.all(np.diff(lrs[:6]) > 0)


def test_no_warmup_starts_at_peak():
    config = OptimConfig(base_lr=1e-3, warmup_steps=0, schedule="cosine")
    assert _lrs(config, total_steps=10)[0] == pytest.approx(1e-3, rel=RTOL)


def test_cosine_decay():
    """Cosine: non-increasing after warmup, peak*min_lr_ratio at total_steps, mean half-way."""
    config = OptimConfig(base_lr=1e-3, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    peak, floor, total = 1e-3, 1e-4, 24
    lrs = _lrs(config, total_steps=total)
    after = lrs[4:]
    assert np.all(np.diff(after) <= 1e-12), after
    assert lrs[total] == pytest.approx(floor, rel=RTOL)
    assert np.allclose(lrs[total:], floor, rtol=RTOL)  # stays at the floor afterwards
    assert lrs[4 + (total - 4) // 2] == pytest.approx((peak + floor) / 2, rel=RTOL)
    assert lrs[total - 1] > floor * (1 + 1e-3)  # the floor is reached at, not before, total_steps


def test_cosine_min_lr_ratio_zero_reaches_zero():
    config = OptimConfig(base_lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
    assert _lrs(config, total_steps=12)[12] == pytest.approx(0.0, abs=1e-10)


def test_linear_decay():
    config = OptimConfig(base_lr=1e-3, warmup_steps=2, schedule="linear", min_lr_ratio=0.2)
    peak, floor, total = 1e-3, 2e-4, 12
    lrs = _lrs(config, total_steps=total)
    for s in range(2, total + 1):
        expected = peak + (floor - peak) * (s - 2) / (total - 2)
        assert lrs[s] == pytest.approx(expected, rel=RTOL), s
    assert np.allclose(lrs[total:], floor, rtol=RTOL)


def test_constant_after_warmup():
    config = OptimConfig(base_lr=1e-3, warmup_steps=3, schedule="constant", min_lr_ratio=0.1)
    lrs = _lrs(config, total_steps=10)
    assert np.allclose(lrs[3:], 1e-3, rtol=RTOL)
    assert lrs[0] == pytest.approx(1e-3 / 4, rel=RTOL)


def test_rsqrt_decay_ignores_the_run_length_and_stops_at_the_floor():
    """peak * sqrt((w + 1) / (s + 1)) after warmup: half the peak at 4 (w + 1) - 1 steps, the
    same whatever train.steps is, and never below min_lr_ratio * peak."""
    config = OptimConfig(base_lr=1e-3, warmup_steps=3, schedule="rsqrt", min_lr_ratio=0.1)
    lrs = _lrs(config, total_steps=500)
    assert lrs[3] == pytest.approx(1e-3, rel=RTOL)
    assert lrs[15] == pytest.approx(5e-4, rel=RTOL)
    assert lrs[99] == pytest.approx(2e-4, rel=RTOL)
    np.testing.assert_allclose(_lrs(config, total_steps=20)[:25], lrs[:25], rtol=RTOL)
    assert np.all(np.diff(lrs[3:]) <= 0)
    np.testing.assert_allclose(lrs[399:], 1e-4, rtol=RTOL)
    assert lrs[398] > 1e-4 * (1 + 1e-4)  # the floor is reached at step 399, not before
    no_warmup = _lrs(OptimConfig(base_lr=1e-3, warmup_steps=0, schedule="rsqrt"), total_steps=10)
    assert no_warmup[0] == pytest.approx(1e-3, rel=RTOL)
    assert no_warmup[3] == pytest.approx(5e-4, rel=RTOL)


# ------------------------------------------------------------------------------------------------
# Weight-decay mask


def _tiny_gpt_params(**overrides) -> dict:
    config = GPTConfig(vocab_size=32, d_model=8, n_layers=2, n_heads=2, max_len=8, **overrides)
    model = GPT(config=config, policy=hopperjax.get_policy("fp32"))
    # Shapes suffice for the mask; eval_shape avoids computing the initializers.
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return nn.meta.unbox(boxed)["params"]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"positions": "learned", "tie_embeddings": False, "use_bias": True, "mlp": "swiglu"},
    ],
    ids=["default", "learned-untied-bias-swiglu"],
)
def test_decay_mask_on_gpt_params(overrides):
    """Kernels and embeddings decay; norm scales (2-D under the scan) and biases do not."""
    params = _tiny_gpt_params(**overrides)
    mask = decay_mask(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    flat = {
        "/".join(p.key for p in path): value
        for path, value in jax.tree_util.tree_leaves_with_path(mask)
    }
    assert len(flat) == len(jax.tree.leaves(params))
    seen = set()
    for name, value in flat.items():
        last = name.rsplit("/", 1)[-1]
        seen.add(last)
        if last in ("kernel", "embedding", "pos_embed"):
            assert value is True, name
        else:
            assert last in ("scale", "bias"), name
            assert value is False, name
    # The scanned norm scales really are 2-D, so an ndim-based rule would get them wrong.
    assert params["blocks"]["attn_norm"]["scale"].ndim == 2
    assert mask["blocks"]["attn_norm"]["scale"] is False
    assert mask["final_norm"]["scale"] is False
    assert mask["token_embed"]["embedding"] is True
    expected = {"kernel", "embedding", "scale"} | ({"pos_embed", "bias"} if overrides else set())
    assert seen == expected


# ------------------------------------------------------------------------------------------------
# Optimizers


TARGET = {"w": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}}


def _quadratic_loss(params) -> jax.Array:
    return jnp.sum((params["w"]["kernel"] - TARGET["w"]["kernel"]) ** 2)


# LARS multiplies the step by trust_coefficient (0.001) * ||w|| / ||g||, so its base_lr is larger.
BASE_LR = {"adamw": 0.05, "sgd": 0.05, "lamb": 0.05, "lars": 20.0}


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb", "lars"])
def test_optimizer_decreases_quadratic_loss(name):
    """50 updates cut a quadratic loss at least 4x (weight decay and clipping switched on)."""
    config = OptimConfig(
        name=name,
        base_lr=BASE_LR[name],
        schedule="constant",
        warmup_steps=0,
        weight_decay=0.01,
        clip_norm=1.0,
    )
    tx, _ = build_optimizer(config, total_steps=50, global_batch_size=32)
    # Start away from zero: LARS and LAMB steps are proportional to ||w||.
    params = {"w": {"kernel": jnp.full((4, 3), 0.1)}}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(_quadratic_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    initial = float(_quadratic_loss(params))
    for _ in range(50):
        params, opt_state = step(params, opt_state)
    final = float(_quadratic_loss(params))
    assert np.isfinite(final)
    assert final < 0.25 * initial, (name, initial, final)


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_clip_norm_bounds_the_first_update(clip_norm):
    """SGD without decay: first update = -lr * clipped grad, so ||update|| / lr <= clip_norm."""
    lr = 0.1
    config = OptimConfig(
        name="sgd",
        base_lr=lr,
        schedule="constant",
        warmup_steps=0,
        weight_decay=0.0,
        momentum=0.9,
        clip_norm=clip_norm,
    )
    tx, _ = build_optimizer(config, total_steps=10, global_batch_size=32)
    params = {"w": {"kernel": jnp.zeros((4, 3))}}
    grads = {"w": {"kernel": jnp.full((4, 3), 10.0)}}  # global norm sqrt(12) * 10 ~ 34.6
    grad_norm = float(optax.global_norm(grads))
    updates, _ = tx.update(grads, tx.init(params), params)
    update_norm = float(optax.global_norm(updates)) / lr
    if clip_norm is None:
        assert update_norm == pytest.approx(grad_norm, rel=1e-5)
    else:
        assert update_norm <= clip_norm * (1 + 1e-5)
        assert update_norm == pytest.approx(clip_norm, rel=1e-5)  # clipped, not zeroed
        # Direction is kept: the update is parallel to the gradient.
        expected = jax.tree.map(lambda g: -lr * g * clip_norm / grad_norm, grads)
        np.testing.assert_allclose(updates["w"]["kernel"], expected["w"]["kernel"], rtol=1e-5)


def test_clip_norm_leaves_small_gradients_alone():
    config = OptimConfig(
        name="sgd", base_lr=1.0, schedule="constant", weight_decay=0.0, clip_norm=100.0
    )
    tx, _ = build_optimizer(config, total_steps=10, global_batch_size=32)
    params = {"w": {"kernel": jnp.zeros((2, 2))}}
    grads = {"w": {"kernel": jnp.array([[1.0, -2.0], [3.0, 0.5]])}}
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"]["kernel"], -grads["w"]["kernel"], rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb", "lars"])
def test_weight_decay_follows_the_mask(name):
    """With zero gradients only masked-in leaves (kernels) move; norm scales stay put."""
    config = OptimConfig(
        name=name, base_lr=0.1, schedule="constant", weight_decay=0.5, clip_norm=None
    )
    tx, _ = build_optimizer(config, total_steps=10, global_batch_size=32)
    params = {"w": {"kernel": jnp.ones((3, 3))}, "n": {"scale": jnp.ones((2, 3))}}
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert float(jnp.max(jnp.abs(updates["w"]["kernel"]))) > 1e-4, "kernel was not decayed"
    np.testing.assert_array_equal(updates["n"]["scale"], 0.0)


# ------------------------------------------------------------------------------------------------
# Parameter groups


def test_labels_of_none_keep_the_plain_optimizer_and_its_state_and_labels_group_it():
    """A workload whose config has no groups (its ``param_labels`` gives None) trains with the
    configured optimizer's own state, the one its checkpoints held before the workload had
    groups; labels route each leaf to its group's optimizer."""
    config = OptimConfig(name="sgd", base_lr=0.1, momentum=0.9, schedule="constant",
                         warmup_steps=0, clip_norm=None, weight_decay=0.0)  # fmt: skip
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    grads = {"a": jnp.full(3, 2.0), "b": jnp.full(2, 2.0)}
    plain, _ = build_optimizer(config, total_steps=10, global_batch_size=1)
    groups = {"frozen": optax.set_to_zero()}
    frozen_b = {"a": "default", "b": "frozen"}
    for labels, moved in ((None, ("a", "b")), (frozen_b, ("a",))):
        tx, _ = build_optimizer(config, total_steps=10, global_batch_size=1,
                                param_labels=lambda tree, labels=labels: labels,
                                group_optimizers=lambda schedule: groups)  # fmt: skip
        state = tx.init(params)
        if labels is None:
            same = jax.tree.structure(state) == jax.tree.structure(plain.init(params))
            assert same, state
        else:
            assert jax.tree.structure(state) != jax.tree.structure(plain.init(params))
        updates, state = jax.jit(tx.update)(grads, state, params)
        for name in params:
            expected = -0.2 if name in moved else 0.0
            np.testing.assert_allclose(updates[name], expected, rtol=RTOL)


# ------------------------------------------------------------------------------------------------
# Lookahead weight averaging (optim.ema_*)


def _airbench_lookahead(w, grad, *, lr, steps, decay, every, start, ramp):
    """The loop airbench94 runs (plain SGD here), in numpy float64: after update n, where
    n >= start and n % every == 0 (and, ours, after the last update), the first time the average
    is taken as the weights, later avg <- rho avg + (1 - rho) w, rho = decay (n / steps) **
    ramp; the weights <- avg."""
    avg = None
    for n in range(1, steps + 1):
        w = w - lr * grad(w)
        if n >= start and (n % every == 0 or n == steps):
            if avg is None:
                avg = w.copy()
            else:
                rho = decay * (n / steps) ** ramp
                avg = rho * avg + (1 - rho) * w
            w = avg.copy()
    return w


@pytest.mark.parametrize(
    "every,start,ramp,steps",
    [(1, 0, 0.0, 40), (5, 12, 3.0, 40), (3, 7, 1.0, 40), (5, 0, 0.0, 42), (5, 10, 2.0, 43)],
)
def test_lookahead_average_is_airbench_loop(every, start, ramp, steps):
    """Every start: before the first multiple of every, on one, at 0 (update 0 does not count);
    runs that end between two averaging updates (the last one averages)."""
    target = np.array([1.0, -2.0, 0.5, 3.0])
    curvature = np.array([1.0, 0.3, 2.0, 0.7])
    lr, decay = 0.2, 0.9
    config = OptimConfig(name="sgd", base_lr=lr, momentum=0.0, schedule="constant",
                         warmup_steps=0, clip_norm=None, weight_decay=0.0, ema_decay=decay,
                         ema_every=every, ema_start=start, ema_ramp=ramp)  # fmt: skip
    tx, _ = build_optimizer(config, total_steps=steps, global_batch_size=1)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = {"w": 2.0 * (params["w"] - target) * jnp.asarray(curvature)}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)

    def run(**settings):
        return _airbench_lookahead(np.zeros(4), lambda w: 2.0 * (w - target) * curvature,
                                   lr=lr, steps=steps, **settings)  # fmt: skip

    expected = run(decay=decay, every=every, start=start, ramp=ramp)
    np.testing.assert_allclose(params["w"], expected, rtol=1e-5, atol=1e-6)
    # The averaging changed the trajectory (the check above would pass for plain SGD otherwise),
    # and the run ends on the average.
    assert np.abs(expected - run(decay=0.0, every=1, start=steps + 1, ramp=0.0)).max() > 1e-3
    np.testing.assert_allclose(state[-1].average["w"], params["w"], rtol=1e-6)


@pytest.mark.parametrize(
    "key,value", [("ema_decay", 1.0), ("ema_decay", -0.1), ("ema_every", 0), ("ema_start", -1),
                  ("ema_ramp", -1.0), ("ema_ramp", "nan"), ("ema_start", 20)],
)  # fmt: skip
def test_lookahead_keys_are_checked(key, value, tmp_path):
    """One line naming the key: out of range, or averaging that would never happen."""
    overrides = [f"optim.{key}={value}", "train.steps=20", f"run_dir={tmp_path}"]
    if key != "ema_decay":
        overrides.append("optim.ema_decay=0.5")
    with pytest.raises(hopperjax.ConfigError, match=f"optim.{key}"):
        hopperjax.load_config(None, overrides)
