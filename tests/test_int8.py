"""INT8 post-training quantization: the kernel and dot math, and every workload's model converted
through the layer factories and predicting close to its float self."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from infer_helpers import predict_batch as _predict
from infer_helpers import restored_from_init as _restored

from hopperjax import workloads
from hopperjax.config import ConfigError
from hopperjax.infer.quantize import quantize_restored, weight_bytes
from hopperjax.precision import int8 as int8_ops


def test_kernels_get_one_scale_per_output_channel_whatever_the_stacking():
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.normal(size=(3, 16, 8)) * np.arange(1, 9), jnp.float32)
    kernel = kernel.at[1, :, 2].set(0.0)  # a dead channel keeps scale 1, values 0
    q, scale = int8_ops.quantize_kernel(kernel, (1,))  # scanned [layers, in, out]
    assert q.dtype == jnp.int8 and scale.shape == (3, 1, 8)
    assert int8_ops.contracted_dims(scale.shape) == (1,)
    assert np.abs(np.asarray(q)).max() == 127
    assert float(scale[1, 0, 2]) == 1.0 and not np.asarray(q[1, :, 2]).any()
    error = np.abs(np.asarray(q, np.float32) * np.asarray(scale) - np.asarray(kernel))
    assert (error <= np.asarray(scale) / 2 + 1e-7).all()


@pytest.mark.parametrize("scheme", ["weight", "w8a8", "w8a8_static"])
def test_int8_dots_match_the_float_dot(scheme):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 4, 8)) / 8, jnp.float32)  # two output dims
    q, scale = int8_ops.quantize_kernel(w, (0,))
    static = jnp.max(jnp.abs(x)) / 127
    y = int8_ops.int8_dot(x, q, scale, 1, scheme, jnp.float32, static)
    ref = jnp.einsum("bi,ioh->boh", x, w)
    assert y.shape == ref.shape
    assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < 0.02


def test_w8a8_runs_an_int8_gemm_with_int32_accumulation():
    """The lowered W8A8 dot takes s8 operands and accumulates in s32 (a real INT8 GEMM, not a
    float dot on dequantized values); integers in range come out exact."""
    rng = np.random.default_rng(2)
    x, w = rng.integers(-127, 128, (2, 64)), rng.integers(-127, 128, (64, 8))
    x[:, 0], w[0] = 127, -127  # absmax 127 per row and per column: scales of exactly 1
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    q, scale = int8_ops.quantize_kernel(w, (0,))
    fn = jax.jit(lambda x: int8_ops.int8_dot(x, q, scale, 1, "w8a8", jnp.float32))
    hlo = fn.lower(x).as_text()
    assert "i8>" in hlo and "i32>" in hlo and "dot_general" in hlo
    np.testing.assert_allclose(fn(x), x @ w, rtol=1e-5)


@pytest.mark.parametrize("name", workloads.builtin_names())
def test_every_workload_quantizes_and_predicts_close_to_float(name, tmp_path):
    """Every Dense and convolution kernel becomes int8 (a quarter of its fp32 bytes, plus one
    float scale per output channel); predictions stay within a few % of the float model's
    (random weights: a trained model's figures are in the README); unknown schemes and a static
    scheme without calibration data are refused naming the key."""
    restored, batches = _restored(name, tmp_path)
    ref = _predict(restored, batches[0])
    floats = weight_bytes(restored.variables)
    for scheme in int8_ops.SCHEMES:
        q = quantize_restored(restored, scheme, batches[1:])
        kernels = [
            (path, leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(q.variables["params"])
            if getattr(path[-1], "key", None) == "kernel"
        ]
        assert kernels and all(leaf.dtype == jnp.int8 for _, leaf in kernels), scheme
        assert weight_bytes(q.variables) < floats
        out = _predict(q, batches[0])
        assert out.shape == ref.shape
        rel = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert rel < {"weight": 0.03, "w8a8": 0.06, "w8a8_static": 0.1}[scheme], (scheme, rel)
    with pytest.raises(ConfigError, match="--quantize"):
        quantize_restored(restored, "int4")
    with pytest.raises(ConfigError, match="calibration-batches"):
        quantize_restored(restored, "w8a8_static")
    with pytest.raises(ConfigError, match="calibration-batches"):
        quantize_restored(restored, "w8a8_static", [])


def test_kernel_bytes_shrink_four_times(tmp_path):
    """The GPT smoke model: every kernel's bytes / 4 plus its scales."""
    restored, _ = _restored("lm", tmp_path)
    q = quantize_restored(restored, "weight")
    flat = dict(jax.tree_util.tree_leaves_with_path(restored.variables["params"]))
    qflat = dict(jax.tree_util.tree_leaves_with_path(q.variables["params"]))
    for path, leaf in flat.items():
        if getattr(path[-1], "key", None) != "kernel":
            assert qflat[path].dtype == leaf.dtype  # embeddings, norms, biases: as they were
            continue
        assert qflat[path].nbytes * 4 == leaf.nbytes
        scale = qflat[(*path[:-1], jax.tree_util.DictKey(int8_ops.KERNEL_SCALE))]
        assert scale.dtype == jnp.float32 and scale.size < leaf.size / 4


def test_static_calibration_records_a_percentile_of_the_input_magnitudes(tmp_path):
    """100 records each layer's largest |x|; a lower percentile lets outliers saturate, so its
    scales come out smaller; the key is checked."""
    x = jnp.concatenate([jnp.linspace(-1.0, 1.0, 1001), jnp.array([50.0])])
    assert float(int8_ops.magnitude(x, 100.0)) == 50.0
    assert float(int8_ops.magnitude(x, 50.0)) == pytest.approx(0.5, abs=2e-3)
    from hopperjax.infer.quantize import calibrate

    restored, batches = _restored("lm", tmp_path)
    leaves = {p: jax.tree.leaves(calibrate(restored, batches, percentile=p)) for p in (100.0, 99.0)}
    assert len(leaves[100.0]) == len(leaves[99.0]) > 0
    for top, clipped in zip(leaves[100.0], leaves[99.0], strict=True):
        assert (np.asarray(clipped) <= np.asarray(top)).all()
    assert any((np.asarray(c) < np.asarray(t)).any()
               for t, c in zip(leaves[100.0], leaves[99.0], strict=True))  # fmt: skip
    with pytest.raises(ConfigError, match="calibration-percentile"):
        calibrate(restored, batches, percentile=0.0)
