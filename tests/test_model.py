"""GPT model and layer tests: shapes, dtypes, causality, parameter metadata and counts, RoPE."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.models import layers
from hopperjax.models.gpt import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
GOLDEN_SPECS = Path(__file__).parent / "golden" / "quickstart_partition_specs.json"

# Tiny sizes: compiling, not computing, dominates these tests' time.
TINY = GPTConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_len=16)
BATCH, LENGTH = 2, 8


@functools.cache
def _init(config: GPTConfig, precision: str = "fp32"):
    """(model, boxed variables, jitted apply), cached (eager init is slow on CPU)."""
    model = GPT(config=config, policy=hopperjax.get_policy(precision))
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((BATCH, LENGTH), jnp.int32))
    return model, variables, jax.jit(model.apply)


def _abstract_init(config: GPTConfig, precision: str = "fp32"):
    """Boxed variables as ShapeDtypeStructs: shapes, dtypes and metadata without computing."""
    model = GPT(config=config, policy=hopperjax.get_policy(precision))
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((BATCH, LENGTH), jnp.int32))


def _tokens(config: GPTConfig, seed: int = 1) -> jax.Array:
    return jax.random.randint(
        jax.random.key(seed), (BATCH, LENGTH), 0, config.vocab_size, dtype=jnp.int32
    )


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _path_str(path) -> str:
    return "/".join(str(p.key) for p in path)


def _param_count(variables) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(variables["params"])))


# ------------------------------------------------------------------------------------------------
# Shapes and dtypes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logits_shape_and_dtype(precision):
    """Logits are [batch, length, vocab] fp32 under both policies; params stay fp32."""
    _, variables, apply = _init(TINY, precision)
    logits = apply(variables, _tokens(TINY))
    assert logits.shape == (BATCH, LENGTH, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    dtypes = {
        _path_str(p): x.dtype
        for p, x in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(variables))
    }
    assert len(dtypes) == 8 and all(d == jnp.float32 for d in dtypes.values()), dtypes


def test_bf16_policy_actually_computes_in_bf16():
    """Same params, bf16 compute: logits differ from fp32 (not a no-op), but by < 5e-2."""
    _, variables, apply32 = _init(TINY, "fp32")
    _, _, apply16 = _init(TINY, "bf16")
    tokens = _tokens(TINY)
    diff = float(jnp.max(jnp.abs(apply32(variables, tokens) - apply16(variables, tokens))))
    assert 0.0 < diff < 5e-2, diff


# ------------------------------------------------------------------------------------------------
# Causality


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_causality(positions):
    """Changing the token at position t leaves logits at positions < t unchanged (atol 1e-6)."""
    config = dataclasses.replace(TINY, positions=positions)
    _, variables, apply = _init(config)
    tokens = _tokens(config)
    before = apply(variables, tokens)
    for t in (0, 3, LENGTH - 1):
        changed = tokens.at[:, t].set((tokens[:, t] + 1) % config.vocab_size)
        after = apply(variables, changed)
        np.testing.assert_allclose(
            after[:, :t],
            before[:, :t],
            atol=1e-6,
            rtol=0,
            err_msg=f"changing token {t} changed earlier logits",
        )
        # The change must show from position t on, or the comparison above proves nothing.
        assert float(jnp.max(jnp.abs(after[:, t:] - before[:, t:]))) > 1e-4, t


# ------------------------------------------------------------------------------------------------
# Parameter metadata


def test_every_param_is_logically_partitioned():
    """Every leaf of ``model.init`` is an ``nn.Partitioned`` box naming each of its dimensions."""
    _, variables, _ = _init(TINY)
    boxes = jax.tree_util.tree_leaves_with_path(variables, is_leaf=_is_box)
    assert boxes
    for path, leaf in boxes:
        assert isinstance(leaf, nn.Partitioned), f"{_path_str(path)} is unboxed: {type(leaf)}"
        assert len(leaf.names) == leaf.value.ndim, (_path_str(path), leaf.names, leaf.value.shape)
    # A partition spec exists for every parameter (none came out as a plain array).
    specs = nn.get_partition_spec(variables)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert len(spec_leaves) == len(boxes)
    assert all(isinstance(s, PartitionSpec) for s in spec_leaves)


def test_scanned_block_params_have_leading_layers_axis():
    """Params under 'blocks' are stacked: leading logical axis 'layers' of size n_layers."""
    config = dataclasses.replace(TINY, n_layers=3)
    variables = _abstract_init(config)
    blocks = variables["params"]["blocks"]
    leaves = jax.tree_util.tree_leaves_with_path(blocks, is_leaf=_is_box)
    assert len(leaves) == 6  # attn_norm, qkv, attn_out, mlp_norm, mlp_in, mlp_out
    for path, box in leaves:
        assert box.names[0] == "layers", _path_str(path)
        assert box.value.shape[0] == config.n_layers, _path_str(path)
    # Params outside the scan have no layers axis.
    for name in ("token_embed", "final_norm"):
        for path, box in jax.tree_util.tree_leaves_with_path(
            variables["params"][name], is_leaf=_is_box
        ):
            assert "layers" not in box.names, (name, _path_str(path))


def test_scan_unroll_gives_the_numbers_of_unroll_one():
    """model.scan_unroll changes how the layer loop is compiled, not what it computes: same
    parameters (same shapes and init), same logits and gradients within float32 rounding (the
    unrolled body may fuse differently). 2 layers unrolled 2: no loop left."""
    rolled = TINY
    unrolled = dataclasses.replace(rolled, scan_unroll=2)
    tokens = _tokens(rolled)
    results, loops = [], []
    for config in (rolled, unrolled):
        model, variables, _ = _init(config)

        def loss(params, model=model, variables=variables):
            logits = model.apply({**variables, "params": params}, tokens)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, logits), grads = step(variables["params"])
        results.append((variables["params"], logits, grads))
        loops.append(step.lower(variables["params"]).as_text().count("stablehlo.while"))
    assert loops[0] > 0 and loops[1] < loops[0], loops  # the knob reached the compiled loop
    (params_a, logits_a, grads_a), (params_b, logits_b, grads_b) = results
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(logits_b, logits_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(logits_a).max()) > 0.01  # a real signal, not all zeros


# ------------------------------------------------------------------------------------------------
# Parameter counts


def _expected_param_count(c: GPTConfig) -> int:
    """Analytic count derived from gpt.py (biases on every Dense but the lm_head when use_bias)."""
    d, v, mlp = c.d_model, c.vocab_size, c.mlp_dim or 4 * c.d_model
    mlp_in_out = 2 if c.mlp == "swiglu" else 1  # swiglu's mlp_in emits gate and up together
    norm = d + (d if c.use_bias else 0)  # LayerNorm scale (+ bias)
    per_layer = (
        2 * norm  # attn_norm, mlp_norm
        + d * 3 * d
        + (3 * d if c.use_bias else 0)  # qkv
        + d * d
        + (d if c.use_bias else 0)  # attn_out
        + d * mlp_in_out * mlp
        + (mlp_in_out * mlp if c.use_bias else 0)  # mlp_in
        + mlp * d
        + (d if c.use_bias else 0)  # mlp_out
    )
    total = v * d + c.n_layers * per_layer + norm  # token_embed, blocks, final_norm
    if c.positions == "learned":
        total += c.max_len * d
    if not c.tie_embeddings:
        total += d * v  # lm_head, never biased
    return total


def test_param_count_default_formula():
    """Tied, bias-free, RoPE, GELU: V*d + L*(2d + 3d^2 + d^2 + 2*d*mlp) + d."""
    c = TINY
    d, mlp = c.d_model, 4 * c.d_model
    expected = c.vocab_size * d + c.n_layers * (2 * d + d * 3 * d + d * d + 2 * d * mlp) + d
    variables = _abstract_init(c)
    assert _param_count(variables) == expected
    assert _expected_param_count(c) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        {"positions": "learned"},
        {"tie_embeddings": False},
        {"mlp": "swiglu"},
        {"mlp_dim": 24},
        {"use_bias": True},
        {"positions": "learned", "tie_embeddings": False, "mlp": "swiglu", "mlp_dim": 40},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_param_count_variants(overrides):
    """Learned positions add max_len*d, an untied head d*V, swiglu another d*mlp per layer."""
    config = dataclasses.replace(TINY, **overrides)
    variables = _abstract_init(config)
    assert _param_count(variables) == _expected_param_count(config)


def test_param_count_learned_untied_swiglu_explicit():
    """The combined variant spelled out: V*d + T*d + L*(2d + 4d^2 + 3*d*mlp) + d + d*V."""
    c = dataclasses.replace(TINY, positions="learned", tie_embeddings=False, mlp="swiglu")
    d, v, t, mlp = c.d_model, c.vocab_size, c.max_len, 4 * c.d_model
    expected = v * d + t * d + c.n_layers * (2 * d + 4 * d * d + 3 * d * mlp) + d + d * v
    variables = _abstract_init(c)
    assert _param_count(variables) == expected


# ------------------------------------------------------------------------------------------------
# Golden partition specs of the quickstart model


def _quickstart_logical_specs() -> dict[str, list[str | None]]:
    config = hopperjax.load_config(REPO / "configs" / "quickstart.yaml")
    model = hopperjax.build_model(config)  # the config's workload model and precision
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))  # no real init
    specs = nn.get_partition_spec(abstract)
    flat = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return {_path_str(path): list(spec) for path, spec in flat}


def _format_specs(specs: dict[str, list[str | None]]) -> str:
    """JSON with one parameter per line, so that a diff names the parameter that changed."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(specs.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def test_quickstart_partition_specs_match_golden():
    """Logical names of the quickstart params equal tests/golden/quickstart_partition_specs.json.

    After an intended change: ``HOPPERJAX_UPDATE_GOLDEN=1 pytest tests/test_model.py``.
    """
    actual = _quickstart_logical_specs()
    if os.environ.get("HOPPERJAX_UPDATE_GOLDEN"):
        GOLDEN_SPECS.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN_SPECS.write_text(_format_specs(actual))
        pytest.skip(f"rewrote {GOLDEN_SPECS}")
    golden = json.loads(GOLDEN_SPECS.read_text())
    if actual != golden:
        diff = "\n".join(
            difflib.unified_diff(
                _format_specs(golden).splitlines(),
                _format_specs(actual).splitlines(),
                fromfile=f"golden ({GOLDEN_SPECS.name})",
                tofile="current model",
                lineterm="",
            )
        )
        pytest.fail(
            "quickstart partition specs changed (HOPPERJAX_UPDATE_GOLDEN=1 accepts "
            "the current ones):\n" + diff,
            pytrace=False,
        )


# ------------------------------------------------------------------------------------------------
# Layers


def _random_qk(shape=(2, 6, 3, 8), seed=0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_rope_preserves_norms():
    """RoPE rotates: each (position, head) vector keeps its norm (rtol 1e-5), yet does change."""
    x = _random_qk()
    positions = jnp.arange(x.shape[1]) * 7  # includes large angles
    y = layers.rope(x, positions, theta=10000.0)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(
        jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5, atol=0
    )
    assert float(jnp.max(jnp.abs(y[:, 1:] - x[:, 1:]))) > 1e-2


def test_rope_is_identity_at_position_zero():
    """At position 0 every angle is 0, so rope returns its input (atol 1e-7)."""
    x = _random_qk()
    y = layers.rope(x, jnp.zeros((x.shape[1],), jnp.int32), theta=10000.0)
    np.testing.assert_allclose(y, x, atol=1e-7, rtol=0)
    y = layers.rope(x, jnp.arange(x.shape[1]), theta=10000.0)
    np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-7, rtol=0)


def test_rope_dot_products_depend_only_on_relative_position():
    """<rope(q, m), rope(k, n)> depends on m - n only (atol 1e-4)."""
    q, k = _random_qk((1, 1, 1, 8), seed=1), _random_qk((1, 1, 1, 8), seed=2)

    def score(m: int, n: int) -> float:
        qm = layers.rope(q, jnp.array([m]), theta=100.0)
        kn = layers.rope(k, jnp.array([n]), theta=100.0)
        return float(jnp.sum(qm * kn))

    np.testing.assert_allclose(score(5, 2), score(13, 10), atol=1e-4)
    np.testing.assert_allclose(score(0, 3), score(20, 23), atol=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


@pytest.mark.parametrize(
    "features,axes,in_shape,equation",
    [
        ((24,), ("embed", "mlp"), (2, 5, 16), "btd,df->btf"),
        ((3, 2, 8), ("embed", None, "heads", "kv"), (2, 5, 16), "btd,dshk->btshk"),
        ((16,), ("heads", "kv", "embed"), (2, 5, 2, 8), "bthk,hkd->btd"),
    ],
)
@pytest.mark.parametrize("use_bias", [False, True])
def test_dense_matches_einsum(features, axes, in_shape, equation, use_bias):
    """``layers.Dense`` equals ``jnp.einsum`` with its kernel (+ bias) within atol 1e-6."""
    layer = layers.Dense(features=features, kernel_axes=axes, std=0.1, use_bias=use_bias)
    x = jax.random.normal(jax.random.key(3), in_shape, jnp.float32)
    variables = layer.init(jax.random.key(4), x)
    params = nn.meta.unbox(variables)["params"]
    n_in = len(axes) - len(features)
    assert params["kernel"].shape == (*in_shape[-n_in:], *features)
    if use_bias:
        # Zero-initialized; make it non-zero so that the bias path is really compared.
        params["bias"] = jax.random.normal(jax.random.key(5), features)
    y = layer.apply({"params": params}, x)
    expected = jnp.einsum(equation, x, params["kernel"], precision=jax.lax.Precision.HIGHEST)
    if use_bias:
        expected = expected + params["bias"]
    assert y.shape == expected.shape == (*in_shape[:-n_in], *features)
    np.testing.assert_allclose(y, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "features,axes,in_shape",
    [((24,), ("embed", "mlp"), (2, 5, 16)), ((16,), ("heads", "kv", "embed"), (2, 5, 2, 8))],
)
def test_dense_weight_gradient_contracts_one_leading_dim(features, axes, in_shape):
    """Batch and length reach the weight-gradient GEMM as one dim (no 2-dim contraction that
    XLA:CPU would canonicalize with a transposed copy of the output gradient)."""
    layer = layers.Dense(features=features, kernel_axes=axes, std=0.1)
    x = jax.random.normal(jax.random.key(3), in_shape, jnp.float32)
    params = nn.meta.unbox(layer.init(jax.random.key(4), x))["params"]
    kernel_size = params["kernel"].size

    def loss(kernel):
        return jnp.sum(layer.apply({"params": {"kernel": kernel}}, x) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params["kernel"])
    weight_grads = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "dot_general" and e.outvars[0].aval.size == kernel_size
    ]
    assert weight_grads, jaxpr
    for eqn in weight_grads:
        (lhs_contract, rhs_contract), _ = eqn.params["dimension_numbers"]
        assert len(lhs_contract) == len(rhs_contract) == 1, eqn


def test_gelu_exact_matches_jax_erfc_form():
    """``layers.gelu_exact`` (erf, as PyTorch writes it) equals ``jax.nn.gelu(approximate=False)``
    (erfc) within 1e-6 absolute, values and gradients, from the far tails to zero."""
    x = jnp.linspace(-12.0, 12.0, 4001, dtype=jnp.float32)
    np.testing.assert_allclose(
        layers.gelu_exact(x), jax.nn.gelu(x, approximate=False), atol=1e-6, rtol=0
    )
    grad = jax.vmap(jax.grad(layers.gelu_exact))(x)
    reference = jax.vmap(jax.grad(functools.partial(jax.nn.gelu, approximate=False)))(x)
    np.testing.assert_allclose(grad, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_attention_matches_jax_dot_product_attention(causal, with_lengths, dtype):
    """``layers.attention``'s CPU path equals ``jax.nn.dot_product_attention`` on the same inputs
    (outputs and input gradients) within 2e-5 (fp32) or 2e-2 (bf16: one bf16 rounding of the
    probabilities and outputs) relative to the largest entry."""
    keys = jax.random.split(jax.random.key(7), 4)
    q, k, v, probe = (jax.random.normal(key, (3, 16, 2, 8), dtype) for key in keys)
    lengths = jnp.array([16, 9, 1], jnp.int32) if with_lengths else None

    def ours(q, k, v):
        return layers.attention(q, k, v, causal=causal, lengths=lengths)

    def reference(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, key_value_seq_lengths=lengths
        )

    def probed(fn):  # a fixed linear read-out, so every output entry has its own gradient
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * probe)

    assert ours(q, k, v).dtype == dtype
    got = (ours(q, k, v), *jax.grad(probed(ours), argnums=(0, 1, 2))(q, k, v))
    want = (reference(q, k, v), *jax.grad(probed(reference), argnums=(0, 1, 2))(q, k, v))
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernels_agree_on_cpu(causal):
    """The ``attention`` key's two CPU kernels, "auto" (``_attention_cpu``) and "xla" (JAX's
    XLA softmax), give the same outputs within 2e-5 of the largest entry, padding included."""
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (2, 12, 2, 8)) for key in keys)
    lengths = jnp.array([12, 5], jnp.int32)
    auto, xla = (
        layers.attention(q, k, v, causal=causal, lengths=lengths, implementation=kind)
        for kind in ("auto", "xla")
    )
    np.testing.assert_allclose(auto, xla, atol=2e-5 * float(jnp.abs(xla).max()), rtol=0)


class _FakeKernels:
    """Stands in for ``jax.nn.dot_product_attention`` on a pretend GPU: records each call's
    implementation; "cudnn" raises ``refuse`` when set, else answers with XLA's result."""

    def __init__(self, refuse: Exception | None = None):
        self.calls, self.refuse = [], refuse
        self.real = jax.nn.dot_product_attention

    def __call__(self, q, k, v, *, implementation=None, **kwargs):
        self.calls.append(implementation)
        if implementation == "cudnn" and self.refuse is not None:
            raise self.refuse
        return self.real(q, k, v, implementation="xla", **kwargs)


@pytest.fixture
def pretend_gpu(monkeypatch):
    monkeypatch.setattr(layers, "_backend", lambda: "gpu")

    def install(refuse=None):
        fake = _FakeKernels(refuse)
        monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
        return fake

    return install


def test_auto_attention_asks_cudnn_first_on_a_gpu(pretend_gpu):
    fake = pretend_gpu()
    q = jnp.ones((1, 8, 2, 8), jnp.bfloat16)
    out = layers.attention(q, q, q, causal=True, implementation="auto")
    assert fake.calls == ["cudnn"] and out.dtype == jnp.bfloat16


def test_auto_attention_falls_back_to_xla_when_cudnn_refuses(pretend_gpu, caplog):
    fake = pretend_gpu(NotImplementedError("head_dim 7 is not a multiple of 8"))
    q = jnp.ones((1, 8, 2, 7), jnp.bfloat16)
    with caplog.at_level("WARNING", logger=layers.__name__):
        layers.attention(q, q, q, causal=True, implementation="auto")
    assert fake.calls == ["cudnn", "xla"]
    assert "head_dim 7 is not a multiple of 8" in caplog.text


def test_auto_attention_runs_fp32_on_xla_without_asking_cudnn(pretend_gpu, caplog):
    fake = pretend_gpu()
    q = jnp.ones((1, 8, 2, 8), jnp.float32)
    with caplog.at_level("WARNING", logger=layers.__name__):
        layers.attention(q, q, q, causal=False, implementation="auto")
    assert fake.calls == ["xla"] and caplog.text == ""


def test_cudnn_attention_refuses_in_one_line_naming_the_key(pretend_gpu):
    pretend_gpu(NotImplementedError("head_dim should be a multiple of 8"))
    q = jnp.ones((1, 8, 2, 7), jnp.bfloat16)
    with pytest.raises(ConfigError) as info:
        layers.attention(q, q, q, causal=True, implementation="cudnn")
    assert info.value.key == "attention" and "multiple of 8" in str(info.value)
    pretend_gpu(RuntimeError(""))  # an empty message still makes a one-line reason
    with pytest.raises(ConfigError, match=r"RuntimeError: \)"):
        layers.attention(q, q, q, causal=True, implementation="cudnn")


def test_cudnn_attention_is_refused_off_gpu():
    with pytest.raises(ConfigError) as info:
        layers.check_attention("cudnn")
    assert info.value.key == "attention" and "backend is cpu" in str(info.value)
    layers.check_attention("auto")
    layers.check_attention("xla")
