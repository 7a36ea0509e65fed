"""What a workload adds to the generic trainer: its data, batch layout, loss and eval scores.

The trainer (``trainer/``) knows nothing of tokens or affinities. A workload says which fields a
batch has and how each is laid out on the mesh, what the model is called with, which loss it
minimizes, and how per-batch eval outputs become eval metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from hopperjax.config import Config


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch field: its global shape, dtype and logical axis names (for its sharding)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Datasets:
    """Per-process, batched datasets of one run.

    Attributes:
      train: infinite, shuffled each epoch, batches of ``batch_size / process_count`` rows.
      eval: one pass over the held-out split, unshuffled, incomplete last batch dropped.
      vocab_size: token ids the source can emit (language models; 0 where it does not apply).
      info: workload-specific facts the batch layout needs (e.g. distinct drugs per batch).
    """

    train: Any
    eval: Any
    vocab_size: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Workload(Protocol):
    """The workload interface; ``workloads.get_workload(config)`` picks one by ``model.kind``."""

    examples_name: str  # what ``tokens_per_s`` counts: "tokens" or "pairs"

    def build_datasets(
        self, config: Config, *, process_index: int, process_count: int
    ) -> Datasets: ...

    def batch_fields(self, config: Config, batch_size: int, datasets: Datasets) -> dict[str, Field]:
        """Every field of a global batch of ``batch_size`` examples."""
        ...

    def model_inputs(self, batch: dict[str, jax.Array]) -> Sequence[Any]:
        """The model's positional arguments."""
        ...

    def loss(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean loss of one batch (fp32 scalar), the quantity the optimizer minimizes."""
        ...

    def eval_outputs(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """What the eval step returns per batch (sums, or per-example predictions)."""
        ...

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """Eval metrics (``eval_`` prefixed) from every eval batch's outputs."""
        ...

    def examples_per_batch_row(self, config: Config) -> int:
        """Examples one batch row holds (tokens per sequence, or 1)."""
        ...

    def model_flops_per_step(self, config: Config, batch_size: int, datasets: Datasets) -> float:
        """Model FLOPs of one training step over all devices (3 x forward)."""
        ...
