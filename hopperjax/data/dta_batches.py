"""Pairs of drugs and proteins as grain sources, their epoch order, and per-batch dedup.

``PairSource`` serves pairs from token tables that hold each molecule once; ``PairSubset`` picks a
split's pairs (with weights for eval padding); ``GroupedOrder`` orders an epoch molecule by
molecule so a batch touches few of them; ``dedup_batch`` and ``batch_from_ids`` turn a batch of
pairs into its distinct molecules plus per-pair indices, which is what the DTA model encodes
(``models/dta.py``); ``to_model_batch`` makes the model's batch of one process's block of a global
batch (tables sized by ``table_rows``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

TABLE_ROW_MULTIPLE = 8  # distinct-row tables are padded to this, so they shard over the devices


class _PairIndex:
    """Per pair: the drug's and the protein's row in the token tables, and the affinity."""

    def __init__(self, drug_index: np.ndarray, protein_index: np.ndarray, affinity: np.ndarray):
        self._drug_index = np.asarray(drug_index, np.int64)
        self._protein_index = np.asarray(protein_index, np.int64)
        self._affinity = np.asarray(affinity, np.float32)
        if not len(self._drug_index) == len(self._protein_index) == len(self._affinity):
            raise ValueError("drug_index, protein_index and affinity differ in length")

    def __len__(self) -> int:
        return len(self._affinity)

    def affinities(self, indices: np.ndarray) -> np.ndarray:
        """The affinities of pairs ``indices`` (the training split's statistics)."""
        return self._affinity[np.asarray(indices, np.int64)]


class PairIds(_PairIndex):
    """grain random-access source of pairs as molecule ids: item ``i`` is {"drug_id",
    "protein_id": [] int64, "affinity": [] float32}. With the token tables in memory the batch
    step gathers each distinct molecule's tokens once (``batch_from_ids``), so the pipeline
    never copies a token row per pair (a Davis protein row is 4.8 kB)."""

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.take(i)

    def take(self, i: int | np.ndarray) -> dict[str, np.ndarray]:
        """Item ``i``, or for an array of indices the batch of those items (vectorized)."""
        return {
            "drug_id": self._drug_index[i],
            "protein_id": self._protein_index[i],
            "affinity": self._affinity[i],
        }


class PairSource(_PairIndex):
    """grain random-access source of single pairs as token rows (what shards hold), from token
    tables and pair indices: item ``i`` is {"drug": [Ld] int32, "protein": [Lp] int32,
    "affinity": [] float32}. The tables hold each molecule once, so the source stays small when
    grain pickles it to workers.
    """

    def __init__(
        self,
        drug_tokens: np.ndarray,
        protein_tokens: np.ndarray,
        drug_index: np.ndarray,
        protein_index: np.ndarray,
        affinity: np.ndarray,
    ):
        super().__init__(drug_index, protein_index, affinity)
        self._drug_tokens = np.asarray(drug_tokens, np.int32)
        self._protein_tokens = np.asarray(protein_tokens, np.int32)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {
            "drug": self._drug_tokens[self._drug_index[i]],
            "protein": self._protein_tokens[self._protein_index[i]],
            "affinity": self._affinity[i],
        }


def _padded_table(distinct: np.ndarray, rows: int, what: str) -> np.ndarray:
    """``distinct`` rows (of tokens, or of any per-molecule array), padded with zero rows to
    ``rows`` (static shapes under jit)."""
    if len(distinct) > rows:
        raise ValueError(
            f"the batch has {len(distinct)} distinct {what}s but the table has {rows} rows; "
            f"size it as min(batch size, distinct {what}s in the data)"
        )
    table = np.zeros((rows, *distinct.shape[1:]), distinct.dtype)
    table[: len(distinct)] = distinct
    return table


def batch_from_ids(
    batch: dict[str, np.ndarray],
    drug_tokens: np.ndarray,
    protein_tokens: np.ndarray,
    *,
    drug_rows: int,
    protein_rows: int,
    dedup: bool,
    drug_graphs: Callable[[np.ndarray, int], dict[str, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """A batch of ``PairIds`` items -> the model's tables and per-pair indices, as
    ``dedup_batch`` makes them from token rows (``dedup=False``: one table row per pair).

    ``drug_graphs``: ``(drug ids, rows) ->`` the drug table as one graph (``mol_graphs.batch_graph``
    with the data's graphs and slots bound), which replaces ``drug_tokens``."""
    out = {"affinity": np.asarray(batch["affinity"], np.float32)}
    for what, tokens, rows in (
        ("drug", drug_tokens, drug_rows),
        ("protein", protein_tokens, protein_rows),
    ):
        ids = np.asarray(batch[f"{what}_id"])
        distinct, index = (
            np.unique(ids, return_inverse=True) if dedup else (ids, np.arange(len(ids)))
        )
        if what == "drug" and drug_graphs is not None:
            out.update(drug_graphs(distinct, rows))
        else:
            out[f"{what}_tokens"] = _padded_table(tokens[distinct], rows, what)
        out[f"{what}_index"] = index.reshape(-1).astype(np.int32)
    return out


class PairSubset:
    """grain random-access source of ``pairs[indices[i]]``, each item with a "weight" (default 1;
    0 marks a padding pair that the loss and the scores ignore). ``pairs``: any source of pairs
    (``PairIds``, ``PairSource``, ``dta_shards.ArrayRecordPairs``)."""

    def __init__(self, pairs, indices: np.ndarray, weight: np.ndarray | None = None):
        self._pairs = pairs
        self._indices = np.asarray(indices, np.int64)
        self._weight = (
            np.ones(len(self._indices), np.float32)
            if weight is None
            else np.asarray(weight, np.float32)
        )
        if len(self._weight) != len(self._indices):
            raise ValueError("indices and weight differ in length")
        if len(self._indices) and not 0 <= self._indices.min() <= self._indices.max() < len(pairs):
            raise ValueError(f"indices out of range for {len(pairs)} pairs")

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {**self._pairs[int(self._indices[i])], "weight": self._weight[i]}

    @property
    def vectorized(self) -> bool:
        """Whether ``take`` can build a whole batch at once (the pairs have a ``take``)."""
        return hasattr(self._pairs, "take")

    def take(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of items at ``positions``, in one gather: no per-pair Python work."""
        positions = np.asarray(positions, np.int64)
        return {**self._pairs.take(self._indices[positions]), "weight": self._weight[positions]}


class GroupedOrder:
    """grain source of pair positions in an order that keeps each group's pairs together.

    Epoch ``e`` visits the groups in a random order and each group's pairs in a random order,
    both drawn from ``(seed, e)``, so that consecutive items share few groups: a batch of B pairs
    cut from it touches at most ``max_groups_per_batch(B)`` distinct groups (proteins, say) where
    a uniform shuffle touches up to B. A model that encodes each distinct molecule of a batch once
    then encodes a handful instead of hundreds. Item ``i`` is the position (into ``groups``) of
    the ``i % n``-th pair of epoch ``i // n``; the length spans many epochs, for ``repeat``-free
    use, and each worker rebuilds an epoch's order from the seed, so checkpointed iterator states
    resume exactly.

    ``mix`` > 1 visits the groups ``mix`` at a time and shuffles the pairs of those groups
    together, so a batch holds pairs of at least about ``mix`` groups: fewer groups per batch is
    cheaper, more is closer to an i.i.d. batch (a dataset with few, large groups otherwise puts one
    or two groups in each batch). ``mix=1`` is the plain grouped order.
    """

    EPOCHS = 1 << 20

    def __init__(self, groups: np.ndarray, seed: int, mix: int = 1):
        self._groups = np.asarray(groups, np.int64)
        if not len(self._groups):
            raise ValueError("no pairs to order")
        if mix < 1:
            raise ValueError(f"mix must be >= 1, got {mix}")
        self._seed = seed
        self._mix = mix
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._groups) * self.EPOCHS

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, epoch])
        _, group_rank = np.unique(self._groups, return_inverse=True)
        group_key = rng.permutation(group_rank.max() + 1)[group_rank] // self._mix
        return np.lexsort((rng.random(len(self._groups)), group_key))

    def __getitem__(self, i: int) -> int:
        epoch, position = divmod(int(i), len(self._groups))
        orders = self._orders  # grain reads with threads: work on one snapshot of the cache
        order = orders.get(epoch)
        if order is None:
            order = self.epoch_order(epoch)
            # The two newest epochs: reads that straddle an epoch boundary stay cached.
            self._orders = {e: o for e, o in orders.items() if e >= epoch - 1} | {epoch: order}
        return int(order[position])

    def max_groups_per_batch(self, batch: int) -> int:
        """The most distinct groups any ``batch`` consecutive items can hold: the partly covered
        groups of a mixed set at each end (``mix`` each) and, between them, as many whole groups
        as the smallest ones allow."""
        sizes = np.sort(np.unique(self._groups, return_counts=True)[1])
        whole = int(np.searchsorted(np.cumsum(sizes), max(batch - 2, 0), side="right"))
        return min(whole + 2 * self._mix, len(sizes), batch)


def _distinct_rows(rows: np.ndarray, cap: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    # Keyed on each row's bytes, in first-seen order: ~30x faster than np.unique(axis=0), whose
    # lexicographic sort of 4,096 x 1,200 token rows costs half a second per batch.
    first: dict[bytes, int] = {}
    where: list[int] = []
    inverse = np.empty(len(rows), np.int32)
    for i, row in enumerate(rows):
        key = row.tobytes()
        slot = first.get(key)
        if slot is None:
            slot = first[key] = len(where)
            where.append(i)
        inverse[i] = slot
    return _padded_table(rows[where], cap, what), inverse


def dedup_batch(
    batch: dict[str, np.ndarray], *, drug_rows: int, protein_rows: int
) -> dict[str, np.ndarray]:
    """A batch of pairs -> its distinct drugs and proteins once each, and per-pair indices.

    The model then encodes each distinct molecule once per batch and gathers per pair; the tables
    are zero-padded to fixed row counts so that every batch has the same shapes under jit.

    Args:
      batch: {"drug": [B, Ld], "protein": [B, Lp], "affinity": [B]}.
      drug_rows, protein_rows: rows of the distinct-molecule tables.

    Returns:
      {"drug_tokens": [drug_rows, Ld], "protein_tokens": [protein_rows, Lp], "drug_index": [B]
      int32, "protein_index": [B] int32, "affinity": [B] float32}, with
      ``drug_tokens[drug_index] == batch["drug"]`` (and the same for proteins).

    Raises:
      ValueError: the batch has more distinct drugs than ``drug_rows`` (or proteins than
        ``protein_rows``).
    """
    drug_tokens, drug_index = _distinct_rows(np.asarray(batch["drug"]), drug_rows, "drug")
    protein_tokens, protein_index = _distinct_rows(
        np.asarray(batch["protein"]), protein_rows, "protein"
    )
    return {
        "drug_tokens": drug_tokens,
        "protein_tokens": protein_tokens,
        "drug_index": drug_index,
        "protein_index": protein_index,
        "affinity": np.asarray(batch["affinity"], np.float32),
    }


def table_rows(local_batch: int, distinct: int, deduplicate: bool) -> int:
    """Rows of a per-process distinct-drug (or protein) table for ``local_batch`` pairs."""
    rows = min(local_batch, distinct) if deduplicate else local_batch
    return -(-rows // TABLE_ROW_MULTIPLE) * TABLE_ROW_MULTIPLE


def to_model_batch(
    batch: dict[str, np.ndarray],
    *,
    drug_rows: int,
    protein_rows: int,
    block: int,
    dedup: bool,
    tokens: tuple[np.ndarray, np.ndarray] | None = None,
    graphs: Callable[[np.ndarray, int], dict[str, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """A batch of pairs -> distinct-row tables + per-pair indices (offset to this process's block
    of the global tables). Pairs come as token rows, or as molecule ids with ``tokens`` (the drug
    and protein token tables) to gather from, and ``graphs`` for ``gin``: ``(drug ids, rows) ->``
    the drugs as one graph (``mol_graphs.batch_graph`` with the data's graphs bound)."""
    if tokens is not None:
        out = batch_from_ids(
            batch,
            *tokens,
            drug_rows=drug_rows,
            protein_rows=protein_rows,
            dedup=dedup,
            drug_graphs=graphs,
        )
    elif dedup:
        out = dedup_batch(
            {k: batch[k] for k in ("drug", "protein", "affinity")},
            drug_rows=drug_rows,
            protein_rows=protein_rows,
        )
    else:
        pairs = len(batch["affinity"])
        out = {
            "drug_tokens": _pad_rows(batch["drug"], drug_rows),
            "protein_tokens": _pad_rows(batch["protein"], protein_rows),
            "drug_index": np.arange(pairs, dtype=np.int32),
            "protein_index": np.arange(pairs, dtype=np.int32),
            "affinity": batch["affinity"].astype(np.float32),
        }
    out["drug_index"] = (out["drug_index"] + block * drug_rows).astype(np.int32)
    if "drug_graph" in out:  # atom slots and rows of this block of the global graph
        real = out["drug_graph"] >= 0
        out["drug_graph"][real] += block * drug_rows
        bonded = out["drug_bonds"][:, 0] >= 0
        out["drug_bonds"][bonded, :2] += block * len(out["drug_atoms"])
    out["protein_index"] = (out["protein_index"] + block * protein_rows).astype(np.int32)
    out["weight"] = batch["weight"].astype(np.float32)
    return out


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)])
