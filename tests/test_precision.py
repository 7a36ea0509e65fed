"""Precision policies: bf16 compute keeps fp32 master weights and fp32 logits/loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import hopperjax
from hopperjax.trainer import cross_entropy


def test_bf16_forward_matches_fp32_within_bf16_rounding(tiny_config):
    config = tiny_config()
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 32), 0, 256)
    fp32 = hopperjax.build_model(config.model, hopperjax.get_policy("fp32"))
    bf16 = hopperjax.build_model(config.model, hopperjax.get_policy("bf16"))
    params = nn.meta.unbox(jax.jit(fp32.init)(jax.random.PRNGKey(0), tokens))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))

    logits32 = jax.jit(fp32.apply)(params, tokens)
    logits16 = jax.jit(bf16.apply)(params, tokens)  # same fp32 master weights, bf16 compute
    assert logits16.dtype == jnp.float32
    loss32 = float(cross_entropy(logits32, tokens).mean())
    loss16 = float(cross_entropy(logits16, tokens).mean())
    # bf16 keeps 8 mantissa bits (relative rounding 2^-8 ~ 0.4%); the mean loss must agree far
    # better than one rounding step, while the logits themselves visibly differ.
    assert abs(loss16 - loss32) / loss32 < 4e-3
    assert not np.array_equal(np.asarray(logits16), np.asarray(logits32))


def test_bf16_run_trains_with_fp32_state(tiny_config):
    result = hopperjax.train(
        tiny_config("precision=bf16", "train.steps=10", "train.eval_every=10"), console=False
    )
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    state_leaves = jax.tree.leaves((result.state.params, result.state.opt_state))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in state_leaves)
