"""Dtype policies: parameters and optimizer state stay fp32 (master weights); compute runs in the
policy's dtype.

Numerically sensitive pieces run in fp32 whatever the policy: norm statistics, the softmax in
attention, logits and the loss, and the gradient reduction and optimizer update (gradients of
fp32 master weights are fp32). Matmuls accumulate in fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from hopperjax.config import Config


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype each kind of tensor uses.

    Attributes:
      name: the ``precision`` config value.
      param_dtype: storage dtype of parameters and optimizer state.
      compute_dtype: dtype of matmul inputs and activations.
      output_dtype: dtype of logits and the loss.
      matmul_precision: ``jax.default_matmul_precision`` while tracing: "highest" keeps fp32
        matmuls in fp32 on GPUs (no TF32), "tensorfloat32" allows TF32, "default" for 16-bit.
      fp8_layers: Dense layer names whose matmuls run in FP8 (empty unless ``fp8``).
      fp8_backend: "xla" (Flax fp8 ops) or "te" (Transformer Engine).
      amax_history_length: delayed-scaling window of the FP8 scales.
      loss_scaling: whether the step scales the loss (dynamic loss scaling).
      attention: the ``attention`` config value: which softmax-attention kernel the models'
        ``layers.attention`` calls ("auto", "xla" or "cudnn").
      int8: the INT8 inference scheme of every Dense layer (``precision/int8.py``; "none" in
        training; set by ``infer/quantize.py``).
      int8_percentile: with ``int8="calibrate"``, the percentile of a batch's input magnitudes
        each Dense layer records (100: the largest).
    """

    name: str
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32
    matmul_precision: str = "highest"
    fp8_layers: tuple[str, ...] = ()
    fp8_backend: str = "xla"
    amax_history_length: int = 1024
    loss_scaling: bool = False
    attention: str = "auto"
    int8: str = "none"
    int8_percentile: float = 100.0

    def uses_fp8(self, layer_name: str) -> bool:
        return layer_name in self.fp8_layers


_BASE = {
    "fp32": dict(compute_dtype=jnp.float32, matmul_precision="highest"),
    "tf32": dict(compute_dtype=jnp.float32, matmul_precision="tensorfloat32"),
    "bf16": dict(compute_dtype=jnp.bfloat16, matmul_precision="default"),
    "fp16": dict(compute_dtype=jnp.float16, matmul_precision="default"),
    "fp8": dict(compute_dtype=jnp.bfloat16, matmul_precision="default"),
}
# Peak-FLOP/s row of each policy's matmuls (observe/flops.py).
PEAK_DTYPE = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}


def get_policy(name: str, **overrides) -> Policy:
    """The policy for a ``precision`` value with its defaults (``fp8``: FP8 on the layers named
    by the ``fp8_layers`` override; none by default)."""
    fields = dict(_BASE[name])
    fields["loss_scaling"] = name == "fp16"
    fields.update(overrides)
    return Policy(name=name, **fields)


def policy_from_config(config: Config, *, default_fp8_layers: Sequence[str] = ()) -> Policy:
    """The policy a run uses: ``precision`` plus the ``fp8.*`` and ``loss_scale.*`` keys.

    ``default_fp8_layers``: the layers FP8 runs in when ``fp8.layers`` is null (the workload's
    ``default_fp8_layers``).
    """
    overrides = {}
    if config.precision == "fp8":
        named = config.fp8.layer_names
        overrides["fp8_layers"] = tuple(default_fp8_layers if named is None else named)
        overrides["fp8_backend"] = config.fp8.backend
        overrides["amax_history_length"] = config.fp8.amax_history_length
    if config.loss_scale.enabled is not None:
        overrides["loss_scaling"] = config.loss_scale.enabled
    overrides["attention"] = config.attention
    return get_policy(config.precision, **overrides)
