"""Language modeling: byte windows in, next-token cross-entropy out (the GPT workload)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hopperjax.config import Config
from hopperjax.observe import flops
from hopperjax.workloads.base import Datasets, Field


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits: [batch, length, vocab]; targets: [batch, length] -> per-token loss [batch, length].

    Computed in fp32 whatever the compute dtype: log-softmax over a large vocabulary is where
    low precision hurts first.
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


class LanguageModeling:
    examples_name = "tokens"

    def build_datasets(self, config: Config, *, process_index: int, process_count: int) -> Datasets:
        from hopperjax.data.pipeline import build_text_datasets

        return build_text_datasets(config, process_index=process_index, process_count=process_count)

    def batch_fields(self, config: Config, batch_size: int, datasets: Datasets) -> dict[str, Field]:
        tokens = Field((batch_size, config.data.seq_len), jnp.int32, ("batch", "length"))
        return {"inputs": tokens, "targets": tokens}

    def model_inputs(self, batch: dict[str, jax.Array]) -> tuple[Any, ...]:
        return (batch["inputs"],)

    def loss(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        return cross_entropy(outputs, batch["targets"]).mean()

    def eval_outputs(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Sums over the batch, so that means over many batches are exact."""
        loss = cross_entropy(outputs, batch["targets"])
        correct = jnp.argmax(outputs, axis=-1) == batch["targets"]
        return {
            "loss_sum": loss.sum(),
            "correct": correct.sum().astype(jnp.float32),
            "tokens": jnp.asarray(loss.size, jnp.float32),
        }

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        totals = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        loss = totals["loss_sum"] / totals["tokens"]
        return {
            "eval_loss": loss,
            "eval_accuracy": totals["correct"] / totals["tokens"],
            "eval_perplexity": math.exp(min(loss, 50.0)),
        }

    def examples_per_batch_row(self, config: Config) -> int:
        return config.data.seq_len

    def model_flops_per_step(self, config: Config, batch_size: int, datasets: Datasets) -> float:
        return flops.gpt_train_flops_per_step(
            config.model, batch_size=batch_size, seq_len=config.data.seq_len
        )
