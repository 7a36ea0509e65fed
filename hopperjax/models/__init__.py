"""Model registry: ``model.kind`` -> a Flax module built from config and precision policy."""

from __future__ import annotations

import flax.linen as nn

from hopperjax.config import ModelConfig, RematConfig
from hopperjax.models.gpt import GPT
from hopperjax.precision import Policy

_MODELS = {"gpt": GPT}


def build_model(config: ModelConfig, policy: Policy, remat: RematConfig | None = None) -> nn.Module:
    """Returns the Flax module named by ``config.kind``; ``remat`` wraps each of its blocks."""
    return _MODELS[config.kind](config=config, policy=policy, remat=remat or RematConfig())


__all__ = ["GPT", "build_model"]
