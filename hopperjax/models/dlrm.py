"""Recommendation models: DLRM (Naumov et al. 2019) and matrix factorization.

DLRM: dense features -> bottom MLP -> a vector of ``embed_dim``; each categorical feature -> a bag
of rows of its embedding table, pooled (sum or mean; padding ids, ``PAD_ID`` < 0, contribute
nothing); the pairwise dot products of all these vectors (the strict upper triangle, plus the
bottom vector itself) or their concatenation -> top MLP -> one scalar (a click logit or a
rating). Matrix factorization (``kind: mf``): rating = mean + user bias + item bias + <user
vector, item vector>, tables 0 and 1 being users and items.

Sharding, row-wise (``table_placement: rows``): the tables carry the logical axes
``("table_rows", "table_dim")``, which the workload maps to ``tensor`` (each device holds
1/tensor of every table's rows) and nothing; the MLPs are small and replicated (the batch is
split over ``data``). XLA partitions each lookup (a gather from a row-sharded table: each device
gathers the rows it holds, and the partial bags are summed across ``tensor``), which inspect
lists among the step's collectives.

Table-wise (``table_placement: tables``): whole tables are placed on devices. ``place_tables``
bins the tables into ``table_groups`` groups of about equal rows (largest first onto the
lightest group), stored as one grouped table [groups, rows, dim] whose group axis
(``table_groups``) is sharded; each group's ids read its own rows (a gather with a batching
dimension, local to the device holding the group), so a device looks up only its tables, and
the pooled bags then travel to the devices that run each example's MLPs (an all-gather within a
tensor group, or an all-to-all when the tables and the batch share every device).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import config as config_lib
from hopperjax.config import ConfigError
from hopperjax.models import layers
from hopperjax.models.row_table import GROUPS_AXIS, RowTable
from hopperjax.precision import Policy

TABLE_AXES = ("table_rows", "table_dim")
GROUPED_TABLE_AXES = (GROUPS_AXIS, None, "table_dim")
# Placed ids [groups, batch, slots, hot] and their bags [groups, batch, slots, dim]: the batch
# axis is "table_batch", which the workload maps to the batch's axes when the groups live within
# a tensor group, and to nothing when the groups span the devices the batch is split over.
PLACED_IDS_AXES = (GROUPS_AXIS, "table_batch", None, None)
PLACED_BAGS_AXES = (GROUPS_AXIS, "table_batch", None, "table_dim")
TARGET_STATS = "target_stats"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@dataclasses.dataclass(frozen=True)
class DLRMConfig(config_lib.ModelConfig):
    """The recommendation model's ``model:`` group.

    ``kind``: ``dlrm`` or ``mf`` (two tables: users, items). ``table_sizes``: rows of each
    embedding table, comma-separated (the data's ids must be below them, or hashed to them).
    ``embed_dim``: width of every table (and of the bottom MLP's output). ``bottom_mlp`` /
    ``top_mlp``: hidden widths, comma-separated (the bottom MLP ends in ``embed_dim``, the top MLP
    in one output). ``interaction``: ``dot`` (pairwise dot products) or ``cat``. ``pooling`` of a
    multi-hot bag: ``sum`` or ``mean``. ``init_std`` of the tables (the MLPs use fan-in scaling).
    ``l2``: weight of the squared norms of the vectors each example looks up, in the loss.
    ``table_sharding``: the tables' rows split over the ``tensor`` mesh axis (``tensor``: the
    MLPs then run replicated on a tensor group, data-parallel across groups) or over every
    device (``all``: with ``mesh.data`` = all devices, each holds 1/N of every table and 1/N of
    the batch, TorchRec's row-wise sharding beside data-parallel MLPs). ``sparse_updates``: the
    tables are updated row-sparsely by row-wise Adagrad (``optim.row_lr``) on the rows each
    batch reads, never forming their dense gradient (``models/row_table.py``); the MLPs (and
    ``mf``'s biases) keep the configured optimizer. ``table_placement``: ``rows`` splits every
    table's rows over the ``table_sharding`` devices; ``tables`` places whole tables on them
    (table-wise, for many small tables), binned into ``table_groups`` groups of about equal rows
    (a multiple of those devices; the grouping, not the mesh, fixes the checkpoint's shapes);
    tables of more than ``table_wise_max_rows`` rows (0: no limit) stay split row-wise beside
    them (TorchRec's planner's mix: the few large tables split, the many small ones whole).
    """

    kind: Literal["dlrm", "mf"] = "dlrm"
    table_sizes: str = "1000,1000"
    embed_dim: int = 16
    bottom_mlp: str = "64"
    top_mlp: str = "64,32"
    interaction: Literal["dot", "cat"] = "dot"
    pooling: Literal["sum", "mean"] = "sum"
    init_std: float = 0.05
    l2: float = 0.0
    table_sharding: Literal["tensor", "all"] = "tensor"
    table_placement: Literal["rows", "tables"] = "rows"
    table_groups: int = 0
    table_wise_max_rows: int = 0
    sparse_updates: bool = False

    @property
    def tables(self) -> tuple[int, ...]:
        return _ints(self.table_sizes)

    @property
    def placed(self) -> tuple[int, ...]:
        """The tables placed whole (``table_placement: tables``), in table order."""
        if self.table_placement != "tables":
            return ()
        limit = self.table_wise_max_rows or math.inf
        return tuple(t for t, rows in enumerate(self.tables) if rows <= limit)

    def placement(self) -> Placement | None:
        """Where the placed tables sit (None when every table is split row-wise)."""
        placed = self.placed
        if not placed:
            return None
        return place_tables(tuple(self.tables[t] for t in placed), self.table_groups)

    @property
    def bottom(self) -> tuple[int, ...]:
        return _ints(self.bottom_mlp)

    @property
    def top(self) -> tuple[int, ...]:
        return _ints(self.top_mlp)

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.*`` key of the first bad value."""
        for key in ("table_sizes", "bottom_mlp", "top_mlp"):
            try:
                sizes = getattr(self, {"table_sizes": "tables", "bottom_mlp": "bottom",
                                       "top_mlp": "top"}[key])  # fmt: skip
            except ValueError:
                raise ConfigError(
                    f"model.{key}", f"expected comma-separated integers, got {getattr(self, key)!r}"
                ) from None
            if any(n <= 0 for n in sizes):
                raise ConfigError(f"model.{key}", f"sizes must be > 0, got {getattr(self, key)!r}")
        if not self.tables:
            raise ConfigError("model.table_sizes", "at least one table")
        if self.kind == "mf" and len(self.tables) != 2:
            raise ConfigError(
                "model.table_sizes",
                f"kind 'mf' takes two tables (users, items), got {len(self.tables)}",
            )
        config_lib.positive("model.embed_dim", self.embed_dim)
        config_lib.positive("model.init_std", self.init_std)
        if self.l2 < 0:
            raise ConfigError("model.l2", f"expected >= 0, got {self.l2}")
        if self.table_placement == "tables":
            if self.table_groups < 1:
                raise ConfigError(
                    "model.table_groups",
                    "table_placement 'tables' bins the tables into this many groups: set it to "
                    "the number of devices they are placed on (or a multiple)",
                )
            if self.kind == "mf":
                raise ConfigError(
                    "model.table_placement", "'tables' places many tables; 'mf' has two: use rows"
                )
            if self.table_wise_max_rows < 0 or not self.placed:
                raise ConfigError(
                    "model.table_wise_max_rows",
                    f"no table has at most {self.table_wise_max_rows} rows (0: no limit)",
                )
        elif self.table_groups or self.table_wise_max_rows:
            key = "table_groups" if self.table_groups else "table_wise_max_rows"
            raise ConfigError(f"model.{key}", "only with model.table_placement 'tables'")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where ``place_tables`` put each table: ``group[t]``, its ``slot[t]`` among the group's
    tables and its first row ``offset[t]`` in the group; every group holds ``rows`` rows (the
    fullest group's count) and at most ``slots`` tables."""

    groups: int
    rows: int
    slots: int
    group: tuple[int, ...]
    slot: tuple[int, ...]
    offset: tuple[int, ...]


def place_tables(sizes: tuple[int, ...], groups: int) -> Placement:
    """Bins tables of ``sizes`` rows into ``groups`` groups: largest first, each onto the group
    with the fewest rows so far (ties: the lower group), so the groups' rows, and each device's
    table bytes, come out about equal."""
    load, count = [0] * groups, [0] * groups
    group, slot, offset = [0] * len(sizes), [0] * len(sizes), [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        g = min(range(groups), key=lambda g: (load[g], g))
        group[t], slot[t], offset[t] = g, count[g], load[g]
        load[g] += sizes[t]
        count[g] += 1
    return Placement(groups, max(load), max(count), tuple(group), tuple(slot), tuple(offset))


def placed_ids(placement: Placement, sparse: jax.Array) -> jax.Array:
    """``sparse`` [batch, tables, hot] -> each group's rows [groups, batch, slots, hot]: a
    table's ids plus its offset in its group; padding ids and empty slots are -1."""
    p = placement
    table_of = np.full((p.groups, p.slots), -1)
    offsets = np.zeros((p.groups, p.slots), np.int32)
    for t, (g, k) in enumerate(zip(p.group, p.slot, strict=True)):
        table_of[g, k], offsets[g, k] = t, p.offset[t]
    ids = jnp.take(sparse, np.maximum(table_of, 0).reshape(-1), axis=1)  # [batch, g*k, hot]
    ids = ids.reshape(ids.shape[0], p.groups, p.slots, -1).transpose(1, 0, 2, 3)
    used = (table_of >= 0)[:, None, :, None]
    return jnp.where(used & (ids >= 0), ids + offsets[:, None, :, None], -1)


def _mlp(
    x: jax.Array, sizes: tuple[int, ...], *, policy: Policy, name: str, last_relu: bool
) -> jax.Array:
    for i, width in enumerate(sizes):
        x = layers.dense(
            width, axes=(None, None), policy=policy, std=math.sqrt(2.0 / x.shape[-1]),
            use_bias=True, name=f"{name}_{i}",
        )(x)  # fmt: skip
        if i < len(sizes) - 1 or last_relu:
            x = nn.relu(x)
    return x


def pool(rows: jax.Array, ids: jax.Array, pooling: str) -> jax.Array:
    """Bags: the looked-up ``rows`` [..., hot, dim] of ``ids`` [..., hot] (padding < 0 counts
    nothing) -> [..., dim], summed or averaged over each bag's real ids."""
    real = ids >= 0
    total = jnp.where(real[..., None], rows, 0).sum(axis=-2)
    if pooling == "mean":
        total = total / jnp.maximum(real.sum(axis=-1, keepdims=True), 1).astype(total.dtype)
    return total


def pooled_lookup(table: jax.Array, ids: jax.Array, pooling: str) -> jax.Array:
    """Bags of rows of ``table`` [rows, dim] for ``ids`` [batch, hot] -> [batch, dim]."""
    return pool(jnp.take(table, jnp.maximum(ids, 0), axis=0), ids, pooling)


class _Bags(nn.Module):
    """What every table module holds: its rows' width and init, how bags pool, the precision,
    and whether the train step updates its rows sparsely."""

    dim: int
    std: float
    pooling: str
    policy: Policy
    sparse: bool = False


class Table(_Bags):
    """One embedding table (a ``RowTable``: row-sparse updates when the train step asks) and
    its pooled bag lookup: ``ids`` [batch, hot] -> [batch, dim]."""

    rows: int = 0

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = RowTable(self.rows, self.dim, self.std, self.policy, TABLE_AXES, self.sparse,
                         name="rows")  # fmt: skip
        rows = table(jnp.maximum(ids, 0))  # [batch, hot, dim]
        # Gathered, then cast: casting the table first would copy all of it every step.
        return pool(rows, ids, self.pooling).astype(self.policy.compute_dtype)


class PlacedTables(_Bags):
    """Every table placed whole in one group of a grouped ``RowTable`` [groups, rows, dim]
    (``place_tables``): ``sparse`` [batch, tables, hot] -> bags [batch, tables, dim]."""

    placement: Placement | None = None

    @nn.compact
    def __call__(self, sparse: jax.Array) -> jax.Array:
        p = self.placement
        ids = nn.with_logical_constraint(placed_ids(p, sparse), PLACED_IDS_AXES)
        table = RowTable(p.rows, self.dim, self.std, self.policy, GROUPED_TABLE_AXES,
                         self.sparse, groups=p.groups, name="rows")  # fmt: skip
        rows = table(jnp.maximum(ids, 0))  # [groups, batch, slots, hot, dim]
        bags = nn.with_logical_constraint(pool(rows, ids, self.pooling), PLACED_BAGS_AXES)
        # The bags leave the devices that hold their tables for those that run their examples'
        # MLPs (one collective: an all-gather over the groups, or an all-to-all when the groups
        # and the batch share the devices); the reordering below is then local.
        bags = nn.with_logical_constraint(bags, (None, "batch", None, "table_dim"))
        order = [g * p.slots + k for g, k in zip(p.group, p.slot, strict=True)]
        bags = bags.transpose(1, 0, 2, 3).reshape(bags.shape[1], p.groups * p.slots, -1)
        bags = jnp.take(bags, np.array(order), axis=1)  # [batch, tables, dim], in table order
        return bags.astype(self.policy.compute_dtype)


class DLRM(nn.Module):
    """``(dense [batch, num_dense] float32, sparse [batch, tables, hot] int32) -> (predictions
    [batch], penalty [batch])``: the penalty is the squared norm of every vector the example
    looked up (its bags, and for ``mf`` its biases), which ``model.l2`` weighs in the loss: the
    per-example L2 regularization of Funk's SVD (and Surprise's), applied to the rows a batch
    reads rather than decaying every row at every step.

    ``target_mean``: ratings are predicted as an offset from this value (the training split's
    mean, kept in the ``target_stats`` collection so a restored model needs no data); None for
    click logits."""

    config: DLRMConfig
    policy: Policy
    target_mean: float | None = None

    @nn.compact
    def __call__(
        self, dense: jax.Array, sparse: jax.Array, *, deterministic: bool = True
    ) -> tuple[jax.Array, jax.Array]:
        del deterministic  # no dropout
        c, policy = self.config, self.policy
        bags: list[jax.Array | None] = [None] * len(c.tables)
        placement = c.placement()
        if placement is not None:
            placed = PlacedTables(
                c.embed_dim, c.init_std, c.pooling, policy, c.sparse_updates, placement=placement,
                name="tables",
            )(sparse[:, np.array(c.placed)])  # fmt: skip
            for i, t in enumerate(c.placed):
                bags[t] = placed[:, i]
        for t, rows in enumerate(c.tables):
            if bags[t] is None:
                table = Table(c.embed_dim, c.init_std, c.pooling, policy, c.sparse_updates,
                              rows=rows, name=f"table_{t}")  # fmt: skip
                bags[t] = table(sparse[:, t])
        penalty = sum((bag.astype(jnp.float32) ** 2).sum(-1) for bag in bags)
        if c.kind == "mf":
            out, bias_penalty = self._factorization(bags, sparse)
            penalty = penalty + bias_penalty
        else:
            out = self._dlrm(dense, bags)
        out = out.astype(jnp.float32)
        if self.target_mean is not None:
            mean0 = self.target_mean
            out = out + self.variable(TARGET_STATS, "mean", lambda: jnp.float32(mean0)).value
        return out, penalty

    def _factorization(
        self, bags: list[jax.Array], sparse: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        c = self.config
        zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), TABLE_AXES)
        biases = [
            self.param(f"bias_{t}", zeros, (rows, 1), self.policy.param_dtype)
            for t, rows in enumerate(c.tables)
        ]
        out = (bags[0] * bags[1]).sum(-1)
        penalty = jnp.zeros_like(out, jnp.float32)
        for t, bias in enumerate(biases):
            b = pooled_lookup(bias, sparse[:, t], c.pooling)[:, 0]
            out, penalty = out + b, penalty + b.astype(jnp.float32) ** 2
        return out, penalty

    def _dlrm(self, dense: jax.Array, bags: list[jax.Array]) -> jax.Array:
        c, policy = self.config, self.policy
        vectors = list(bags)
        if dense.shape[-1]:
            bottom = _mlp(dense.astype(policy.compute_dtype), (*c.bottom, c.embed_dim),
                          policy=policy, name="bottom", last_relu=True)  # fmt: skip
            vectors = [bottom, *vectors]
        stacked = jnp.stack(vectors, axis=1)  # [batch, features, dim]
        if c.interaction == "dot":
            gram = jnp.einsum("bfd,bgd->bfg", stacked, stacked)
            upper = jnp.triu_indices(len(vectors), k=1)
            features = [gram[:, upper[0], upper[1]]]
            if dense.shape[-1]:
                features.insert(0, vectors[0])
            x = jnp.concatenate(features, axis=-1)
        else:
            x = stacked.reshape(stacked.shape[0], -1)
        return _mlp(x, (*c.top, 1), policy=policy, name="top", last_relu=False)[:, 0]


def interaction_width(config: DLRMConfig, num_dense: int) -> int:
    """Width of the top MLP's input."""
    features = len(config.tables) + (1 if num_dense else 0)
    if config.interaction == "cat":
        return features * config.embed_dim
    return features * (features - 1) // 2 + (config.embed_dim if num_dense else 0)


def train_flops(config: DLRMConfig, num_dense: int) -> float:
    """GEMM FLOPs of one example's training step: 3 x forward (multiply-adds x 2) of the MLPs and
    the dot interaction, less the bottom MLP's input gradient, which nothing needs (the dense
    features are data), and less the output layer's input gradient, an outer product (K = 1)
    that XLA rewrites as a broadcast multiply, not a GEMM. Bag sums and table lookups are left
    out: they move bytes, not GEMMs (like the GIN's message sums in ``models/dta.py``)."""
    if config.kind == "mf":
        return 3.0 * 2.0 * config.embed_dim  # the user-item dot product
    flops, first = 0.0, 0.0
    width = num_dense
    if num_dense:
        for out in (*config.bottom, config.embed_dim):
            flops += 3.0 * 2.0 * width * out
            width = out
        first = (
            2.0 * num_dense * config.bottom[0]
            if config.bottom
            else 2.0 * num_dense * config.embed_dim
        )
    features = len(config.tables) + (1 if num_dense else 0)
    if config.interaction == "dot":
        flops += 3.0 * 2.0 * features * features * config.embed_dim
    width = interaction_width(config, num_dense)
    for out in (*config.top, 1):
        flops += 3.0 * 2.0 * width * out
        last_in, width = width, out
    return flops - first - 2.0 * last_in
