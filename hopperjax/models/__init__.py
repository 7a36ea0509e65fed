"""Model registry: ``model.kind`` -> a Flax module built from config and precision policy."""

from __future__ import annotations

import flax.linen as nn

from hopperjax.config import DtaConfig, ModelConfig, RematConfig
from hopperjax.models.dta import DTA
from hopperjax.models.gpt import GPT
from hopperjax.precision import Policy


def build_model(
    config: ModelConfig,
    policy: Policy,
    remat: RematConfig | None = None,
    *,
    dta: DtaConfig | None = None,
) -> nn.Module:
    """Returns the Flax module named by ``config.kind``; ``remat`` wraps each of its blocks.

    ``dta``: the ``dta`` config group, for ``kind: dta``.
    """
    remat = remat or RematConfig()
    if config.kind == "dta":
        from hopperjax.data.molecules import PROTEIN_CHARSET, SMILES_CHARSET

        return DTA(
            config=config,
            dta=dta or DtaConfig(),
            policy=policy,
            remat=remat,
            drug_vocab=len(SMILES_CHARSET) + 2,  # + padding and unknown (Tokenizer.vocab_size)
            protein_vocab=len(PROTEIN_CHARSET) + 2,
        )
    return GPT(config=config, policy=policy, remat=remat)


__all__ = ["DTA", "GPT", "build_model"]
