"""Post-training INT8 quantization of a restored model, for every workload.

``quantize_restored(restored, scheme, calibration)`` rebuilds the run's model with every Dense
layer in an INT8 scheme (``precision/int8.py``: ``weight``, ``w8a8``, ``w8a8_static``) and
converts the trained variables to it: each Dense and convolution kernel becomes an int8 kernel
and its per-output-channel scale (convolutions then run weight-only: ``layers.Int8Conv``);
everything else (embeddings, norms, biases, BatchNorm statistics) is kept as it was.
``w8a8_static`` first runs the float model over the calibration batches (the workload's own
preprocessing and model inputs, as evaluation does, under the run's matmul precision) to record
each layer's largest input magnitude. The result predicts through the workload's ``predict``
like the original.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hopperjax.config import ConfigError
from hopperjax.infer.restore import Restored, abstract_variables
from hopperjax.precision import int8 as int8_ops
from hopperjax.precision import policy_from_config

# The statistic w8a8_static calibrates to: each batch's 99.99th percentile of |x| (max over the
# batches). Against the largest value (100), on the Multi30k T5: BLEU -0.44 % instead of -2.37 %
# of the float model's (docs/inference.md).
DEFAULT_PERCENTILE = 99.99


def _policy(restored: Restored, scheme: str, percentile: float = 100.0) -> Any:
    config, workload = restored.config, restored.workload
    policy = policy_from_config(config, default_fp8_layers=workload.default_fp8_layers)
    # FP8-trained layers are served from their float kernels: INT8 replaces FP8 at inference.
    return dataclasses.replace(policy, int8=scheme, int8_percentile=percentile, fp8_layers=())


def calibrate(
    restored: Restored, batches: Iterable[Mapping[str, Any]], percentile: float = DEFAULT_PERCENTILE
) -> dict[str, Any]:
    """The ``INT8_CALIBRATION`` collection: each Dense layer's input magnitude over ``batches``
    (host batches of the workload's fields): the largest of each batch's ``percentile`` of
    ``|x|``.

    Raises:
      ConfigError: no batch (``--calibration-batches``)."""
    if not 0.0 < percentile <= 100.0:
        raise ConfigError("--calibration-percentile", f"expected 0 < p <= 100, got {percentile}")
    policy = _policy(restored, "calibrate", percentile)
    model = restored.workload.build_model(policy, restored.config.remat)
    workload = restored.workload
    variables = {k: v for k, v in restored.variables.items() if k != int8_ops.INT8_CALIBRATION}

    @jax.jit
    def observe(variables: dict[str, Any], batch: Any) -> dict[str, Any]:
        inputs = workload.model_inputs(workload.preprocess(batch, jax.random.key(0), train=False))
        _, updates = model.apply(
            variables, *inputs, deterministic=True, mutable=[int8_ops.INT8_CALIBRATION]
        )
        # A model without Dense layers (all convolutions) records nothing.
        return updates.get(int8_ops.INT8_CALIBRATION, {})

    amax, seen = {}, 0
    precision = _policy(restored, "none").matmul_precision
    with jax.default_matmul_precision(precision):
        for batch in batches:
            amax = observe({**variables, **({int8_ops.INT8_CALIBRATION: amax} if amax else {})},
                           batch)  # fmt: skip
            seen += 1
    if not seen:
        raise ConfigError("--calibration-batches", "no calibration batch was read")
    return amax


def _convert(abstract: Any, source: Any, amax: Any, path: tuple[str, ...]) -> Any:
    if not isinstance(abstract, Mapping):
        return jnp.asarray(source, abstract.dtype)
    out = {}
    for key, node in abstract.items():
        where = (*path, key)
        if key == "kernel" and not isinstance(node, Mapping) and node.dtype == jnp.int8:
            scale_shape = abstract[int8_ops.KERNEL_SCALE].shape
            q, scale = int8_ops.quantize_kernel(
                jnp.asarray(source[key]), int8_ops.contracted_dims(scale_shape)
            )
            if scale.shape != scale_shape:
                raise ValueError(f"{'/'.join(where)}: scale {scale.shape} != {scale_shape}")
            out[key], out[int8_ops.KERNEL_SCALE] = q, scale
        elif key == int8_ops.KERNEL_SCALE:
            continue  # made with its kernel
        elif key == int8_ops.INPUT_SCALE:
            if amax is None:
                raise ValueError(f"{'/'.join(where)}: w8a8_static needs calibration")
            seen = amax[int8_ops.INPUT_AMAX]
            out[key] = jnp.where(seen > 0, seen / int8_ops.QMAX, 1.0).astype(jnp.float32)
        else:
            sub = amax.get(key) if isinstance(amax, Mapping) else None
            out[key] = _convert(node, source[key], sub, where)
    return out


def quantize_restored(
    restored: Restored,
    scheme: str,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    *,
    percentile: float = DEFAULT_PERCENTILE,
) -> Restored:
    """``restored`` with its Dense layers in INT8 ``scheme`` and its variables converted.

    Raises:
      ConfigError: an unknown scheme (``--quantize``), or ``w8a8_static`` without calibration
        batches (``--calibration-batches``)."""
    if scheme not in int8_ops.SCHEMES:
        raise ConfigError("--quantize", f"expected one of {', '.join(int8_ops.SCHEMES)}")
    amax = None
    if scheme == "w8a8_static":
        if calibration is None:
            raise ConfigError("--calibration-batches", "w8a8_static needs calibration batches")
        amax = calibrate(restored, calibration, percentile)
    model = restored.workload.build_model(_policy(restored, scheme), restored.config.remat)
    abstract = nn.meta.unbox(abstract_variables(model, restored.workload, restored.config))
    variables = {}
    for collection, tree in abstract.items():
        if collection == int8_ops.INT8_CALIBRATION:
            continue
        variables[collection] = _convert(
            tree, restored.variables[collection], amax if collection == "params" else None, ()
        )
    return dataclasses.replace(restored, model=model, variables=variables)


def weight_bytes(variables: Mapping[str, Any]) -> int:
    """Bytes of the ``params`` collection (kernels, scales, embeddings, norms, biases)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(variables["params"]))
