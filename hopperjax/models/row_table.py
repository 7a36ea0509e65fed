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
# The logical axis of a grouped table's groups (the update gathers each group's ids there).
GROUPS_AXIS = "table_groups"

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


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of a [rows, dim] table for ``ids`` [...] -> [..., dim]; of a grouped [groups, rows,
    dim] table for ``ids`` [groups, ...], each group's ids reading its own rows (a gather with a
    batching dimension: a table sharded over groups is read where it lives)."""
    if table.ndim == 2:
        return jnp.take(table, ids, axis=0)
    return jax.vmap(lambda rows, i: jnp.take(rows, i, axis=0))(table, ids)


class RowTable(nn.Module):
    """``ids`` [...] (non-negative) -> rows [..., dim] of an ``embedding`` [rows, dim], or with
    ``groups`` > 0 of a grouped ``embedding`` [groups, rows, dim] for ``ids`` [groups, ...]
    (several tables placed whole on the devices of a group axis). ``axes``: the logical names
    of the embedding's dimensions. ``sparse``: keep a row-wise Adagrad accumulator per row (the
    train step updates this table row-sparsely); off, a plain table."""

    rows: int
    dim: int
    std: float
    policy: Policy
    axes: tuple[str | None, ...] = ("table_rows", "table_dim")
    sparse: bool = False
    groups: int = 0

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        shape = (*((self.groups,) if self.groups else ()), self.rows, self.dim)
        if len(self.axes) != len(shape):
            raise ValueError(f"RowTable axes {self.axes} do not name the dimensions of {shape}")
        init = layers.normal_init(self.std, self.axes)
        table = self.param(TABLE, init, shape, self.policy.param_dtype)
        if self.sparse:
            zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[:-1])
            self.variable(ROW_OPTIMIZER, ACCUMULATOR, zeros, None, shape[:-1], jnp.float32)
        rows = gather_rows(table, ids)
        if self.has_variable(ROW_DELTAS, TABLE):
            rows = jax.lax.stop_gradient(rows) + self.get_variable(ROW_DELTAS, TABLE)
        return rows
