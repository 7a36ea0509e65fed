"""Dtype policies: parameters stay fp32 (master weights); compute runs in the policy's dtype.

Numerically sensitive pieces (norm statistics, softmax in attention, logits and the loss) run in
fp32 whatever the policy, because their reductions lose too much in 8 mantissa bits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype each kind of tensor uses.

    Attributes:
      name: the config value that chose this policy.
      param_dtype: storage dtype of parameters and optimizer state.
      compute_dtype: dtype of matmul inputs and activations.
      output_dtype: dtype of logits and the loss.
    """

    name: str
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32


_POLICIES = {
    "fp32": Policy("fp32"),
    "bf16": Policy("bf16", compute_dtype=jnp.bfloat16),
}


def get_policy(name: str) -> Policy:
    """Returns the policy for a ``precision`` config value (validated by the config schema)."""
    return _POLICIES[name]
