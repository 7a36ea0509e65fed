"""INT8 inference matmuls: post-training quantization behind the Dense layer factory.

Schemes (``Policy.int8``; ``infer/quantize.py`` converts a trained model's variables):
- ``weight``: int8 kernels with one scale per output channel (symmetric, absmax / 127); the dot
  runs in the compute dtype on the dequantized kernel, the scale applied to its output. A
  quarter of fp32's kernel bytes; activations untouched.
- ``w8a8``: the same kernels, and each row of the input (a token, an example) quantized on the
  fly with its own scale (dynamic per-token); the dot is int8 x int8 accumulated in int32, then
  rescaled by both scales.
- ``w8a8_static``: the input quantized with one calibrated scale per layer (``input_scale``:
  the largest input magnitude seen over calibration batches / 127), no per-call reduction.
- ``calibrate``: a float model that records each layer's input magnitude in the
  ``INT8_CALIBRATION`` collection (the statistic ``w8a8_static`` needs): the largest over the
  calibration batches of each batch's ``percentile`` of ``|x|`` (100: its largest value; a
  lower one lets a few outliers saturate instead of coarsening every other value).

Scales keep the kernel's rank (1 in the contracted dimensions, ``[..., 1, out]``), so a kernel
stacked over scanned layers ``[layers, in, out]`` has a scale ``[layers, 1, out]`` and the
conversion needs no knowledge of which dimensions are layers.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Scheme = Literal["none", "calibrate", "weight", "w8a8", "w8a8_static"]
SCHEMES: tuple[str, ...] = ("weight", "w8a8", "w8a8_static")
INT8_CALIBRATION = "int8_calibration"
KERNEL_SCALE = "kernel_scale"
INPUT_SCALE = "input_scale"
INPUT_AMAX = "input_amax"
QMAX = 127.0


def _scale(amax: jax.Array) -> jax.Array:
    """Symmetric scale of an absmax: amax / 127 (1 where amax is 0, so zeros stay zeros)."""
    return jnp.where(amax > 0, amax / QMAX, 1.0).astype(jnp.float32)


def magnitude(x: jax.Array, percentile: float = 100.0) -> jax.Array:
    """The ``percentile`` of ``|x|`` (100: its largest value), as a float32 scalar."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.max(a) if percentile >= 100.0 else jnp.percentile(a, percentile)


def quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``round(x / scale)`` clipped to [-127, 127], as int8 (symmetric: -128 unused)."""
    return jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -QMAX, QMAX).astype(jnp.int8)


def quantize_kernel(kernel: jax.Array, contracted: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(int8 kernel, float32 scale) with one scale per output channel: the absmax over the
    ``contracted`` dimensions, which the scale keeps as size 1."""
    scale = _scale(jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=contracted, keepdims=True))
    return quantize(kernel, scale), scale


def contracted_dims(scale_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The kernel dimensions a scale of this shape was reduced over (its size-1 dimensions)."""
    return tuple(i for i, n in enumerate(scale_shape) if n == 1)


def int8_dot(
    x: jax.Array,
    kernel: jax.Array,
    kernel_scale: jax.Array,
    n_in: int,
    scheme: str,
    dtype: jnp.dtype,
    input_scale: jax.Array | None = None,
) -> jax.Array:
    """``x`` [rows, *in] . int8 ``kernel`` [*in, *out] -> [rows, *out] in ``dtype``.

    ``kernel_scale``: [*1 per in dim, *out]. ``input_scale``: the calibrated scalar of
    ``w8a8_static``."""
    out_scale = kernel_scale.reshape(kernel.shape[n_in:]).astype(jnp.float32)
    dims = ((tuple(range(1, 1 + n_in)), tuple(range(n_in))), ((), ()))
    if scheme == "weight":
        y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), dims)
        return (y.astype(jnp.float32) * out_scale).astype(dtype)
    in_axes = tuple(range(1, 1 + n_in))
    if scheme == "w8a8":
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=in_axes, keepdims=True)
        row_scale = _scale(amax)
    elif scheme == "w8a8_static":
        if input_scale is None:
            raise ValueError("w8a8_static needs the calibrated input_scale")
        row_scale = input_scale.astype(jnp.float32)
    else:
        raise ValueError(f"unknown INT8 scheme {scheme!r}")
    xq = quantize(x, row_scale)
    acc = jax.lax.dot_general(xq, kernel, dims, preferred_element_type=jnp.int32)
    row_scale = jnp.reshape(row_scale, (-1,) + (1,) * (acc.ndim - 1))
    return (acc.astype(jnp.float32) * row_scale * out_scale).astype(dtype)
