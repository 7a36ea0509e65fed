"""The T5-style encoder-decoder on packed rows: an example packed beside another gets exactly the
logits it gets alone (masks and per-example positions keep examples apart), the decoder is causal,
and the analytic FLOPs count what XLA compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hopperjax
from hopperjax.config import RematConfig
from hopperjax.data import parallel_text as pt
from hopperjax.models import t5

CONFIG = t5.T5Config(vocab_size=40, d_model=32, n_heads=2, encoder_layers=2, decoder_layers=2,
                     mlp_dim=64, dropout=0.0)  # fmt: skip
LEN = 16


def _batch(packed: pt.Packed) -> tuple:
    a = packed.arrays
    names = ("source", "source_segments", "source_positions", "target_inputs",
             "target_segments", "target_positions")  # fmt: skip
    return tuple(jnp.asarray(a[n]) for n in names)


def test_packed_examples_match_themselves_alone_and_the_decoder_is_causal():
    rng = np.random.default_rng(0)
    sources = [np.append(rng.integers(3, 40, n), pt.EOS_ID).astype(np.int32) for n in (5, 6)]
    targets = [np.append(rng.integers(3, 40, n), pt.EOS_ID).astype(np.int32) for n in (4, 7)]
    together = pt.pack(sources, targets, [0, 1], source_len=LEN, target_len=LEN)
    assert together.rows == 1
    alone = [pt.pack(sources, targets, [i], source_len=LEN, target_len=LEN) for i in (0, 1)]
    joined = {k: np.concatenate([alone[0].arrays[k], alone[1].arrays[k]]) for k in alone[0].arrays}
    model = t5.T5(CONFIG, hopperjax.get_policy("fp32"), RematConfig())
    both = _batch(pt.Packed({k: np.repeat(v, 2, 0) for k, v in together.arrays.items()}, 2, 0))
    params = jax.jit(model.init)(jax.random.key(0), *both)
    apply = jax.jit(model.apply)
    packed_logits = np.asarray(apply(params, *both))[0]
    alone_logits = np.asarray(apply(params, *_batch(pt.Packed(joined, 2, 0))))
    segments = together.arrays["target_segments"][0]
    for i in (0, 1):
        mine = segments == i + 1
        n = int(mine.sum())
        np.testing.assert_allclose(packed_logits[mine], alone_logits[i, :n], rtol=2e-5, atol=2e-5)
    # Causal: changing the second example's last decoder input changes no earlier position.
    changed = [np.array(x) for x in both]
    last = int(np.flatnonzero(segments == 2)[-1])
    changed[3][0, last] = (changed[3][0, last] + 1) % 40
    out = np.asarray(apply(params, *[jnp.asarray(x) for x in changed]))[0]
    np.testing.assert_allclose(out[:last], packed_logits[:last], rtol=1e-6, atol=1e-6)
    assert not np.allclose(out[last], packed_logits[last])


def test_forward_flops_count_the_compiled_gemms():
    # Unrolled layer scans: XLA's cost analysis counts a loop body once, not per iteration.
    config = dataclasses.replace(CONFIG, scan_unroll=2)
    model = t5.T5(config, hopperjax.get_policy("fp32"), RematConfig())
    rows = 4
    ids = jnp.ones((rows, LEN), jnp.int32)
    args = (ids, ids, ids, ids, ids, ids)
    params = jax.eval_shape(model.init, jax.random.key(0), *args)
    compiled = jax.jit(model.apply).lower(params, *args).compile()
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    analytic = t5.forward_flops(config, rows=rows, source_len=LEN, target_len=LEN)
    # XLA adds the elementwise work (norms, softmax, GELU, RoPE): a few percent at this size.
    assert analytic <= xla["flops"] <= 1.25 * analytic


def test_config_errors_name_the_key():
    with pytest.raises(hopperjax.ConfigError, match=r"model\.n_heads"):
        t5.T5Config(d_model=32, n_heads=3).validate()
    with pytest.raises(hopperjax.ConfigError, match=r"model\.dropout"):
        t5.T5Config(dropout=1.0).validate()
