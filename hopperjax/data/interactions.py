"""User-item interactions for recommendation: clicks (Criteo) and explicit ratings (MovieLens).

Every source becomes one in-memory ``Interactions`` table of three arrays, so a batch is one
gather (``EpochBatches``):

- ``dense`` float32 [N, num_dense]: continuous features (Criteo's 13 counts as ``log(1 + x)``,
  negatives clamped to 0; none for ratings);
- ``sparse`` int32 [N, tables, hot]: row ids into each embedding table, a bag of ``hot`` ids per
  table (multi-hot), ``PAD_ID`` (-1) in unused slots: a padding id contributes nothing;
- ``labels`` float32 [N]: the click (0/1) or the rating.

Readers:

- ``read_criteo``: Criteo's display-advertising TSV (label, 13 integer fields, 26 hexadecimal
  categorical fields; empty fields allowed). A categorical value is hashed to its table's size
  (``hash(value) % (rows - 1) + 1``; row 0 is the shared "missing" row of an empty field), so any
  table size serves; ``log(1 + x)`` for the integers, an empty integer is 0.
- ``read_movielens``: ``u.data`` and its fold files ``u1.base`` .. ``u5.test`` (tab-separated
  user, item, rating, timestamp; MovieLens-100k's layout), or ``ratings.csv`` (header ``userId,
  movieId,rating,timestamp``; the later MovieLens releases). Ids are table rows as they are (the
  tables need ``max id + 1`` rows); an id beyond its table is an error naming the file, line and
  the key to raise, unless ``hash_ids`` hashes it.
- ``synthetic``: interactions whose ids follow a power law per table and whose click probability
  (or rating) is a known low-rank-plus-bias function of the ids and the dense features, with
  Gaussian noise of a known size for ratings (the RMSE floor a model can reach).

A bad row (wrong field count, a label or number that does not parse, an id out of range) is a
``DataError`` naming the file and line, or, with ``skip_bad``, counted in ``skipped`` and left
out.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax.data import record_shards
from hopperjax.data.errors import DataError, one_line

PAD_ID = -1
CRITEO_DENSE = 13
CRITEO_TABLES = 26


@dataclasses.dataclass(frozen=True)
class Interactions:
    """One split's interactions (see the module docstring for the arrays' meaning);
    ``skipped``: bad rows left out. ``weights`` float32 [N]: 1 for a real row, 0 for the padding
    rows ``padded`` adds (eval masks them)."""

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    skipped: int = 0
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.weights is None:
            object.__setattr__(self, "weights", np.ones(len(self.labels), np.float32))

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def tables(self) -> int:
        return self.sparse.shape[1]

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The rows in ``order`` as one batch (one gather per array)."""
        return {
            "dense": self.dense[order],
            "sparse": self.sparse[order],
            "labels": self.labels[order],
            "weights": self.weights[order],
        }

    def take(self, order: np.ndarray) -> Interactions:
        return Interactions(
            self.dense[order], self.sparse[order], self.labels[order], self.skipped,
            self.weights[order],
        )  # fmt: skip

    def padded(self, multiple: int) -> Interactions:
        """Grown to a multiple of ``multiple`` with all-padding rows of weight 0."""
        extra = -len(self) % multiple
        if not extra:
            return self
        return Interactions(
            np.concatenate([self.dense, np.zeros((extra, self.dense.shape[1]), np.float32)]),
            np.concatenate([self.sparse, np.full((extra, *self.sparse.shape[1:]), PAD_ID,
                                                 np.int32)]),
            np.concatenate([self.labels, np.zeros(extra, np.float32)]),
            self.skipped,
            np.concatenate([self.weights, np.zeros(extra, np.float32)]),
        )  # fmt: skip

    def check_ids(self, table_sizes: tuple[int, ...], name: str) -> None:
        """Raises DataError if an id of table t is not below ``table_sizes[t]``."""
        if len(table_sizes) != self.tables:
            raise DataError(f"{name}: {self.tables} tables, but {len(table_sizes)} table sizes")
        for t, rows in enumerate(table_sizes):
            top = int(self.sparse[:, t].max(initial=PAD_ID))
            if top >= rows:
                raise DataError(
                    f"{name}: table {t} needs {top + 1} rows (its largest id is {top}), "
                    f"the model has {rows}"
                )


def _read_lines(path: Path) -> list[bytes]:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({one_line(e)})") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if lines and lines[-1].endswith(b"\r"):
        lines = [line.rstrip(b"\r") for line in lines]
    if not lines:
        raise DataError(f"{path}: empty")
    return lines


def hash_id(value: bytes, rows: int) -> int:
    """A categorical value's row in a table of ``rows`` (row 0 is kept for empty fields):
    CRC-32, the same on every process, platform and run (Python's ``hash`` is salted)."""
    return zlib.crc32(value) % (rows - 1) + 1 if rows > 1 else 0


def iter_criteo(
    path: str | Path, table_sizes: tuple[int, ...], *, skip_bad: bool = False,
    chunk_rows: int = 1 << 20,
):  # fmt: skip
    """Criteo's TSV (``.gz`` too), ``chunk_rows`` lines at a time (a file of any size streams):
    ``Interactions`` chunks, each with the bad lines it skipped. One row per line: ``label``
    then 13 integers then 26 hexadecimal categories, tab-separated; categories hashed to
    ``table_sizes`` (26 sizes)."""
    path = Path(path)
    if len(table_sizes) != CRITEO_TABLES:
        raise DataError(f"Criteo has {CRITEO_TABLES} tables, got {len(table_sizes)} table sizes")
    fields = 1 + CRITEO_DENSE + CRITEO_TABLES
    labels, dense, sparse, skipped, seen = [], [], [], 0, 0

    def chunk() -> Interactions:
        return Interactions(
            np.log1p(np.asarray(dense, np.float32).reshape(-1, CRITEO_DENSE)),
            np.asarray(sparse, np.int32).reshape(-1, CRITEO_TABLES, 1),
            np.asarray(labels, np.float32),
            skipped,
        )

    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                seen += 1
                parts = line.rstrip(b"\r\n").split(b"\t")
                try:
                    if len(parts) != fields:
                        raise ValueError(f"{len(parts)} tab-separated fields, expected {fields}")
                    label = int(parts[0])
                    if label not in (0, 1):
                        raise ValueError(f"label {label}, expected 0 or 1")
                    counts = [max(int(x), 0) if x else 0 for x in parts[1 : 1 + CRITEO_DENSE]]
                    cats = parts[1 + CRITEO_DENSE :]
                    for x in cats:
                        if x:
                            int(x, 16)  # a category must be hexadecimal
                except ValueError as e:
                    if skip_bad:
                        skipped += 1
                        continue
                    raise DataError(f"{path} line {number}: {one_line(e)}") from None
                labels.append(label)
                dense.append(counts)
                sparse.append(
                    [
                        hash_id(x, rows) if x else 0
                        for x, rows in zip(cats, table_sizes, strict=True)
                    ]
                )
                if len(labels) == chunk_rows:
                    yield chunk()
                    labels, dense, sparse, skipped = [], [], [], 0
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({one_line(e)})") from None
    if not seen:
        raise DataError(f"{path}: empty")
    if labels or skipped:
        yield chunk()


def read_criteo(
    path: str | Path, table_sizes: tuple[int, ...], *, skip_bad: bool = False
) -> Interactions:
    """All of a Criteo TSV in memory (``iter_criteo``'s chunks joined)."""
    chunks = list(iter_criteo(path, table_sizes, skip_bad=skip_bad))
    rows = concatenate(chunks)
    if not len(rows):
        raise DataError(f"{path}: no valid rows ({rows.skipped} skipped)")
    return rows


def concatenate(chunks: list[Interactions]) -> Interactions:
    return Interactions(
        np.concatenate([c.dense for c in chunks]),
        np.concatenate([c.sparse for c in chunks]),
        np.concatenate([c.labels for c in chunks]),
        sum(c.skipped for c in chunks),
        np.concatenate([c.weights for c in chunks]),
    )


def read_movielens(
    path: str | Path, table_sizes: tuple[int, int], *, hash_ids: bool = False,
    skip_bad: bool = False,
) -> Interactions:  # fmt: skip
    """MovieLens ratings: ``u.data``-style (tab-separated, no header) or ``ratings.csv``
    (comma-separated, with its header); tables: users, items."""
    path = Path(path)
    lines = _read_lines(path)
    csv = path.name.endswith((".csv", ".csv.gz"))
    first = 1
    if csv:
        header = lines[0].decode("utf-8", "replace").strip().lower().split(",")
        if header[:3] != ["userid", "movieid", "rating"]:
            raise DataError(f"{path} line 1: expected the header userId,movieId,rating,...")
        lines, first = lines[1:], 2
    separator = b"," if csv else b"\t"
    ids, labels, skipped = [], [], 0
    for number, line in enumerate(lines, first):
        parts = line.split(separator)
        try:
            if len(parts) < 3:
                raise ValueError(f"{len(parts)} fields, expected user, item, rating[, time]")
            row = [int(parts[0]), int(parts[1])]
            rating = float(parts[2])
            if not math.isfinite(rating):
                raise ValueError(f"rating {parts[2].decode(errors='replace')}")
            for t, (value, rows) in enumerate(zip(row, table_sizes, strict=False)):
                if value < 0:
                    raise ValueError(f"negative id {value}")
                if hash_ids:
                    row[t] = hash_id(str(value).encode(), rows)
                elif value >= rows:
                    key = "model.table_sizes"
                    raise ValueError(
                        f"{('user', 'item')[t]} id {value} is beyond the {rows} rows of table "
                        f"{t} ({key}; or data.hash_ids=true)"
                    )
        except ValueError as e:
            if skip_bad:
                skipped += 1
                continue
            raise DataError(f"{path} line {number}: {one_line(e)}") from None
        ids.append(row)
        labels.append(rating)
    if not labels:
        raise DataError(f"{path}: no valid rows ({skipped} skipped)")
    return Interactions(
        np.zeros((len(labels), 0), np.float32),
        np.asarray(ids, np.int32)[:, :, None],
        np.asarray(labels, np.float32),
        skipped,
    )


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """What ``synthetic`` generates: ``rows`` interactions over tables of ``table_sizes`` rows,
    ``hot`` ids per table (multi-hot bags; a bag has 1 to ``hot`` ids, the rest padding),
    ``num_dense`` features, ids drawn with probability ~ rank ** -``zipf``, a hidden structure of
    ``rank`` factors; ``task`` clicks (Bernoulli of the sigmoid) or ratings (a value around 3.5
    plus Gaussian noise of std ``noise``)."""

    rows: int
    table_sizes: tuple[int, ...]
    hot: int = 1
    num_dense: int = 0
    rank: int = 4
    zipf: float = 1.05
    task: str = "ratings"
    noise: float = 0.5


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: uint64 -> well-mixed uint64, elementwise."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _hashed_normal(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed standard normal per (id, salt), from a hash (Box-Muller): a table's hidden
    vectors without materializing the table, so tables of 40M rows cost nothing up front."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt * 0x632BE5AB)
    a, b = _mix(x), _mix(x ^ np.uint64(0xD1B54A32D192ED03))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
    u2 = (b >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _power_law_ranks(rng: np.random.Generator, size: int, exponent: float, shape) -> np.ndarray:
    """Popularity ranks 0..size-1 with P(rank r) ~ (r + 1) ** -exponent (continuous inverse-CDF
    sampling, floored: O(samples), whatever ``size``)."""
    u = rng.random(shape)
    if abs(exponent - 1.0) < 1e-9:
        r = np.exp(u * np.log(size + 1.0))
    else:
        a = 1.0 - exponent
        r = (u * ((size + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a)
    return np.minimum(np.floor(r).astype(np.int64) - 1, size - 1)


def _popular_id(ranks: np.ndarray, size: int, table: int) -> np.ndarray:
    """The id of each popularity rank: a fixed affine permutation of 0..size-1 per table (popular
    ids are not 0..k, and which ids are popular is part of the structure)."""
    step = int(_mix(np.array([table + 1], np.uint64))[0] % np.uint64(size)) | 1
    while math.gcd(step, size) != 1:
        step += 2
    return (ranks * step + 7919 * table) % size


def synthetic(spec: SyntheticSpec, seed: int) -> Interactions:
    """Interactions from ``spec``. The hidden structure (each id's factors and bias, which ids
    are popular, the dense features' weights) is fixed; ``seed`` draws the interactions, so a
    training and a held-out set drawn with different seeds share the structure. Memory and time
    are O(rows x tables x hot), whatever the table sizes."""
    rng = np.random.default_rng(seed + 1)
    n, tables, hot, rank = spec.rows, len(spec.table_sizes), spec.hot, spec.rank
    sparse = np.full((n, tables, hot), PAD_ID, np.int32)
    pooled = np.zeros((n, tables, rank))
    bias = np.zeros(n)
    for t, size in enumerate(spec.table_sizes):
        rows = _popular_id(_power_law_ranks(rng, size, spec.zipf, (n, hot)), size, t)
        length = rng.integers(1, hot + 1, n)
        used = np.arange(hot)[None, :] < length[:, None]
        sparse[:, t] = np.where(used, rows, PAD_ID)
        factors = np.stack(
            [_hashed_normal(rows, 1000 * t + k) for k in range(rank)], axis=-1
        ) / math.sqrt(rank)  # [n, hot, rank]
        pooled[:, t] = (factors * used[..., None]).sum(1) / length[:, None]
        bias += (0.3 * _hashed_normal(rows, 1000 * t + 999) * used).sum(1) / length
    weights = 0.3 * _hashed_normal(np.arange(spec.num_dense), 10**6)
    dense = np.abs(rng.normal(0, 1, (n, spec.num_dense))).astype(np.float32)
    # Pairwise factor interactions between consecutive tables (users x items for two tables).
    score = bias + dense @ weights
    for t in range(tables - 1):
        score += (pooled[:, t] * pooled[:, t + 1]).sum(-1) * 2.0
    if spec.task == "clicks":
        labels = rng.random(n) < 1 / (1 + np.exp(-(score - 1.0)))
    else:
        labels = 3.5 + score + rng.normal(0, spec.noise, n)
    return Interactions(dense, sparse, labels.astype(np.float32))


# ----------------------------------------------------------------------------------------------
# ArrayRecord shards (tools/convert_interactions.py): one fixed-size record per interaction.

SHARDS_FORMAT = "hopperjax-interaction-shards/1"


def _layout(num_dense: int, tables: int, hot: int) -> np.dtype:
    return np.dtype(
        [("dense", "<f4", (num_dense,)), ("sparse", "<i4", (tables, hot)), ("label", "<f4")]
    )


def encode_records(rows: Interactions) -> list[bytes]:
    """One record per interaction: dense float32, ids int32, label float32, little-endian."""
    packed = np.empty(len(rows), _layout(rows.dense.shape[1], rows.tables, rows.sparse.shape[2]))
    packed["dense"], packed["sparse"], packed["label"] = rows.dense, rows.sparse, rows.labels
    return [packed[i].tobytes() for i in range(len(rows))]


def write_interaction_shards(
    chunks: Iterable[Interactions], out_dir: str | Path, *, table_sizes: tuple[int, ...],
    source: str = "", split: str = "all",
) -> dict[str, Any]:  # fmt: skip
    """Every chunk as one shard of ``split`` (a stream of chunks: a file of any size), with a
    ``dataset.json`` naming the layout and the table sizes the ids were hashed to."""
    # Filled in as the chunks stream by; write_shards writes it after the last shard.
    meta: dict[str, Any] = {"format": SHARDS_FORMAT, "source": source,
                            "table_sizes": list(table_sizes)}  # fmt: skip
    skipped = [0]

    def shards():
        for rows in chunks:
            skipped[0] += rows.skipped
            layout = {"num_dense": rows.dense.shape[1], "tables": rows.tables,
                      "hot": rows.sparse.shape[2]}  # fmt: skip
            if "tables" in meta and any(meta[k] != v for k, v in layout.items()):
                raise DataError(f"chunks of different layouts: {meta} and {layout}")
            meta.update(layout)
            if len(rows):
                yield encode_records(rows)

    return record_shards.write_shards(
        out_dir, {split: shards()}, meta=meta, counts=lambda _: {"skipped": skipped[0]}
    )


@dataclasses.dataclass(frozen=True)
class InteractionRecords:
    """The interactions of one shard split, read a batch at a time (a source for
    ``EpochBatches``, like ``Interactions``). ``order[i]`` is the record behind row ``i``; -1 is
    an all-padding row of weight 0."""

    reader: record_shards.SplitReader
    order: np.ndarray
    layout: tuple[int, int, int]  # num_dense, tables, hot
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.order)

    @property
    def tables(self) -> int:
        return self.layout[1]

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        ids = self.order[np.asarray(order, np.int64)]
        num_dense, tables, hot = self.layout
        out = {
            "dense": np.zeros((len(ids), num_dense), np.float32),
            "sparse": np.full((len(ids), tables, hot), PAD_ID, np.int32),
            "labels": np.zeros(len(ids), np.float32),
            "weights": (ids >= 0).astype(np.float32),
        }
        real = np.flatnonzero(ids >= 0)
        if not real.size:
            return out
        layout = _layout(*self.layout)
        joined = b"".join(self.reader.read(ids[real]))
        if len(joined) != layout.itemsize * real.size:
            where = Path(self.reader.paths[0]).parent
            raise DataError(f"{where}: damaged records (not {layout.itemsize} bytes each)")
        packed = np.frombuffer(joined, layout)
        out["dense"][real], out["sparse"][real] = packed["dense"], packed["sparse"]
        out["labels"][real] = packed["label"]
        return out

    def take(self, order: np.ndarray) -> InteractionRecords:
        return dataclasses.replace(self, order=self.order[order])

    def padded(self, multiple: int) -> InteractionRecords:
        extra = -len(self) % multiple
        return dataclasses.replace(self, order=np.concatenate([self.order, np.full(extra, -1)]))

    def load(self) -> Interactions:
        """Every row read into memory."""
        b = self.batch(np.arange(len(self)))
        return Interactions(b["dense"], b["sparse"], b["labels"], self.skipped, b["weights"])

    def check_ids(self, table_sizes: tuple[int, ...], name: str) -> None:
        """Nothing to scan: ``read_interaction_shards`` checked the sizes the ids were hashed to."""
        del table_sizes, name


def read_interaction_shards(
    directory: str | Path, table_sizes: tuple[int, ...], split: str = "all"
) -> InteractionRecords:
    """A ``write_interaction_shards`` split. DataError names the directory or file (see
    ``record_shards``), or the table sizes when they differ from those the ids were hashed to."""
    meta = record_shards.read_meta(directory, SHARDS_FORMAT, "tools/convert_interactions.py")
    reader = record_shards.open_split(directory, meta, split)
    try:
        layout = (int(meta["num_dense"]), int(meta["tables"]), int(meta["hot"]))
        hashed = tuple(int(x) for x in meta["table_sizes"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{directory}: a bad {record_shards.META_NAME} ({one_line(e)})") from None
    if hashed != tuple(table_sizes):
        raise DataError(
            f"{directory}: its ids were hashed to tables of {','.join(map(str, hashed))} rows; "
            f"set model.table_sizes to that, or convert again"
        )
    skipped = int(meta["splits"][split].get("skipped", 0))
    return InteractionRecords(reader, np.arange(len(reader)), layout, skipped)


__all__ = [
    "CRITEO_DENSE",
    "CRITEO_TABLES",
    "PAD_ID",
    "SHARDS_FORMAT",
    "InteractionRecords",
    "Interactions",
    "SyntheticSpec",
    "concatenate",
    "encode_records",
    "hash_id",
    "iter_criteo",
    "read_criteo",
    "read_interaction_shards",
    "read_movielens",
    "synthetic",
    "write_interaction_shards",
]
