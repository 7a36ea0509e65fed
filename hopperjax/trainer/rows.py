"""Row-sparse updates of ``RowTable`` embeddings: the rows a batch read, and nothing else.

The workload names its row-sparse tables and their lookups (``Workload.row_updates``); the train
step differentiates zeros shaped like the looked-up rows (``models/row_table.py``) instead of the
tables, and ``apply_row_updates`` then sums each row's gradient over its occurrences in the
batch and applies row-wise Adagrad to those rows only:

    acc[r] += mean(g_r ** 2);  table[r] -= lr * g_r / (sqrt(acc[r]) + eps)

Memory and work scale with the batch's ids, never with the tables' rows. The dense optimizer
gives these tables no update and keeps no state for them (the workload labels them with
``optax.set_to_zero``); gradient clipping does not see their rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hopperjax.models.row_table import (
    ACCUMULATOR,
    GROUPS_AXIS,
    ROW_DELTAS,
    ROW_OPTIMIZER,
    TABLE,
    Path,
    RowUpdates,
)


def _get(tree: Mapping[str, Any], path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    """``tree`` with ``value`` at ``path`` (missing levels created), copied along the path."""
    if not path:
        return value
    return {**tree, path[0]: _set(tree.get(path[0], {}), path[1:], value)}


def zero_deltas(params: Any, lookups: Mapping[Path, jax.Array]) -> dict[str, Any]:
    """The ``ROW_DELTAS`` collection: zeros [*ids.shape, dim] at every looked-up table's path."""
    deltas: dict[str, Any] = {}
    for path, ids in lookups.items():
        table = _get(params, path)[TABLE]
        zeros = jnp.zeros((*ids.shape, table.shape[-1]), table.dtype)
        deltas = _set(deltas, path, {TABLE: zeros})
    return {ROW_DELTAS: deltas}


def without_tables(params: Any, lookups: Mapping[Path, jax.Array]) -> Any:
    """``params`` without the row-sparse tables (None in their place): what per-step metrics
    such as the parameter norm read, so that no step touches every row of a table."""
    for path in lookups:
        params = _set(params, (*path, TABLE), None)
    return params


def keep_tables(
    kept: Any, updated: Any, lookups: Mapping[Path, jax.Array]
) -> tuple[Any, dict[str, Any]]:
    """``kept`` (params, model_state) with the tables and accumulators of ``updated`` (whose
    row updates were already gated by the loss scale's finiteness): a skipped step then never
    selects between two copies of a table."""
    (params, state), (new_params, new_state) = kept, updated
    accumulators = state[ROW_OPTIMIZER]
    for path in lookups:
        params = _set(params, (*path, TABLE), _get(new_params, path)[TABLE])
        accumulators = _set(
            accumulators, (*path, ACCUMULATOR), _get(new_state[ROW_OPTIMIZER], path)[ACCUMULATOR]
        )
    return params, {**state, ROW_OPTIMIZER: accumulators}


def _adagrad_rows(
    table: jax.Array,
    acc: jax.Array,
    ids: jax.Array,
    grads: jax.Array,
    updates: RowUpdates,
    finite: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Row-wise Adagrad on the rows of ``table`` [rows, dim] (accumulators ``acc`` [rows]) that
    ``ids`` [...] read, with ``grads`` [..., dim] per occurrence."""
    rows, dim = table.shape
    flat = ids.reshape(-1)
    grads = grads.reshape(-1, dim).astype(jnp.float32)
    # Duplicates summed: sorted unique ids (fixed size: one slot per occurrence, the spare slots
    # hold `rows`, an index the scatters below drop).
    unique, inverse = jnp.unique(flat, size=flat.size, fill_value=rows, return_inverse=True)
    summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=flat.size)
    if finite is not None:  # where, not a product: 0 * inf is nan
        summed = jnp.where(finite, summed, 0.0)
    acc_rows = acc.at[unique].get(mode="fill", fill_value=0.0) + jnp.mean(summed**2, axis=-1)
    step = updates.learning_rate * summed / (jnp.sqrt(acc_rows)[:, None] + updates.eps)
    table = table.at[unique].add(-step.astype(table.dtype), mode="drop")
    return table, acc.at[unique].set(acc_rows, mode="drop")


def apply_row_updates(
    params: Any,
    model_state: Mapping[str, Any],
    lookups: Mapping[Path, jax.Array],
    row_grads: Mapping[str, Any],
    updates: RowUpdates,
    *,
    finite: jax.Array | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(params, model_state) with row-wise Adagrad applied to the rows each table read.

    ``row_grads``: the gradient of the ``ROW_DELTAS`` collection (per occurrence of an id).
    A grouped table [groups, rows, dim] (ids [groups, ...]) is updated group by group (a
    batched update: each device updates the groups it holds, with no collective).
    ``finite``: with loss scaling, whether the step's gradients are finite; a False leaves every
    row and accumulator as it was (the updates are zeroed, batch-sized, in place)."""
    accumulators = model_state[ROW_OPTIMIZER]
    for path, ids in lookups.items():
        table = _get(params, path)[TABLE]
        acc = _get(accumulators, path)[ACCUMULATOR]
        grads = _get(row_grads, path)[TABLE]

        def update(table, acc, ids, grads):
            return _adagrad_rows(table, acc, ids, grads, updates, finite)

        if table.ndim == 3:
            # Each group's ids and gradients (a batch's worth, small) gathered where the group
            # lives, so that the update itself is local (XLA would otherwise partition the
            # sort inside jnp.unique across the batch's devices).
            ids, grads = (
                nn.with_logical_constraint(x, (GROUPS_AXIS, *[None] * (x.ndim - 1)))
                for x in (ids, grads)
            )
            update = jax.vmap(update)
        table, acc = update(table, acc, ids, grads)
        params = _set(params, (*path, TABLE), table)
        accumulators = _set(accumulators, (*path, ACCUMULATOR), acc)
    return params, {**model_state, ROW_OPTIMIZER: accumulators}
