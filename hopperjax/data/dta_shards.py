"""ArrayRecord shards of drug-target pairs: the DTA workload's input at scale (``dta_shards``).

``write_shards`` tokenizes a ``DtaTable`` once and writes one record per pair, plus a
``dataset.json`` that describes the set (shard count, pairs, distinct molecules, token lengths,
and the DeepDTA folds as contiguous record ranges). grain reads the shards by random access, with
worker processes, so a run over millions of pairs never holds the pairs in memory; the trainer
takes its splits from the ranges, so a DeepDTA directory converted to shards trains and evaluates
on exactly the pairs it would read from the directory.

A directory is complete when ``dataset.json`` is there: the writer removes it first and writes it
last (atomically), so an interrupted conversion never reads as a dataset.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hopperjax import files
from hopperjax.data.molecules import DataError, DtaTable, Tokenizer, tokenize_table

META_NAME = "dataset.json"
FORMAT = "hopperjax-dta-shards/1"

# One record per pair: this header, then the drug's and the protein's tokens without their zero
# padding (uint8 when the vocabulary fits, else int32). A Davis record takes ~630 bytes on disk
# (ArrayRecord's default zstd included), against 5,140 for the two padded int32 rows.
_RECORD = struct.Struct("<4sB3xIIIIf")  # magic, token bytes, drug max/len, protein max/len, y
_MAGIC = b"DTA1"
_SHARD = re.compile(r"pairs-(\d{5})-of-(\d{5})\.array_record")


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """What ``dataset.json`` says about a complete shard directory.

    ``splits``: DeepDTA's ``fold0`` .. ``foldK`` and ``test`` as [start, end) record ranges, or
    None when the source had no folds.
    """

    paths: list[str]
    source: str
    pairs: int
    drugs: int
    proteins: int
    drug_max_len: int
    protein_max_len: int
    skipped: int
    splits: dict[str, tuple[int, int]] | None
    pkd: bool | None = None  # as ``DtaTable.pkd``; None also for sets written before it was kept
    unknown_chars: dict[str, str] | None = None  # tokenizer policies at conversion (a record)

    @property
    def train_folds(self) -> list[np.ndarray] | None:
        if self.splits is None:
            return None
        folds = sorted((k for k in self.splits if k.startswith("fold")), key=lambda k: int(k[4:]))
        return [np.arange(*self.splits[k]) for k in folds]

    @property
    def test_fold(self) -> np.ndarray | None:
        return None if self.splits is None else np.arange(*self.splits["test"])


def _token_bytes(tokens: np.ndarray, dtype: type) -> list[bytes]:
    lengths = np.count_nonzero(tokens, axis=1)  # ids are > 0 up to the padding
    return [row[:n].astype(dtype).tobytes() for row, n in zip(tokens, lengths, strict=True)]


def _split_order(table: DtaTable) -> tuple[np.ndarray, dict[str, tuple[int, int]] | None]:
    """Pair order that makes every DeepDTA fold a contiguous range, and those ranges."""
    if table.train_folds is None:
        return np.arange(len(table.affinity)), None
    parts = {f"fold{i}": np.asarray(f, np.int64) for i, f in enumerate(table.train_folds)}
    parts["test"] = np.asarray(table.test_fold, np.int64)
    order, splits, start = [], {}, 0
    for name, indices in parts.items():
        order.append(indices)
        splits[name] = (start, start + len(indices))
        start += len(indices)
    rest = np.setdiff1d(np.arange(len(table.affinity)), np.concatenate(order))
    return np.concatenate([*order, rest]), splits  # pairs in no split go last, in no range


def write_shards(
    table: DtaTable,
    drug_tokenizer: Tokenizer,
    protein_tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    num_shards: int,
) -> ShardSet:
    """Tokenizes ``table`` and writes one record per pair into ``num_shards`` ArrayRecord files.

    Records follow the folds (fold0, ..., test; the table's order without folds), in contiguous
    runs per shard; grain shuffles at read time. Each file is written under a temporary name,
    synced and renamed. ``dataset.json`` goes first out of and last into ``out_dir``, and shards
    of an earlier conversion with another shard count are removed, so the directory holds one
    complete set or reads as incomplete.
    """
    # Imported here: ArrayRecord is needed only to write shards, and not every platform has it.
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    drug_tokens, protein_tokens, table = tokenize_table(table, drug_tokenizer, protein_tokenizer)
    small = max(drug_tokenizer.vocab_size, protein_tokenizer.vocab_size) <= 256
    dtype, itemsize = (np.uint8, 1) if small else (np.int32, 4)
    drugs, proteins = _token_bytes(drug_tokens, dtype), _token_bytes(protein_tokens, dtype)
    drug_max, protein_max = drug_tokens.shape[1], protein_tokens.shape[1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_NAME).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp"):  # left by a killed conversion
        stale.unlink()
    files.fsync_directory(out)  # the set reads as incomplete from here on, even after a power loss
    order, splits = _split_order(table)
    pairs = len(order)
    num_shards = min(num_shards, pairs)
    bounds = np.linspace(0, pairs, num_shards + 1).astype(np.int64)
    paths = []
    for k in range(num_shards):
        path = out / f"pairs-{k:05d}-of-{num_shards:05d}.array_record"

        def write(temp: Path, k: int = k) -> None:
            writer = ArrayRecordWriter(str(temp), "group_size:1")  # grain reads single records
            try:
                for i in order[bounds[k] : bounds[k + 1]]:
                    d, p = int(table.drug_index[i]), int(table.protein_index[i])
                    header = _RECORD.pack(
                        _MAGIC,
                        itemsize,
                        drug_max,
                        len(drugs[d]) // itemsize,
                        protein_max,
                        len(proteins[p]) // itemsize,
                        table.affinity[i],
                    )
                    writer.write(header + drugs[d] + proteins[p])
            finally:
                writer.close()

        files.atomic_write(path, write)
        paths.append(path)
    for old in out.iterdir():
        if _SHARD.fullmatch(old.name) and old not in paths:
            old.unlink()
    files.fsync_directory(out)  # shard names and removals are durable before the set is declared
    meta = {
        "format": FORMAT,
        "source": table.source,
        "shards": num_shards,
        "pairs": pairs,
        "drugs": len(table.drugs),
        "proteins": len(table.proteins),
        "drug_max_len": drug_max,
        "protein_max_len": protein_max,
        "skipped": table.skipped,
        "splits": splits,
        "pkd": table.pkd,
        "unknown_chars": {"drug": drug_tokenizer.unknown, "protein": protein_tokenizer.unknown},
    }
    files.atomic_write(out / META_NAME, lambda temp: temp.write_text(json.dumps(meta, indent=1)))
    return read_shards(out)


def read_shards(directory: str | Path) -> ShardSet:
    """The shard set a ``write_shards`` directory holds.

    Raises: DataError naming the directory or file: no ``dataset.json`` (not a shard directory,
    or an interrupted conversion), a foreign format, or a missing shard.
    """
    root = Path(directory)
    meta_path = root / META_NAME
    if not root.is_dir():
        raise DataError(f"{root}: not a directory")
    if not meta_path.is_file():
        raise DataError(
            f"{root}: no {META_NAME}; not a shard directory, or its conversion did not finish"
        )
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        n = int(meta["shards"])
        splits = meta["splits"]
        shard_set = ShardSet(
            paths=[str(root / f"pairs-{k:05d}-of-{n:05d}.array_record") for k in range(n)],
            source=str(meta["source"]),
            pairs=int(meta["pairs"]),
            drugs=int(meta["drugs"]),
            proteins=int(meta["proteins"]),
            drug_max_len=int(meta["drug_max_len"]),
            protein_max_len=int(meta["protein_max_len"]),
            skipped=int(meta["skipped"]),
            splits=None if splits is None else {k: tuple(v) for k, v in splits.items()},
            pkd=meta.get("pkd"),
            unknown_chars=meta.get("unknown_chars"),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{meta_path}: not a valid {META_NAME} ({type(e).__name__}: {e})") from None
    for path in shard_set.paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: missing ({n} shards listed in {meta_path})")
    return shard_set


def open_pairs(shards: ShardSet) -> ArrayRecordPairs:
    """The pairs of a shard set. Raises DataError when the shards hold another count than
    ``dataset.json`` says (files replaced after the conversion)."""
    pairs = ArrayRecordPairs(shards.paths)
    if len(pairs) != shards.pairs:
        raise DataError(
            f"{Path(shards.paths[0]).parent}: the shards hold {len(pairs)} pairs, "
            f"{META_NAME} says {shards.pairs}"
        )
    return pairs


def decode_pair(record: bytes) -> dict[str, np.ndarray]:
    """One record -> {"drug": [Ld] int32, "protein": [Lp] int32, "affinity": [] float32}."""
    if record[:4] != _MAGIC:
        raise DataError(f"not a hopperjax DTA record (starts with {record[:4]!r})")
    _, itemsize, drug_max, drug_len, protein_max, protein_len, y = _RECORD.unpack_from(record)
    dtype = np.uint8 if itemsize == 1 else np.int32
    drug, protein = np.zeros(drug_max, np.int32), np.zeros(protein_max, np.int32)
    offset = _RECORD.size
    drug[:drug_len] = np.frombuffer(record, dtype, drug_len, offset)
    offset += drug_len * itemsize
    protein[:protein_len] = np.frombuffer(record, dtype, protein_len, offset)
    return {"drug": drug, "protein": protein, "affinity": np.float32(y)}


class ArrayRecordPairs:
    """grain random-access source of the pairs in ArrayRecord shards, decoded per item."""

    def __init__(self, paths: Sequence[str | Path]):
        import grain  # its ArrayRecord reader needs array_record: see write_shards

        self._paths = [str(p) for p in paths]
        self._records = grain.sources.ArrayRecordDataSource(self._paths)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return decode_pair(self._records[i])

    def affinities(self, indices: np.ndarray) -> np.ndarray:
        """The affinities of pairs ``indices``, read from the records' headers (no token
        decoding): the training split's statistics for ``data.standardize``."""
        out = np.empty(len(indices), np.float32)
        for k, i in enumerate(np.asarray(indices, np.int64).tolist()):
            record = self._records[i]
            if record[:4] != _MAGIC:
                raise DataError(f"not a hopperjax DTA record (starts with {record[:4]!r})")
            out[k] = _RECORD.unpack_from(record)[-1]
        return out

    def __repr__(self) -> str:
        return f"ArrayRecordPairs({len(self._paths)} shards, {len(self)} pairs)"
