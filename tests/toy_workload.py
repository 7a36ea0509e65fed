"""A workload defined outside hopperjax, as a user's package would define one: regression on
synthetic vectors, with every optional hook of the contract doing something a test can see.

- ``mutable``: the model counts the examples it trained on (``counters/seen``) and records the
  preprocessing draw it was given (``counters/draw``); eval reads the count through ``predict``.
- ``preprocess``: doubles ``x`` on the device and, in training, adds one uniform draw of its own
  key to every row (``draw``), so a test can recompute the draw from the step's key.
- ``axis_rules``: the table's rows carry the logical axis ``toy_rows``, placed on ``tensor``.
- ``param_labels`` / ``group_optimizers``: the ``offset`` vector is frozen (``set_to_zero``).
- ``write_artifacts``: ``toy.json`` with the split sizes.

``register`` makes it ``workload: toy`` once this module is imported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hopperjax import config as config_lib
from hopperjax import workloads
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import Datasets, ProcessShard
from hopperjax.models import layers
from hopperjax.precision import Policy
from hopperjax.workloads.base import Field, Workload, path_labels

ARTIFACT = "toy.json"


@dataclasses.dataclass(frozen=True)
class ToyModel(config_lib.ModelConfig):
    features: int = 8
    hidden: int = 16
    table_rows: int = 16


@dataclasses.dataclass(frozen=True)
class ToyData(config_lib.DataConfig):
    examples: int = 512
    eval_examples: int = 64


@dataclasses.dataclass(frozen=True)
class ToyMeta:
    train_examples: int
    eval_examples: int


class ToyNet(nn.Module):
    config: ToyModel
    policy: Policy

    @nn.compact
    def __call__(self, x, ids, draw, *, deterministic: bool = True):
        """x: [B, features] float32, ids: [B] int32, draw: [B] -> (prediction [B], seen [])."""
        cfg = self.config
        h = layers.dense(
            cfg.hidden, axes=("embed", "mlp"), policy=self.policy, std=0.3, use_bias=False,
            name="inp",
        )(x)  # fmt: skip
        table = self.param(
            "table", layers.normal_init(0.1, ("toy_rows", "mlp")), (cfg.table_rows, cfg.hidden)
        )
        offset = self.param("offset", nn.initializers.ones_init(), (cfg.hidden,))
        h = nn.relu(h + jnp.take(table, ids, axis=0) + offset)
        out = layers.dense(
            1, axes=("mlp", None), policy=self.policy, std=0.3, use_bias=False, name="out"
        )(h)[:, 0]
        seen = self.variable("counters", "seen", lambda: jnp.zeros((), jnp.float32))
        last_draw = self.variable("counters", "draw", lambda: jnp.zeros((), jnp.float32))
        if not deterministic and not self.is_initializing():
            seen.value = seen.value + x.shape[0]
            last_draw.value = draw[0]
        return out.astype(jnp.float32), seen.value


class ToyRegression(Workload):
    ModelConfig = ToyModel
    DataConfig = ToyData
    examples_name = "vectors"
    mutable = ("counters",)
    smoke_overrides = ("train.batch_size=16",)

    @classmethod
    def validate_config(cls, config: Config) -> None:
        for key in ("features", "hidden", "table_rows"):
            config_lib.positive(f"model.{key}", getattr(config.model, key))
        if config.data.eval_examples >= config.data.examples:
            raise ConfigError("data.eval_examples", "must be fewer than data.examples")

    def build_model(self, policy: Policy, remat: RematConfig) -> nn.Module:
        return ToyNet(self.config.model, policy)

    def build_datasets(self, shard: ProcessShard) -> Datasets[ToyMeta]:
        c = self.config
        rng = np.random.default_rng(c.seed)
        n, features = c.data.examples, c.model.features
        x = rng.normal(size=(n, features)).astype(np.float32)
        ids = rng.integers(0, c.model.table_rows, n).astype(np.int32)
        y = (x @ rng.normal(size=features) + 0.5 * np.sin(ids)).astype(np.float32)
        rows = [{"x": x[i], "ids": ids[i], "y": y[i]} for i in range(n)]
        split = n - c.data.eval_examples
        eval_batch = c.train.eval_batch_size or c.train.batch_size
        train = grain.MapDataset.source(rows[:split])[shard.index :: shard.count]
        train = train.shuffle(seed=c.seed).repeat(None)
        held = rows[split:][: (n - split) // eval_batch * eval_batch]
        evaluate = grain.MapDataset.source(held)[shard.index :: shard.count]
        return Datasets(
            train=train.batch(shard.rows(c.train.batch_size), drop_remainder=True),
            eval=evaluate.batch(shard.rows(eval_batch), drop_remainder=True),
            meta=ToyMeta(split, len(held)),
        )

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        features = self.config.model.features
        return {
            "x": Field((batch_size, features), jnp.float32, ("batch", None)),
            "ids": Field((batch_size,), jnp.int32, ("batch",)),
            "y": Field((batch_size,), jnp.float32, ("batch",)),
        }

    def preprocess(self, batch: Any, rng: jax.Array, *, train: bool) -> Any:
        draw = jax.random.uniform(rng) if train else jnp.zeros((), jnp.float32)
        x = batch["x"] * 2.0 + draw
        return {**batch, "x": x, "draw": jnp.broadcast_to(draw, batch["y"].shape)}

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return (batch["x"], batch["ids"], batch["draw"])

    def loss(self, outputs: Any, batch: Any) -> jax.Array:
        prediction, _ = outputs
        return jnp.mean((prediction - batch["y"]) ** 2)

    def predict(self, model: nn.Module, variables: dict[str, Any], batch: Any) -> Any:
        return model.apply(variables, *self.model_inputs(batch), deterministic=True)

    def eval_outputs(self, outputs: Any, batch: Any) -> dict[str, jax.Array]:
        prediction, seen = outputs
        return {
            "squared_error": jnp.sum((prediction - batch["y"]) ** 2),
            "count": jnp.asarray(prediction.shape[0], jnp.float32),
            "seen": seen,
        }

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        count = sum(float(o["count"]) for o in outputs)
        mse = sum(float(o["squared_error"]) for o in outputs) / count
        return {"eval_loss": mse, "eval_seen": float(outputs[-1]["seen"])}

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        m = self.config.model
        first, second = 2 * batch_size * m.features * m.hidden, 2 * batch_size * m.hidden
        # Forward and weight gradient of both layers. No input gradient for the first (x is data);
        # the second's contracts one output feature: an outer product, not a GEMM.
        return 2 * (first + second)

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size

    def axis_rules(self) -> tuple[tuple[str, str], ...]:
        return (("toy_rows", "tensor"),)

    def param_labels(self, params: Any) -> Any:
        return path_labels(params, lambda path: "frozen" if path[-1] == "offset" else "default")

    def group_optimizers(self, schedule: optax.Schedule) -> dict[str, Any]:
        return {"frozen": optax.set_to_zero()}

    def write_artifacts(self, datasets: Datasets, run_dir: Path, *, resuming: bool) -> None:
        meta = datasets.meta
        (run_dir / ARTIFACT).write_text(
            json.dumps({"train": meta.train_examples, "eval": meta.eval_examples})
        )


workloads.register("toy", ToyRegression)
WORKLOAD = ToyRegression
