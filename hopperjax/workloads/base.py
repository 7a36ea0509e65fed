"""The workload contract: everything the generic trainer, inspect and the tools know of a task.

A workload (language modeling, drug-target affinity, ...) is the one place that knows its task.
It brings the dataclasses of the ``model:`` and ``data:`` config groups, builds its model and
datasets, says which fields a batch has and how each is laid out on the mesh, what the model is
called with, which loss it minimizes, how eval outputs become eval metrics, and how many FLOPs a
step costs. Optional hooks, with defaults that do nothing: model state updated by the step
(``mutable``), on-device preprocessing inside the jitted step, extra logical-axis rules,
per-group optimizers, prediction for eval and serving, generation metrics (decoded outputs
scored during training), and files written beside the run.

Adding a workload is four files: ``configs/<name>.yaml``, ``models/<name>.py``, ``data/<name>.py``
(or a reused source) and ``workloads/<name>.py``, whose ``WORKLOAD`` names its class (or
``hopperjax.workloads.register(name, cls)`` from any package). ``tests/test_workload_contract.py``
then runs it through build, train, eval, resume and inspect.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hopperjax.config import Config, DataConfig, ModelConfig, RematConfig
from hopperjax.data.grain_io import Datasets, ProcessShard
from hopperjax.precision import Policy

Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch field: its global shape, dtype and logical axis names (for its sharding)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]


class Workload(abc.ABC):
    """A task the generic trainer can train, bound to one run's config (``self.config``).

    Class attributes:
      ModelConfig, DataConfig: the dataclasses of the ``model:`` and ``data:`` groups
        (subclasses of ``config.ModelConfig`` / ``config.DataConfig``).
      examples_name: what throughput counts ("tokens", "pairs", "images", ...).
      remat_names: the activations the model tags with ``checkpoint_name``, which
        ``remat.names`` / ``remat.offload_names`` choose from.
      fp8_layers: Dense layer names ``fp8.layers`` may list; default_fp8_layers: those FP8 runs
        in when ``fp8.layers`` is null.
      mutable: variable collections beyond ``params`` that the model updates in training (e.g.
        ``("batch_stats",)``) or holds as untrained constants (DTA's standardization
        statistics); the train state carries them as ``model_state``, checkpoints them, and eval
        and ``restore_params`` read them.
      smoke_overrides: ``key=value`` overrides that shrink ``workload: <name>`` with its
        defaults to a model and data that need no file and build, train and evaluate in seconds
        on a CPU (the contract test runs every workload with them; so can a user).
      independent_rows: row i of every batch field belongs to example i alone, so two batches
        concatenate into one (the serving batcher merges requests); False when fields index
        into each other (DTA's deduplicated molecule tables).
      row_mean_loss: ``loss`` is the mean of a per-row loss over the batch's rows, so the mean
        of the losses of equal row blocks is the batch's loss (gradient compression computes
        one per data group); False when rows weigh differently (a mean over real tokens).
    """

    ModelConfig: ClassVar[type[ModelConfig]]
    DataConfig: ClassVar[type[DataConfig]]
    examples_name: ClassVar[str] = "examples"
    remat_names: ClassVar[tuple[str, ...]] = ()
    fp8_layers: ClassVar[tuple[str, ...]] = ()
    default_fp8_layers: ClassVar[tuple[str, ...]] = ()
    mutable: ClassVar[tuple[str, ...]] = ()
    smoke_overrides: ClassVar[tuple[str, ...]] = ()
    independent_rows: ClassVar[bool] = True
    row_mean_loss: ClassVar[bool] = True

    def __init__(self, config: Config):
        self.config = config

    def next_commands(self, run_dir: Path) -> list[str]:
        """Commands worth running on a finished run of this workload (its sampler, its
        translator), printed first in the end-of-run summary. Default: none."""
        del run_dir
        return []

    @classmethod
    def validate_config(cls, config: Config) -> None:
        """Raises ``ConfigError`` naming the key for a bad ``model.*`` or ``data.*`` value, or one
        that disagrees with another group. Pure: reads files' existence at most. Default: no
        checks beyond the types."""
        del config

    # ------------------------------------------------------------------------------------------
    # Required

    @abc.abstractmethod
    def build_model(self, policy: Policy, remat: RematConfig) -> nn.Module:
        """The Flax module, called as ``model(*model_inputs(batch), deterministic=...)``. Its
        parameter shapes depend on the config only (never on the data): a params-only restore
        builds it without datasets."""

    @abc.abstractmethod
    def build_datasets(self, shard: ProcessShard) -> Datasets:
        """This process's train and eval datasets (``shard`` of every global batch).

        Raises ``ConfigError`` naming the key when the data cannot serve the config."""

    @abc.abstractmethod
    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        """Every field of a global batch of ``batch_size`` examples, as it arrives from the host.

        ``datasets`` None: a layout good for building the model (restore, export), whose field
        shapes may differ from a run's but give the same parameter shapes."""

    @abc.abstractmethod
    def model_inputs(self, batch: Batch) -> tuple[Any, ...]:
        """The model's positional arguments, from a (preprocessed) batch."""

    @abc.abstractmethod
    def loss(self, outputs: Any, batch: Batch) -> jax.Array:
        """Mean loss of one batch (fp32 scalar), the quantity the optimizer minimizes."""

    @abc.abstractmethod
    def eval_outputs(self, outputs: Any, batch: Batch) -> dict[str, jax.Array]:
        """What the eval step returns per batch (sums, or per-example predictions)."""

    @abc.abstractmethod
    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """Eval metrics, ``eval_`` prefixed (one of them ``eval_loss``), from every eval batch's
        outputs."""

    @abc.abstractmethod
    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        """Analytic model FLOPs of one training step over all devices (3 x forward: no remat
        recompute), from the model's own formula (``models/<name>.py``)."""

    @abc.abstractmethod
    def examples_per_step(self, batch_size: int) -> int:
        """Examples (``examples_name``) one step of ``batch_size`` consumes."""

    # ------------------------------------------------------------------------------------------
    # Optional, with defaults that change nothing

    def preprocess(self, batch: Batch, rng: jax.Array, *, train: bool) -> Batch:
        """On-device preprocessing (augmentation, normalization, dtype conversion), run inside
        the jitted step on the whole global batch. ``rng`` is a per-step key of its own stream
        (the dropout stream is not touched). Default: the batch unchanged."""
        del rng, train
        return batch

    def axis_rules(self) -> Sequence[tuple[str, Any]]:
        """Extra logical-axis rules (e.g. ``("table_rows", "tensor")``); they take precedence
        over the defaults in ``parallel/rules.py`` for the names they give."""
        return ()

    def param_labels(self, params: Any) -> Any | None:
        """A label per parameter leaf (same tree) for per-group optimizers
        (``optax.multi_transform``); None: one optimizer for every parameter. Leaves labelled
        ``"default"`` get the configured ``optim.*``; every other label needs an entry in
        ``group_optimizers``."""
        del params
        return None

    def group_optimizers(self, schedule: optax.Schedule) -> dict[str, optax.GradientTransformation]:
        """The optimizer of each non-default label of ``param_labels`` (``schedule``: the
        configured learning rate schedule). Gradient clipping (``optim.clip_norm``) applies to
        all groups together, before them."""
        del schedule
        return {}

    def row_updates(self) -> Any | None:
        """Row-sparse embedding tables (``models/row_table.py``): a ``trainer.rows.RowUpdates``
        naming each table's lookups in a batch and the row-wise Adagrad settings; the train
        step then never forms those tables' dense gradients and updates only the rows a batch
        read. The workload also labels the tables for ``optax.set_to_zero`` (``param_labels``,
        ``group_optimizers``) so the dense optimizer leaves them alone. None: every parameter
        is dense (the default)."""
        return None

    def predict(self, model: nn.Module, variables: dict[str, Any], batch: Batch) -> Any:
        """The model's outputs in inference mode; eval, export and serving all call this."""
        return model.apply(variables, *self.model_inputs(batch), deterministic=True)

    def generation_metrics(
        self, model: nn.Module, variables: dict[str, Any], datasets: Datasets
    ) -> dict[str, float]:
        """Eval metrics that one forward pass per batch cannot give: outputs generated step by
        step and scored against references (translation: BLEU and chrF of beam-searched
        sentences). The loop adds them, ``eval_`` prefixed, to the eval record every
        ``train.generate_every`` steps and at the end. Every process calls it at the same point
        with the same arguments (``variables`` are global arrays on the mesh, in device memory);
        the returned values must agree across processes. A workload that defines it says so
        to the config check (``generates``); default: none."""
        del model, variables, datasets
        return {}

    @classmethod
    def generates(cls) -> bool:
        """Whether this workload defines ``generation_metrics`` (``train.generate_every`` is
        refused otherwise)."""
        return cls.generation_metrics is not Workload.generation_metrics

    def write_artifacts(self, datasets: Datasets, run_dir: Path, *, resuming: bool) -> None:
        """Files a run needs beside its checkpoints (a vocabulary, a tokenizer model), written
        by process 0 before training. ``resuming``: the run directory holds checkpoints; raise
        ``ConfigError`` if the data no longer matches what they were trained on."""
        del datasets, run_dir, resuming

    def advice(self) -> list[str]:
        """Config-level suggestions for ``hopperjax.inspect`` (e.g. pad a vocabulary)."""
        return []


def path_labels(params: Any, label_of: Callable[[tuple[str, ...]], str]) -> Any:
    """A ``param_labels`` helper: ``label_of(path)`` for every leaf, path as dict keys."""

    def label(path: tuple[Any, ...], _: Any) -> str:
        return label_of(tuple(str(getattr(p, "key", p)) for p in path))

    return jax.tree_util.tree_map_with_path(label, params)


def cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """Softmax cross-entropy of integer ``labels`` [...] (each in ``[0, classes)``) under
    ``logits`` [..., classes], per example, in fp32 whatever the logits' dtype (log-softmax over
    many classes is where low precision hurts first). ``smoothing``: the targets are
    ``(1 - smoothing)`` on the label plus ``smoothing`` spread evenly over all classes, optax's
    ``smooth_labels`` of the one-hot labels.

    That loss is ``(1 - s) * (lse - z[label]) + s * (lse - mean(z))`` (``lse`` the logits'
    log-sum-exp), computed so: the one-hot targets, which XLA keeps as one more buffer of the
    logits' size, are never made (docs/translation.md measures what that frees). Values equal
    optax's ``softmax_cross_entropy`` of ``smooth_labels`` to 1e-6 relative, gradients to 1e-6
    (``tests/test_workloads.py``).
    """
    logits = logits.astype(jnp.float32)
    if not smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    lse = jnp.log(jnp.exp(shifted).sum(axis=-1))
    picked = jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0]
    return (1.0 - smoothing) * (lse - picked) + smoothing * (lse - shifted.mean(axis=-1))


__all__ = [
    "Batch",
    "Datasets",
    "Field",
    "ProcessShard",
    "Workload",
    "cross_entropy",
    "path_labels",
]
