"""ArrayRecord shards of decoded images (``data.source: shards`` of the image workload).

``write_image_shards`` writes each split of already decoded images (``ImageSet``) as one record
per image, uint8 pixels after a small header, plus a ``dataset.json`` naming the classes, the
image size and each split's shards. Training then reads pixels instead of decoding JPEGs: the
records feed the same ``EpochBatches`` as a decoded folder, so both paths give the same batches.

A directory is complete when ``dataset.json`` is there: the writer removes it first and writes it
last (atomically), so an interrupted conversion never reads as a dataset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax import files
from hopperjax.data.errors import DataError, one_line
from hopperjax.data.images import ImageSet

META_NAME = "dataset.json"
FORMAT = "hopperjax-image-shards/1"

_HEADER = struct.Struct("<4sHHHxxi")  # magic, height, width, channels, label
_MAGIC = b"IMG1"
_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.array_record")


def encode(image: np.ndarray, label: int) -> bytes:
    """One record: the header, then the uint8 pixels [H, W, C] row-major."""
    height, width, channels = image.shape
    return _HEADER.pack(_MAGIC, height, width, channels, int(label)) + image.tobytes()


def decode(record: bytes) -> tuple[np.ndarray, int]:
    """One record -> (uint8 image [H, W, C], label). Raises DataError for a damaged record."""
    if record[:4] != _MAGIC or len(record) < _HEADER.size:
        raise DataError(f"not a hopperjax image record (starts with {record[:4]!r})")
    _, height, width, channels, label = _HEADER.unpack_from(record)
    if len(record) != _HEADER.size + height * width * channels:
        raise DataError(
            f"a damaged image record: {len(record)} bytes for a {height}x{width}x{channels} image"
        )
    pixels = np.frombuffer(record, np.uint8, height * width * channels, _HEADER.size)
    return pixels.reshape(height, width, channels), label


def write_image_shards(
    splits: Mapping[str, ImageSet], out_dir: str | Path, *, num_shards: int, source: str = ""
) -> dict[str, Any]:
    """Writes every split of ``splits`` (name -> decoded images, one class list for all) into
    ``num_shards`` ArrayRecord files each, ``<split>-KKKKK-of-NNNNN.array_record``, in the
    split's order (grain's reader and ``EpochBatches`` shuffle at read time). Each file is
    written under a temporary name and renamed; shards of an earlier conversion are removed.
    Returns the ``dataset.json`` it wrote."""
    # Imported here: ArrayRecord is needed only to write shards, and not every platform has it.
    from array_record.python.array_record_module import ArrayRecordWriter

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    classes = {s.classes for s in splits.values()}
    if len(classes) != 1:
        raise ValueError(f"the splits name different classes: {sorted(classes)}")
    shapes = {s.images.shape[1:] for s in splits.values()}
    if len(shapes) != 1:
        raise ValueError(f"the splits hold images of different shapes: {sorted(shapes)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Only this set's own files are ever removed: the splits written now and those an earlier
    # conversion's dataset.json names (another tool's shards in the directory stay).
    ours = set(splits)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or unreadable
        ours |= set(json.loads((out / META_NAME).read_text())["splits"])
    (out / META_NAME).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp"):  # left by a killed conversion
        match = _SHARD.fullmatch(files.temp_target(stale.name) or "")
        if match and match.group(1) in ours:
            stale.unlink()
    files.fsync_directory(out)  # the set reads as incomplete from here on
    written: set[Path] = set()
    meta_splits = {}
    for name, images in splits.items():
        n = min(num_shards, max(1, len(images)))
        bounds = np.linspace(0, len(images), n + 1).astype(np.int64)
        for k in range(n):
            rows = range(bounds[k], bounds[k + 1])

            def write(temp: Path, rows: range = rows, images: ImageSet = images) -> None:
                # One record per chunk (random access), stored: pixels barely compress, and
                # zstd cost ~15 % of the read time.
                writer = ArrayRecordWriter(str(temp), "group_size:1,uncompressed")
                try:
                    for i in rows:
                        writer.write(encode(images.images[i], images.labels[i]))
                finally:
                    writer.close()

            path = out / f"{name}-{k:05d}-of-{n:05d}.array_record"
            files.atomic_write(path, write)
            written.add(path)
        meta_splits[name] = {"images": len(images), "shards": n, "skipped": images.skipped}
    for old in out.iterdir():
        match = _SHARD.fullmatch(old.name)
        if match and match.group(1) in ours and old not in written:
            old.unlink()
    files.fsync_directory(out)
    meta = {
        "format": FORMAT,
        "source": source,
        "classes": list(next(iter(classes))),
        "image_shape": list(next(iter(shapes))),
        "splits": meta_splits,
    }
    files.atomic_write(out / META_NAME, lambda temp: temp.write_text(json.dumps(meta, indent=1)))
    return meta


@dataclasses.dataclass(frozen=True)
class ImageRecords:
    """The images of one split in shards, read when a batch asks for them (a source for
    ``EpochBatches``, like ``ImageSet`` and ``ImageFiles``). ``order[i]`` is the record behind
    example ``i``; -1 is a black padding image labelled -1."""

    paths: tuple[str, ...]
    order: np.ndarray
    classes: tuple[str, ...]
    shape: tuple[int, int, int]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.order)

    def _records(self) -> Any:
        records = self.__dict__.get("_source")
        if records is None:
            import grain  # its ArrayRecord reader needs array_record: see write_image_shards

            records = grain.sources.ArrayRecordDataSource(list(self.paths))
            self.__dict__["_source"] = records
        return records

    def __getstate__(self) -> dict[str, Any]:  # worker processes open their own readers
        return {k: v for k, v in self.__dict__.items() if k != "_source"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The examples at ``order`` as one batch (one batched read of the records)."""
        ids = self.order[np.asarray(order, np.int64)]
        images = np.zeros((len(ids), *self.shape), np.uint8)
        labels = np.full(len(ids), -1, np.int32)
        real = np.flatnonzero(ids >= 0)
        if not real.size:  # a process's share of the last eval batch can be all padding
            return {"images": images, "labels": labels}
        where = Path(self.paths[0]).parent
        try:
            read = self._records().__getitems__(ids[real].tolist())
        except (RuntimeError, ValueError, OSError) as e:  # ArrayRecord's errors on bad files
            raise DataError(f"{where}: cannot read its shards ({one_line(e)})") from None
        for row, record in zip(real, read, strict=True):
            try:
                image, labels[row] = decode(record)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if image.shape != self.shape:
                raise DataError(
                    f"{where}: a record holds a {image.shape} image, {META_NAME} says {self.shape}"
                )
            images[row] = image
        return {"images": images, "labels": labels}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        one = self.batch(np.array([index]))
        return {"images": one["images"][0], "labels": one["labels"][0]}

    def load(self) -> ImageSet:
        """Every example read into memory (``data.preload``: ~15 us a record on one core)."""
        batch = self.batch(np.arange(len(self)))
        return ImageSet(batch["images"], batch["labels"], self.classes, self.skipped)

    def take(self, order: np.ndarray) -> ImageRecords:
        return dataclasses.replace(self, order=self.order[order])

    def padded(self, multiple: int) -> ImageRecords:
        extra = -len(self) % multiple
        return dataclasses.replace(self, order=np.concatenate([self.order, np.full(extra, -1)]))


def read_image_shards(directory: str | Path, split: str) -> ImageRecords:
    """Split ``split`` of a ``write_image_shards`` directory.

    Raises: DataError naming the directory or file: no ``dataset.json`` (not a shard directory,
    or an interrupted conversion), a foreign format, a split it does not hold, a missing shard
    or shards holding another count than listed.
    """
    root = Path(directory)
    meta_path = root / META_NAME
    if not root.is_dir():
        raise DataError(f"{root}: not a directory")
    if not meta_path.is_file():
        raise DataError(
            f"{root}: no {META_NAME}; not an image shard directory, or its conversion did not "
            "finish (tools/convert_images.py writes one)"
        )
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        if split not in meta["splits"]:
            raise DataError(f"{root}: no split {split!r} (it holds {sorted(meta['splits'])})")
        entry = meta["splits"][split]
        n, count = int(entry["shards"]), int(entry["images"])
        paths = tuple(str(root / f"{split}-{k:05d}-of-{n:05d}.array_record") for k in range(n))
        classes = tuple(str(c) for c in meta["classes"])
        shape = tuple(int(x) for x in meta["image_shape"])
        skipped = int(entry.get("skipped", 0))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{meta_path}: not a valid {META_NAME} ({type(e).__name__}: {e})") from None
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: missing ({n} shards of {split!r} listed in {meta_path})")
    records = ImageRecords(paths, np.arange(count), classes, shape, skipped)  # type: ignore[arg-type]
    try:
        held = len(records._records())
    except (RuntimeError, ValueError, OSError) as e:  # a truncated or foreign shard
        raise DataError(f"{root}: cannot open its {split!r} shards ({one_line(e)})") from None
    if held != count:
        raise DataError(
            f"{root}: the {split!r} shards hold {held} images, {META_NAME} says {count}"
        )
    return records
