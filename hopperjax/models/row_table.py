"""An embedding table whose rows the train step can update sparsely (row-wise Adagrad).

A table read only by row lookups has a gradient that is zero outside the rows a batch read, yet
``jax.grad`` of a lookup forms it as a dense [rows, dim] array. ``RowTable`` lets the train step
avoid that: when the step provides a ``ROW_DELTAS`` variable (zeros shaped like the looked-up
rows), the rows are read through ``stop_gradient`` plus that delta, so the step differentiates
the deltas (batch-sized) and never the table. It then updates only the rows read, with the
row-wise Adagrad of DLRM and TorchRec (one accumulator per row: the mean squared gradient of the
row's entries), kept beside the table in the ``ROW_OPTIMIZER`` collection (sharded like the
table's rows, checkpointed). Without the delta (eval, export, dense training) it is a plain
lookup. ``trainer/rows.py`` holds the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from hopperjax.models import layers
from hopperjax.precision import Policy

ROW_DELTAS = "row_deltas"
ROW_OPTIMIZER = "row_optimizer"
TABLE = "embedding"
ACCUMULATOR = "accumulator"

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RowUpdates:
    """What ``Workload.row_updates`` returns (the update itself: ``trainer/rows.py``).

    Attributes:
      lookups: ``lookups(preprocessed batch) -> {module path: ids}``: for each ``RowTable``
        (its path of module names in the model, e.g. ``("table_0", "rows")``), the ids it reads
        in this batch, in the shape the module is called with.
      learning_rate: row-wise Adagrad's step size.
      eps: added to the root of the accumulator.
    """

    lookups: Callable[[Mapping[str, jax.Array]], dict[Path, jax.Array]]
    learning_rate: float
    eps: float = 1e-8


class RowTable(nn.Module):
    """``ids`` [...] (non-negative) -> rows [..., dim] of an ``embedding`` [rows, dim] whose
    row axis carries the logical name ``axes[0]``. ``sparse``: keep a row-wise Adagrad
    accumulator (the train step updates this table row-sparsely); off, a plain table."""

    rows: int
    dim: int
    std: float
    policy: Policy
    axes: tuple[str, str] = ("table_rows", "table_dim")
    sparse: bool = False

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        init = layers.normal_init(self.std, self.axes)
        table = self.param(TABLE, init, (self.rows, self.dim), self.policy.param_dtype)
        if self.sparse:
            zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[:1])
            self.variable(ROW_OPTIMIZER, ACCUMULATOR, zeros, None, (self.rows,), jnp.float32)
        rows = jnp.take(table, ids, axis=0)
        if self.has_variable(ROW_DELTAS, TABLE):
            rows = jax.lax.stop_gradient(rows) + self.get_variable(ROW_DELTAS, TABLE)
        return rows
