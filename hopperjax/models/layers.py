"""Layer factories that honour the precision policy and name every parameter's logical axes.

Model code asks these factories for Dense / Embed / norm / attention and never picks a dtype or a
mesh axis itself: precision and parallelism stay one config key each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax.config import ConfigError
from hopperjax.precision import Policy
from hopperjax.precision import int8 as int8_ops
from hopperjax.precision.fp8 import fp8_dot_general_cls

_log = logging.getLogger(__name__)

Axes = tuple[str | None, ...]


def normal_init(std: float, axes: Axes) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), axes)


class Dense(nn.Module):
    """y = x . W (+ b) contracting the trailing ``len(in_axes)`` dims of x into ``features`` dims.

    Written here rather than using ``nn.DenseGeneral`` because that one initializes a flattened
    2-D kernel and reshapes it, which breaks logical-axis metadata on kernels of rank > 2. It is
    also the one place the precision policy's FP8 dot (``fp8_dot``, a Flax module class) plugs in.

    Attributes:
      features: output feature shape, e.g. ``(3, heads, head_dim)``.
      kernel_axes: logical names of every kernel dim (contracted input dims first).
      std: stddev of the normal kernel init.
      kernel_init: another kernel initializer (without logical axes; ``kernel_axes`` are
        added), or None for the normal one.
      use_bias: add a bias over the output features.
      dtype: compute dtype (inputs and kernel cast to it); param_dtype: storage dtype.
      fp8_dot: a module class computing the dot in FP8 (``precision/fp8.py``); None: plain dot.
      int8: an INT8 inference scheme (``precision/int8.py``): ``weight``, ``w8a8`` or
        ``w8a8_static`` hold an int8 ``kernel`` and its per-output-channel ``kernel_scale``
        (and ``input_scale``) instead of a float kernel; ``calibrate`` records the input
        magnitude (``int8_percentile`` of ``|x|``, 100: the largest); ``none``: a float layer.
    """

    features: tuple[int, ...]
    kernel_axes: Axes
    std: float
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    fp8_dot: Any = None
    int8: str = "none"
    int8_percentile: float = 100.0
    kernel_init: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.kernel_axes) - len(self.features)
        in_shape = x.shape[-n_in:]
        if self.int8 in int8_ops.SCHEMES:
            return self._int8(x, n_in)
        init = (
            normal_init(self.std, self.kernel_axes)
            if self.kernel_init is None
            else nn.with_logical_partitioning(self.kernel_init, self.kernel_axes)
        )
        kernel = self.param("kernel", init, (*in_shape, *self.features), self.param_dtype)
        # The leading (batch, length, ...) dims travel as one: the weight gradient then contracts
        # a single dim. Contracting two (batch and length) makes XLA:CPU canonicalize the dot
        # with a transposed copy of the output gradient, which cost the nanoGPT recipe ~20 % of
        # its step (docs/results.md); on GPUs the reshapes are free bitcasts either way.
        lead = x.shape[:-n_in]
        x = x.reshape(-1, *in_shape)
        if self.int8 == "calibrate":
            amax = self.variable(
                int8_ops.INT8_CALIBRATION, int8_ops.INPUT_AMAX, jnp.zeros, (), jnp.float32
            )
            amax.value = jnp.maximum(amax.value, int8_ops.magnitude(x, self.int8_percentile))
        dims = ((tuple(range(1, 1 + n_in)), tuple(range(n_in))), ((), ()))
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if self.fp8_dot is not None:
            y = self.fp8_dot(name="fp8")(x, kernel, dims)
        else:
            # Operands and result in the compute dtype; 16-bit GEMMs accumulate in fp32 inside
            # cuBLAS (and XLA:CPU upcasts them). Asking for an fp32 result instead would make JAX's
            # transpose rule run the two backward GEMMs with fp32 operands, off the Tensor Cores.
            y = jax.lax.dot_general(x, kernel, dims)
        return self._bias(y.reshape(*lead, *self.features), n_in)

    def _bias(self, y: jax.Array, n_in: int) -> jax.Array:
        if not self.use_bias:
            return y
        bias_init = nn.with_logical_partitioning(
            nn.initializers.zeros_init(), self.kernel_axes[n_in:]
        )
        bias = self.param("bias", bias_init, self.features, self.param_dtype)
        return y + bias.astype(self.dtype)

    def _int8(self, x: jax.Array, n_in: int) -> jax.Array:
        """The layer with an int8 kernel (``infer/quantize.py`` fills its variables)."""
        in_shape = x.shape[-n_in:]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), self.kernel_axes),
            (*in_shape, *self.features),
            jnp.int8,
        )
        scale_axes = (None,) * n_in + tuple(self.kernel_axes[n_in:])
        kernel_scale = self.param(
            int8_ops.KERNEL_SCALE,
            nn.with_logical_partitioning(nn.initializers.ones_init(), scale_axes),
            (*[1] * n_in, *self.features),
            jnp.float32,
        )
        input_scale = None
        if self.int8 == "w8a8_static":
            input_scale = self.param(
                int8_ops.INPUT_SCALE,
                nn.with_logical_partitioning(nn.initializers.ones_init(), ()),
                (),
                jnp.float32,
            )
        lead = x.shape[:-n_in]
        y = int8_ops.int8_dot(x.reshape(-1, *in_shape), kernel, kernel_scale, n_in, self.int8,
                          self.dtype, input_scale)  # fmt: skip
        return self._bias(y.reshape(*lead, *self.features), n_in)


def dense(
    features: int | Sequence[int],
    *,
    axes: Axes,
    policy: Policy,
    std: float,
    use_bias: bool,
    name: str,
    kernel_init: Any = None,
) -> Dense:
    """A Dense layer in the policy's dtypes whose kernel carries logical ``axes``.

    Args:
      features: output feature shape; the input dims contracted are the trailing
        ``len(axes) - len(features)`` dims of the input.
      axes: logical names for every kernel dimension (inputs first, then outputs).
    """
    features = (features,) if isinstance(features, int) else tuple(features)
    return Dense(
        features=features,
        kernel_axes=axes,
        std=std,
        use_bias=use_bias,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        fp8_dot=fp8_dot_general_cls(policy) if policy.uses_fp8(name) else None,
        int8=policy.int8,
        int8_percentile=policy.int8_percentile,
        kernel_init=kernel_init,
        name=name,
    )


class Int8Conv(nn.Module):
    """``nn.Conv`` with an int8 kernel and one scale per output channel (the INT8 schemes of
    ``precision/int8.py`` for convolutions). The kernel is dequantized to the compute dtype and
    the convolution runs in it: weight-only whatever the scheme, because XLA's GPU backend does
    not promise integer convolutions (cuDNN's int8 kernels need layouts XLA does not pick for
    us), so activations are never quantized here. ``settings``: the float layer's ``nn.Conv``
    arguments, as (name, value) pairs."""

    settings: tuple[tuple[str, Any], ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layer = nn.Conv(**dict(self.settings), parent=None)
        size = tuple(layer.kernel_size)
        shape = (*size, x.shape[-1] // layer.feature_group_count, layer.features)
        kernel = self.param("kernel", nn.initializers.zeros_init(), shape, jnp.int8)
        scale_shape = (*[1] * (len(shape) - 1), layer.features)
        scale = self.param(
            int8_ops.KERNEL_SCALE, nn.initializers.ones_init(), scale_shape, jnp.float32
        )
        params = {"kernel": (kernel.astype(jnp.float32) * scale).astype(layer.param_dtype)}
        if layer.use_bias:
            bias_shape = (layer.features,)
            params["bias"] = self.param(
                "bias", nn.initializers.zeros_init(), bias_shape, layer.param_dtype
            )
        return layer.apply({"params": params}, x)


def conv(
    policy: Policy, features: int, kernel_size: Sequence[int], *, name: str, **settings: Any
) -> nn.Module:
    """An ``nn.Conv`` in the policy's dtypes (``settings``: its other arguments), or its
    ``Int8Conv`` when the policy runs an INT8 scheme."""
    settings = dict(features=features, kernel_size=tuple(kernel_size), dtype=policy.compute_dtype,
                    param_dtype=policy.param_dtype, **settings)  # fmt: skip
    if policy.int8 in int8_ops.SCHEMES:
        settings.pop("kernel_init", None)  # the kernel comes from the float model's
        return Int8Conv(tuple(settings.items()), name=name)
    return nn.Conv(**settings, name=name)


def embed(
    num: int, features: int, *, axes: Axes, policy: Policy, std: float, name: str
) -> nn.Embed:
    return nn.Embed(
        num_embeddings=num,
        features=features,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        embedding_init=normal_init(std, axes),
        name=name,
    )


def layer_norm(*, policy: Policy, eps: float, use_bias: bool, name: str) -> nn.LayerNorm:
    """LayerNorm in fp32 (its statistics lose too much in bf16); callers cast the output."""
    del policy  # Statistics are always fp32; the caller casts the output.
    return nn.LayerNorm(
        epsilon=eps,
        use_bias=use_bias,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        name=name,
    )


def rms_norm(*, eps: float, name: str) -> nn.RMSNorm:
    """RMSNorm (T5's: scale only, no mean subtraction) in fp32; callers cast the output."""
    return nn.RMSNorm(
        epsilon=eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        name=name,
    )


def gelu_exact(x: jax.Array) -> jax.Array:
    """Exact GELU, x Phi(x), written with erf as PyTorch does.

    ``jax.nn.gelu(approximate=False)`` uses erfc, which XLA expands into an exp and two rational
    approximations; erf is one. They differ by under 1e-6 absolute (tested): erfc's extra care
    is for the far left tail, where GELU is ~0 anyway.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
    """Pins an activation's layout by logical names (resolved by the rules in scope)."""
    return nn.with_logical_constraint(x, axes)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form).

    Args:
      x: [batch, length, heads, head_dim]
      positions: [length], or [batch, length] (packed rows: each example counts from 0)
    Returns:
      x rotated, same shape and dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (hd/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # ([B,] T, hd/2)
    if angles.ndim == 2:
        angles = angles[None]
    sin = jnp.sin(angles)[:, :, None, :]  # (B or 1, T, 1, hd/2)
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def _backend() -> str:
    return jax.default_backend()


def check_attention(implementation: str) -> None:
    """Raises ConfigError (exit 2) when ``attention: cudnn`` is asked of a backend without cuDNN."""
    backend = _backend()
    if implementation == "cudnn" and backend not in _CUDNN_BACKENDS:
        raise ConfigError(
            "attention", f"cudnn needs an NVIDIA GPU; this run's backend is {backend} (use auto)"
        )


_CUDNN_BACKENDS = ("gpu", "cuda")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    lengths: jax.Array | None = None,
    mask: jax.Array | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """Softmax attention through the kernel ``implementation`` names (the ``attention`` key).

    "auto": on a GPU, cuDNN's fused flash attention (``jax.nn.dot_product_attention(...,
    implementation="cudnn")``: no [T, S] score matrix in memory, masks applied in the kernel)
    whenever cuDNN takes the call (bf16/fp16 and head sizes it supports), else XLA's softmax;
    on CPU ``_attention_cpu``. JAX's own default (implementation=None) is XLA's softmax, which
    keeps every layer's [T, S] scores for the backward (gpt_medium at batch 16 on an H200: 67 GiB
    of step temporaries). "xla": XLA's softmax everywhere. "cudnn": cuDNN, or a ConfigError
    saying why not. The fallback covers what cuDNN refuses while the call is traced (dtype, head
    size, no cuDNN); what fails only when the step is compiled (a mesh that shards the sequence
    or head dim, a cuDNN graph it cannot build) stops the run: use "xla" there.

    Args:
      q, k, v: [batch, length, heads, head_dim]
      causal: each position attends only to itself and earlier ones.
      lengths: [batch] int32 valid positions per row; keys at or past it are masked (padding).
      mask: [batch, 1, length, key_length] bool, true where a query may see a key (packed rows:
        the same example); combined with ``causal`` and ``lengths``. A query that sees no key
        (padding) gets a uniform average, which its masked loss ignores.
      implementation: "auto", "xla" or "cudnn".
    Returns:
      [batch, length, heads, head_dim]
    """
    backend = _backend()
    if implementation == "auto" and backend == "cpu":
        return _attention_cpu(q, k, v, causal=causal, lengths=lengths, mask=mask)
    check_attention(implementation)
    if implementation == "cudnn" or (implementation == "auto" and backend in _CUDNN_BACKENDS):
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            reason = f"cuDNN flash attention takes bf16/fp16, not {q.dtype}"
        else:
            reason = None
            try:
                with jax.named_scope("attention"):
                    out = jax.nn.dot_product_attention(
                        q,
                        k,
                        v,
                        mask=mask,
                        is_causal=causal,
                        key_value_seq_lengths=lengths,
                        implementation="cudnn",
                    )
                return out.astype(q.dtype)
            except (ValueError, NotImplementedError, RuntimeError) as err:
                reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if implementation == "cudnn":
            raise ConfigError("attention", f"cudnn cannot run this attention ({reason})")
        if q.dtype in (jnp.bfloat16, jnp.float16):  # fp32/tf32 runs expect XLA: no warning
            _log.warning("attention: auto runs XLA's softmax here, cuDNN refused: %s", reason)
    with jax.named_scope("attention"):
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, key_value_seq_lengths=lengths,
            implementation="xla",
        )  # fmt: skip
    return out.astype(q.dtype)


def _attention_cpu(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, lengths: jax.Array | None,
    mask: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """The same softmax attention, written for XLA:CPU.

    Faster than ``jax.nn.dot_product_attention``'s XLA path there (its masks are built and
    selected at run time; here the causal mask is a constant): ``tools/attention_bench.py``
    measures 1.5-1.8 vs 2.5-3.1 ms forward+backward at 12 x 64 x 4 x 32. Same dtypes as that
    path: scores and softmax in fp32, probabilities cast to the value dtype for the second GEMM.
    fp16 runs in fp32: JAX's fp16 attention asks XLA:CPU for an F16_F16_F32 dot algorithm it
    rejects at compile time (a known compromise on CPU only).
    """
    dtype = q.dtype
    if dtype == jnp.float16:
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    with jax.named_scope("attention"):
        # bf16: the BF16_BF16_F32 algorithm keeps the scores' backward GEMMs on bf16 operands.
        bf16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
        logits = jnp.einsum(
            "btnh,bsnh->bnts", q, k, precision=bf16, preferred_element_type=jnp.float32
        )
        logits = logits * (q.shape[-1] ** -0.5)
        keep = None
        if causal:
            t, s = logits.shape[-2:]
            keep = np.tril(np.ones((t, s), dtype=bool))  # as jax.nn.dot_product_attention
        if lengths is not None:
            valid = jnp.arange(logits.shape[-1]) < lengths[:, None]  # (B, S)
            valid = valid[:, None, None, :]
            keep = valid if keep is None else keep & valid
        if mask is not None:
            keep = mask if keep is None else keep & mask
        if keep is not None:
            logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min / 2)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnts,bsnh->btnh", probs, v)
    return out.astype(dtype)
