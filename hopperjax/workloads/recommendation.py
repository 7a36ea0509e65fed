"""Recommendation: interactions in, a click probability or a rating out (DLRM, matrix
factorization).

Data (``data/interactions.py``): Criteo's click logs, MovieLens ratings (its 5-fold files or one
file split at random) or generated interactions. Model (``models/dlrm.py``): embedding tables
split row-wise or placed whole (table-wise) over the ``tensor`` mesh axis or every device, MLPs
replicated, the batch over ``data``.
Clicks train on binary cross-entropy and report log loss, AUC and accuracy; ratings train on the
squared error (as an offset from the training mean) and report RMSE and MAE, with predictions
clipped to the training ratings' range as Surprise's benchmark does. Every held-out interaction
is scored exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hopperjax import config as config_lib
from hopperjax import scoring
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import EpochBatches
from hopperjax.data import interactions as ix
from hopperjax.data.datasets import not_found
from hopperjax.data.errors import DataError
from hopperjax.models import dlrm
from hopperjax.models.row_table import TABLE, RowUpdates
from hopperjax.precision import Policy
from hopperjax.workloads.base import Datasets, Field, ProcessShard, Workload, path_labels

SPARSE = "row_sparse"


@dataclasses.dataclass(frozen=True)
class InteractionData(config_lib.DataConfig):
    """The ``data:`` group of recommendation.

    ``source``: ``criteo`` (``path``: a TSV file, ``.gz`` too; the last ``eval_fraction`` of its
    rows, in time order, held out), ``criteo_shards`` (``path``: a directory of
    ``tools/convert_interactions.py``, split the same way; ``preload`` reads it into memory at the
    start, false reads a batch at a time), ``movielens`` (``path``: a directory with
    ``u{fold}.base`` / ``u{fold}.test`` when ``fold`` is set, else with ``u.data`` or
    ``ratings.csv``, of which a seeded random ``eval_fraction`` is held out) or ``synthetic``
    (``synthetic_rows`` interactions over the model's tables, ``synthetic_hot`` ids per bag,
    ``synthetic_dense`` features, a hidden structure of ``synthetic_rank`` factors,
    ``synthetic_task`` clicks or ratings with noise of std ``synthetic_noise``; a quarter as many
    held out). ``hash_ids``: MovieLens ids hashed to the tables' sizes instead of used as rows.
    ``bad_records``: ``error`` (one line naming the file and line) or ``skip`` (counted).
    """

    source: Literal["criteo", "criteo_shards", "movielens", "synthetic"] = "synthetic"
    path: str | None = None
    fold: int | None = None
    eval_fraction: float = 0.1
    hash_ids: bool = False
    bad_records: Literal["error", "skip"] = "error"
    preload: bool = True
    synthetic_rows: int = 4096
    synthetic_hot: int = 1
    synthetic_dense: int = 0
    synthetic_rank: int = 4
    synthetic_zipf: float = 1.05
    synthetic_task: Literal["clicks", "ratings"] = "ratings"
    synthetic_noise: float = 0.5

    @property
    def task(self) -> str:
        return {"criteo": "clicks", "criteo_shards": "clicks", "movielens": "ratings"}.get(
            self.source, self.synthetic_task
        )

    @property
    def num_dense(self) -> int:
        dense = {"criteo": ix.CRITEO_DENSE, "criteo_shards": ix.CRITEO_DENSE, "movielens": 0}
        return dense.get(self.source, self.synthetic_dense)

    @property
    def hot(self) -> int:
        return self.synthetic_hot if self.source == "synthetic" else 1


@dataclasses.dataclass(frozen=True)
class InteractionMeta:
    """Training and held-out interaction counts, rows skipped, the training labels' mean and
    range (ratings: the offset the model predicts from, and where predictions are clipped)."""

    train_rows: int
    eval_rows: int
    skipped: int
    label_mean: float
    label_range: tuple[float, float]


class Recommendation(Workload):
    ModelConfig = dlrm.DLRMConfig
    DataConfig = InteractionData
    examples_name = "interactions"
    smoke_overrides = (
        "data.source=synthetic",
        "data.path=null",
        "data.synthetic_rows=1024",
        "data.synthetic_dense=3",
        "data.synthetic_hot=2",
        "data.fold=null",
        "model.kind=dlrm",
        "model.table_sizes=64,48,40",
        "model.embed_dim=8",
        "model.bottom_mlp=16,8",
        "model.top_mlp=32,16",
        "train.batch_size=64",
    )

    def __init__(self, config: Config):
        super().__init__(config)
        self.label_mean: float | None = None
        # The training ratings' range (build_datasets), where eval clips predictions.
        self._label_range: tuple[float, float] = (-np.inf, np.inf)
        if config.data.task == "ratings":
            self.mutable = (dlrm.TARGET_STATS,)

    @classmethod
    def validate_config(cls, config: Config) -> None:
        m, d = config.model, config.data
        m.validate()
        if not 0.0 < d.eval_fraction < 1.0:
            raise ConfigError("data.eval_fraction", f"expected 0 < f < 1, got {d.eval_fraction}")
        if d.source == "synthetic":
            if d.path:
                raise ConfigError("data.path", "not used by data.source 'synthetic'")
            for key in ("synthetic_rows", "synthetic_hot", "synthetic_rank", "synthetic_zipf"):
                config_lib.positive(f"data.{key}", getattr(d, key))
            if d.synthetic_dense < 0 or d.synthetic_noise < 0:
                raise ConfigError("data.synthetic_dense", "synthetic_dense and _noise are >= 0")
        else:
            if not d.path:
                raise ConfigError("data.path", f"required by data.source '{d.source}'")
            if not Path(d.path).exists():
                raise ConfigError("data.path", not_found(d.path))
        if d.fold is not None and (d.source != "movielens" or not 1 <= d.fold <= 5):
            raise ConfigError("data.fold", "1..5, and only with data.source 'movielens'")
        if d.source.startswith("criteo") and len(m.tables) != ix.CRITEO_TABLES:
            raise ConfigError(
                "model.table_sizes", f"Criteo has {ix.CRITEO_TABLES} tables, got {len(m.tables)}"
            )
        if d.source == "movielens" and len(m.tables) != 2:
            raise ConfigError("model.table_sizes", f"MovieLens has 2 tables, got {len(m.tables)}")
        if m.sparse_updates and config.train.microbatches > 1:
            raise ConfigError(
                "train.microbatches", "model.sparse_updates updates rows once per batch: use 1"
            )
        if m.kind == "mf" and d.task != "ratings":
            raise ConfigError("model.kind", "'mf' predicts ratings; clicks need 'dlrm'")

    def build_model(self, policy: Policy, remat: RematConfig) -> dlrm.DLRM:
        del remat  # the MLPs are small: nothing worth recomputing
        mean = None
        if self.config.data.task == "ratings":
            # Without the data (a restored model) the checkpoint's value replaces this one.
            mean = self.label_mean if self.label_mean is not None else 0.0
        return dlrm.DLRM(config=self.config.model, policy=policy, target_mean=mean)

    # ------------------------------------------------------------------------------------------
    # Data

    def _read(self) -> tuple[ix.Interactions, ix.Interactions]:
        d, sizes = self.config.data, self.config.model.tables
        skip = d.bad_records == "skip"
        if d.source == "synthetic":
            spec = ix.SyntheticSpec(
                rows=d.synthetic_rows, table_sizes=sizes, hot=d.synthetic_hot,
                num_dense=d.synthetic_dense, rank=d.synthetic_rank, zipf=d.synthetic_zipf,
                task=d.synthetic_task, noise=d.synthetic_noise,
            )  # fmt: skip
            held = dataclasses.replace(spec, rows=max(1, d.synthetic_rows // 4))
            return ix.synthetic(spec, self.config.seed), ix.synthetic(held, self.config.seed + 1)
        path = Path(d.path)
        if d.source.startswith("criteo"):
            if d.source == "criteo":
                rows = ix.read_criteo(path, sizes, skip_bad=skip)
            else:
                rows = ix.read_interaction_shards(path, sizes)
                if d.preload:
                    rows = rows.load()
            cut = len(rows) - max(1, round(len(rows) * d.eval_fraction))
            held = dataclasses.replace(rows.take(np.arange(cut, len(rows))), skipped=0)
            return rows.take(np.arange(cut)), held
        read = dict(hash_ids=d.hash_ids, skip_bad=skip)
        if d.fold is not None:
            return (
                ix.read_movielens(path / f"u{d.fold}.base", sizes, **read),
                ix.read_movielens(path / f"u{d.fold}.test", sizes, **read),
            )
        name = next((n for n in ("u.data", "ratings.csv") if (path / n).is_file()), None)
        if path.is_file():
            name, path = path.name, path.parent
        if name is None:
            raise DataError(f"{path}: no u.data or ratings.csv (or set data.fold for u1..u5)")
        rows = ix.read_movielens(path / name, sizes, **read)
        order = np.random.default_rng(self.config.seed).permutation(len(rows))
        cut = len(rows) - max(1, round(len(rows) * d.eval_fraction))
        held = dataclasses.replace(rows.take(np.sort(order[cut:])), skipped=0)
        return rows.take(np.sort(order[:cut])), held

    def build_datasets(self, shard: ProcessShard) -> Datasets[InteractionMeta]:
        """This process's rows of every training batch (reshuffled every epoch) and of the
        held-out interactions (one pass in order, padded with weight-0 rows to whole batches).

        Raises ConfigError naming the key: bad files (``data.path``), ids beyond a table
        (``model.table_sizes``), or fewer training rows than one batch."""
        config, t = self.config, self.config.train
        try:
            train, held = self._read()
        except DataError as e:
            raise ConfigError("data.path", str(e), name_key=False) from None
        for split in (train, held):
            try:
                split.check_ids(config.model.tables, config.data.path or "synthetic data")
            except DataError as e:
                raise ConfigError("model.table_sizes", str(e)) from None
        if len(train) < t.batch_size:
            raise ConfigError("train.batch_size", f"larger than the {len(train)} training rows")
        # Ratings are predicted from the training mean and clipped to the training range; clicks
        # need neither (and shard records read lazily have no label array to scan).
        stats = (0.0, (0.0, 1.0))
        if config.data.task == "ratings":
            stats = (
                float(train.labels.mean()),
                (float(train.labels.min()), float(train.labels.max())),
            )
        self.label_mean = stats[0]
        index, count = shard.index, shard.count
        rows = shard.rows(t.batch_size)
        train_ds = grain.MapDataset.source(
            EpochBatches(train, rows * count, rows, index * rows, config.seed, config.data.shuffle)
        )
        eval_batch = t.eval_batch_size or t.batch_size
        eval_rows = shard.rows(eval_batch)
        eval_ds = grain.MapDataset.source(
            EpochBatches(held.padded(eval_batch), eval_rows * count, eval_rows, index * eval_rows,
                         shuffle=False, epochs=1)
        )  # fmt: skip
        meta = InteractionMeta(
            train_rows=len(train),
            eval_rows=len(held),
            skipped=train.skipped + held.skipped,
            label_mean=self.label_mean,
            label_range=stats[1],
        )
        self._label_range = meta.label_range
        return Datasets(train=train_ds, eval=eval_ds, meta=meta)

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        d = self.config.data
        tables = len(self.config.model.tables)
        return {
            "dense": Field((batch_size, d.num_dense), jnp.float32, ("batch", None)),
            "sparse": Field((batch_size, tables, d.hot), jnp.int32, ("batch", None, None)),
            "labels": Field((batch_size,), jnp.float32, ("batch",)),
            "weights": Field((batch_size,), jnp.float32, ("batch",)),
        }

    # ------------------------------------------------------------------------------------------
    # Row-sparse tables (model.sparse_updates)

    def _row_tables(self) -> dict[tuple[str, ...], Any]:
        """Each ``RowTable``'s module path -> ``batch -> the ids it reads`` (as ``dlrm.Table`` /
        ``dlrm.PlacedTables`` hand them to it)."""
        m = self.config.model
        placed, placement = np.array(m.placed), m.placement()
        tables = {
            (f"table_{t}", "rows"): lambda b, t=t: jnp.maximum(b["sparse"][:, t], 0)
            for t in range(len(m.tables))
            if t not in m.placed
        }
        if placement is not None:
            tables["tables", "rows"] = lambda b: jnp.maximum(
                dlrm.placed_ids(placement, b["sparse"][:, placed]), 0
            )
        return tables

    def row_updates(self) -> RowUpdates | None:
        if not self.config.model.sparse_updates:
            return None
        tables = self._row_tables()

        def lookups(batch: Any) -> dict[tuple[str, ...], jax.Array]:
            return {path: ids(batch) for path, ids in tables.items()}

        return RowUpdates(lookups, self.config.optim.row_lr, self.config.optim.row_eps)

    def param_labels(self, params: Any) -> Any | None:
        if not self.config.model.sparse_updates:
            return None
        tables = self._row_tables()
        return path_labels(
            params, lambda path: SPARSE if tuple(path[:-1]) in tables and path[-1] == TABLE
            else "default",
        )  # fmt: skip

    def group_optimizers(self, schedule: optax.Schedule) -> dict[str, Any]:
        del schedule
        # No dense update and no state: the train step's row-wise Adagrad owns these tables.
        return {SPARSE: optax.set_to_zero()} if self.config.model.sparse_updates else {}

    def axis_rules(self) -> tuple[tuple[str, Any], ...]:
        m = self.config.model
        everywhere = m.table_sharding == "all"
        devices = ("data", "fsdp", "tensor") if everywhere else "tensor"
        # Row-wise tables' rows, and table-wise groups, over those devices; the placed ids and
        # bags keep the batch split over data within a tensor group, but need the whole batch
        # when the groups span the devices the batch is split over.
        batch = None if everywhere else ("data", "fsdp")
        return (("table_rows", devices), ("table_groups", devices), ("table_batch", batch),
                ("table_dim", None))  # fmt: skip

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        return (batch["dense"], batch["sparse"])

    # ------------------------------------------------------------------------------------------
    # Loss and metrics

    def predict(self, model: Any, variables: dict[str, Any], batch: Any) -> jax.Array:
        """Click logits or ratings [batch] (without the training-only penalty)."""
        return model.apply(variables, *self.model_inputs(batch), deterministic=True)[0]

    def loss(self, outputs: tuple[jax.Array, jax.Array], batch: Any) -> jax.Array:
        """Mean binary cross-entropy of click logits, or mean squared error of ratings, plus
        ``model.l2`` x the mean squared norm of the looked-up vectors."""
        predictions, penalty = outputs
        labels = batch["labels"]
        if self.config.data.task == "clicks":
            data_loss = optax.sigmoid_binary_cross_entropy(predictions, labels).mean()
        else:
            data_loss = jnp.mean((predictions - labels) ** 2)
        return data_loss + self.config.model.l2 * penalty.mean()

    def eval_outputs(self, outputs: jax.Array, batch: Any) -> dict[str, jax.Array]:
        """Per-row predictions, labels and weights (0 for padding): AUC needs them all."""
        return {"pred": outputs, "labels": batch["labels"], "weights": batch["weights"]}

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        real = np.concatenate([o["weights"] for o in outputs]) > 0
        pred = np.concatenate([o["pred"] for o in outputs]).astype(np.float64)[real]
        labels = np.concatenate([o["labels"] for o in outputs]).astype(np.float64)[real]
        if self.config.data.task == "clicks":
            p = np.clip(1.0 / (1.0 + np.exp(-pred)), 1e-7, 1 - 1e-7)
            logloss = float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
            return {
                "eval_loss": logloss,
                "eval_auc": scoring.roc_auc(labels, pred),
                "eval_accuracy": float(np.mean((pred > 0) == (labels > 0.5))),
                "eval_rows": float(len(labels)),
            }
        low, high = self._label_range
        error = np.clip(pred, low, high) - labels
        return {
            "eval_loss": float(np.mean((pred - labels) ** 2)),
            "eval_rmse": float(math.sqrt(np.mean(error**2))),
            "eval_mae": float(np.mean(np.abs(error))),
            "eval_rows": float(len(labels)),
        }

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        d = self.config.data
        return batch_size * dlrm.train_flops(self.config.model, d.num_dense)

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size


WORKLOAD = Recommendation
