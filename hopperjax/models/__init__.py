"""Flax models: layer factories (``layers``), the shared transformer blocks (``transformer``) and
one module per model family, each with its config dataclass and its analytic FLOPs. A workload
(``hopperjax/workloads/``) picks and builds its model; nothing here reads data."""

from hopperjax.models.dta import DTA, DTAConfig
from hopperjax.models.gpt import GPT, GPTConfig
from hopperjax.models.transformer import StackConfig

__all__ = ["DTA", "GPT", "DTAConfig", "GPTConfig", "StackConfig"]
