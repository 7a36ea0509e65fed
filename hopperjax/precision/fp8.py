"""FP8 matmuls with delayed scaling, behind one factory: ``fp8_dot_general_cls(policy)``.

Backends (``fp8.backend``):
- ``xla`` (default, runs everywhere): Flax's ``Fp8DirectDotGeneralOp``. Inputs and kernels are
  quantized to e4m3 and output gradients to e5m2 with per-tensor scales computed from an amax
  history. On Hopper, XLA turns the quantize -> dot -> dequantize pattern into cuBLASLt FP8 GEMMs
  when every dimension is a multiple of 16. The scales and amax histories are Flax variables in
  the ``_overwrite_with_gradient`` collection: the step differentiates through them and replaces
  them with their "gradients" (the updated values), never hands them to the optimizer.
- ``te``: Transformer Engine's quantized dot (``make_dot_general_cls`` with a ``DelayedScaling``
  recipe) where ``transformer_engine.jax`` imports (a CUDA GPU is needed at import time).
  Known compromise: TE cannot be installed on our development or GPU-check machines, so this
  path is not exercised by our tests; they skip it with the import error as the reason.

Margin: Flax's delayed scaling uses margin 0 (its update does not take one); TE's recipe does.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from flax.linen import fp8_ops

from hopperjax.config import ConfigError
from hopperjax.precision.policy import Policy

# Variable collection holding FP8 scales and amax histories (Flax's name for it).
FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
TE_INSTALL_HINT = (
    "fp8.backend=te needs Transformer Engine: pip install 'transformer-engine[jax]' on a machine "
    "with a CUDA GPU, or use fp8.backend=xla"
)


def transformer_engine_error() -> str | None:
    """Why Transformer Engine cannot be used here, or None if it can."""
    try:
        importlib.import_module("transformer_engine.jax.flax")
    except Exception as e:  # ImportError, or TE's own CUDA/driver check failing at import.
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def check_backend(policy: Policy) -> None:
    """Raises ConfigError (exit code 2 from the CLI) if the FP8 backend cannot run here."""
    if policy.fp8_layers and policy.fp8_backend == "te":
        reason = transformer_engine_error()
        if reason is not None:
            raise ConfigError("fp8.backend", f"{TE_INSTALL_HINT} ({reason})")


@functools.cache
def fp8_dot_general_cls(policy: Policy) -> Any:
    """A Flax module class to use as a Dense layer's ``dot_general`` for FP8 layers."""
    if policy.fp8_backend == "te":
        te_flax = importlib.import_module("transformer_engine.jax.flax")
        recipe = importlib.import_module("transformer_engine.common.recipe")
        return te_flax.make_dot_general_cls(
            recipe.DelayedScaling(
                amax_history_len=policy.amax_history_length, fp8_format=recipe.Format.HYBRID
            )
        )

    class Fp8Dot(fp8_ops.Fp8DirectDotGeneralOp):
        amax_history_length: int = policy.amax_history_length

    return Fp8Dot
