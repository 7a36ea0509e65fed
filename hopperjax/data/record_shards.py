"""ArrayRecord shard sets: one directory of ``<split>-KKKKK-of-NNNNN.array_record`` files and a
``dataset.json`` that names the format, each split's record count and shard count, and whatever
the writer adds (shapes, sizes). The generic part of every converter's output.

A directory is complete when ``dataset.json`` is there: ``write_shards`` writes every shard under
a hidden name first (an earlier set stays readable meanwhile, and stays intact if the conversion
fails), then removes ``dataset.json``, renames the shards and writes it last (atomically); only
the set's own files are ever removed, so an interrupted conversion never reads as a dataset and
another tool's files in the directory stay. ``open_split`` checks a split against its listing
(present, readable, the listed count) and returns a reader that fetches many records at once.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax import files
from hopperjax.data.errors import DataError, one_line

META_NAME = "dataset.json"
_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.array_record")
_PART = re.compile(r"(.+)-(\d{5})")


def shard_name(split: str, k: int, n: int) -> str:
    return f"{split}-{k:05d}-of-{n:05d}.array_record"


def write_shards(
    out_dir: str | Path,
    splits: Mapping[str, Iterable[Iterable[bytes]]],
    *,
    meta: Mapping[str, Any],
    counts: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Writes each split's records: ``splits[name]`` yields one iterable of records per shard
    (in order, consumed one shard at a time; records stored uncompressed, one per chunk, for
    random access). ``meta`` (with a
    ``format`` key) goes into ``dataset.json`` with ``splits: {name: {records, shards, ...}}``;
    ``counts(name)`` adds per-split entries (e.g. rows skipped), called after the split is
    written. Returns the ``dataset.json`` written."""
    # Imported here: ArrayRecord is needed only to write shards, and not every platform has it.
    from array_record.python.array_record_module import ArrayRecordWriter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ours = set(splits)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or unreadable
        earlier = json.loads((out / META_NAME).read_text())
        if earlier.get("format") == meta.get("format"):  # another tool's set is not ours
            ours |= set(earlier["splits"])
    for stale in [*out.glob(".*.tmp"), *out.glob(".*.part")]:  # left by a killed conversion
        name = (files.temp_target(stale.name) or stale.name).lstrip(".").removesuffix(".part")
        match = _SHARD.fullmatch(name) or _PART.fullmatch(name)
        if match and match.group(1) in ours:
            stale.unlink()
    # Shards stream in (a file of any size): each is written whole under a hidden name; an
    # earlier complete set stays readable until every new part is written, so a conversion that
    # fails (a bad line, a full disk) leaves it as it was.
    parts: dict[str, list[Path]] = {}
    listing: dict[str, dict[str, Any]] = {}
    try:
        for name, shards in splits.items():
            parts[name], total = [], 0
            for k, records in enumerate(shards):
                tally = [0]

                def write(temp: Path, records: Iterable[bytes] = records, tally=tally) -> None:
                    writer = ArrayRecordWriter(str(temp), "group_size:1,uncompressed")
                    try:
                        for record in records:
                            writer.write(record)
                            tally[0] += 1
                    finally:
                        writer.close()

                part = out / f".{name}-{k:05d}.part"
                files.atomic_write(part, write)
                parts[name].append(part)
                total += tally[0]
            listing[name] = {"records": total, "shards": len(parts[name]),
                             **(counts(name) if counts else {})}  # fmt: skip
    except BaseException:
        for part in (p for group in parts.values() for p in group):
            part.unlink(missing_ok=True)
        raise
    # Every part is written: from here until dataset.json, the set reads as incomplete.
    (out / META_NAME).unlink(missing_ok=True)
    files.fsync_directory(out)
    written: set[Path] = set()
    for name, group in parts.items():
        for k, part in enumerate(group):
            path = out / shard_name(name, k, len(group))
            part.replace(path)
            written.add(path)
    for old in out.iterdir():
        match = _SHARD.fullmatch(old.name)
        if match and match.group(1) in ours and old not in written:
            old.unlink()
    files.fsync_directory(out)
    result = {**meta, "splits": listing}
    files.atomic_write(out / META_NAME, lambda t: t.write_text(json.dumps(result, indent=1)))
    return result


def read_meta(directory: str | Path, fmt: str, tool: str) -> dict[str, Any]:
    """The ``dataset.json`` of a complete set in ``fmt``; DataError naming the directory or
    file otherwise (``tool``: the converter to run)."""
    root = Path(directory)
    meta_path = root / META_NAME
    if not root.is_dir():
        raise DataError(f"{root}: not a directory")
    if not meta_path.is_file():
        raise DataError(
            f"{root}: no {META_NAME}; not a shard directory, or its conversion did not finish "
            f"({tool} writes one)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path}: not a valid {META_NAME} ({one_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{meta_path}: format {found!r}, expected {fmt!r}")
    return meta


class SplitReader:
    """The records of one split, fetched many at a time (``read(ids)``), opened lazily so that
    the object pickles to grain's worker processes, which open their own readers."""

    def __init__(self, paths: tuple[str, ...], count: int):
        self.paths, self.count = paths, count
        self._source: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "count": self.count, "_source": None}

    def __len__(self) -> int:
        return self.count

    def read(self, ids: np.ndarray) -> list[bytes]:
        if self._source is None:
            import grain  # its ArrayRecord reader needs array_record: see write_shards

            self._source = grain.sources.ArrayRecordDataSource(list(self.paths))
        try:
            return self._source.__getitems__(np.asarray(ids, np.int64).tolist())
        except (RuntimeError, ValueError, OSError) as e:  # ArrayRecord's errors on bad files
            raise DataError(f"{Path(self.paths[0]).parent}: cannot read ({one_line(e)})") from None


def open_split(directory: str | Path, meta: Mapping[str, Any], split: str) -> SplitReader:
    """The reader of ``split``, checked against ``meta`` (from ``read_meta``): DataError for a
    split the set does not hold, a missing or unreadable shard, or another record count."""
    root = Path(directory)
    try:
        entry = meta["splits"][split]
    except (KeyError, TypeError):
        held = sorted(meta.get("splits", {})) if isinstance(meta.get("splits"), dict) else []
        raise DataError(f"{root}: no split {split!r} (it holds {held})") from None
    try:
        n, count = int(entry["shards"]), int(entry["records"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{root / META_NAME}: a bad entry for {split!r} ({one_line(e)})") from None
    paths = tuple(str(root / shard_name(split, k, n)) for k in range(n))
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: missing ({n} shards of {split!r} listed in {META_NAME})")
    reader = SplitReader(paths, count)
    try:
        import grain

        held = len(grain.sources.ArrayRecordDataSource(list(paths)))
    except (RuntimeError, ValueError, OSError) as e:  # a truncated or foreign shard
        raise DataError(f"{root}: cannot open its {split!r} shards ({one_line(e)})") from None
    if held != count:
        raise DataError(
            f"{root}: the {split!r} shards hold {held} records, {META_NAME} says {count}"
        )
    return reader
