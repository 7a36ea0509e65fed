"""Labelled images from local files: image folders, CIFAR-10's binary and python releases.

Every source becomes the same thing, ``ImageSet``: uint8 images [N, H, W, 3] (RGB, NHWC) and int32
labels [N] held in host memory, decoded once when the run starts. Batches keep the uint8 bytes
(a quarter of fp32's) until the workload's on-device preprocessing converts them.

- ``folder``: ``<root>/<split>/<class>/*.jpg|jpeg|png`` (ImageNet's layout, and that of
  ``data/cifar10``); class ids are the sorted folder names of the training split.
  Decoded with Pillow in a thread pool (its decoder releases the GIL).
- ``cifar_binary``: ``data_batch_1.bin`` .. ``data_batch_5.bin`` and ``test_batch.bin``, records
  of 1 label byte + 3,072 bytes (1,024 R, 1,024 G, 1,024 B, row-major 32 x 32).
- ``cifar_python``: ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, pickles of a dict
  with ``data`` [10000, 3072] uint8 (the same planes) and ``labels``, read by ``safe_pickle``.
- ``synthetic``: generated images whose class decides a coloured pattern (tests, smoke runs).

A bad image (unreadable, or of another size than ``size`` where one is required) is a
``DataError`` naming the file, or, with ``skip_bad``, counted and left out.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hopperjax.data import safe_pickle
from hopperjax.data.errors import DataError, one_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
CIFAR_SIDE = 32
CIFAR_RECORD = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
CIFAR_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ImageSet:
    """Decoded images of one split: ``images`` uint8 [N, H, W, 3], ``labels`` int32 [N],
    ``classes`` the class names by id, ``skipped`` bad images left out."""

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """One example (a grain ``RandomAccessDataSource``)."""
        return {"images": self.images[index], "labels": self.labels[index]}

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The examples in ``order`` as one batch (one gather, not one record at a time)."""
        return {"images": self.images[order], "labels": self.labels[order]}

    def take(self, order: np.ndarray) -> ImageSet:
        """The examples in ``order``."""
        return dataclasses.replace(self, images=self.images[order], labels=self.labels[order])

    def padded(self, multiple: int) -> ImageSet:
        """Grown to a multiple of ``multiple`` with black images labelled -1 (to be masked)."""
        extra = -len(self) % multiple
        if not extra:
            return self
        black = np.zeros((extra, *self.images.shape[1:]), np.uint8)
        return dataclasses.replace(
            self,
            images=np.concatenate([self.images, black]),
            labels=np.concatenate([self.labels, np.full(extra, -1, np.int32)]),
        )


@dataclasses.dataclass(frozen=True)
class ImageFiles:
    """Image files decoded when read (in the data pipeline, so in ``data.workers`` processes):
    for image sets larger than host memory. ``paths[i]`` None is a black padding image labelled
    -1. A bad image raises ``DataError`` naming the file when it is read."""

    paths: tuple[Path | None, ...]
    labels: np.ndarray
    classes: tuple[str, ...]
    size: int
    resize: bool = False
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        path = self.paths[index]
        if path is None:
            image = np.zeros((self.size, self.size, 3), np.uint8)
        else:
            image = decode(path, self.size, resize=self.resize)
        return {"images": image, "labels": self.labels[index]}

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The examples in ``order`` as one batch, decoded now."""
        rows = [self[int(i)] for i in order]
        return {k: np.stack([r[k] for r in rows]) for k in ("images", "labels")}

    def take(self, order: np.ndarray) -> ImageFiles:
        return dataclasses.replace(
            self, paths=tuple(self.paths[i] for i in order), labels=self.labels[order]
        )

    def padded(self, multiple: int) -> ImageFiles:
        extra = -len(self) % multiple
        return dataclasses.replace(
            self,
            paths=self.paths + (None,) * extra,
            labels=np.concatenate([self.labels, np.full(extra, -1, np.int32)]),
        )


# ---------------------------------------------------------------------------------------------
# Image folders


def folder_classes(root: Path, split: str) -> tuple[str, ...]:
    """The sorted class folder names of ``root/split``. Raises DataError naming the folder."""
    where = root / split
    if not where.is_dir():
        raise DataError(f"{where}: no such folder (expected <class>/<image> folders in it)")
    classes = tuple(sorted(p.name for p in where.iterdir() if p.is_dir()))
    if not classes:
        raise DataError(f"{where}: no class folders in it")
    return classes


def list_folder(root: Path, split: str, classes: Sequence[str]) -> tuple[list[Path], np.ndarray]:
    """Every image file of ``root/split`` with its label (the class's index in ``classes``).

    Raises DataError naming a class folder that ``classes`` lacks, or a split with no images.
    """
    index = {name: i for i, name in enumerate(classes)}
    paths: list[Path] = []
    labels: list[int] = []
    for folder in sorted(p for p in (root / split).iterdir() if p.is_dir()):
        if folder.name not in index:
            raise DataError(f"{folder}: a class the training split does not have")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        paths += files
        labels += [index[folder.name]] * len(files)
    if not paths:
        raise DataError(f"{root / split}: no {'/'.join(IMAGE_SUFFIXES)} images in its folders")
    return paths, np.asarray(labels, np.int32)


def decode(path: Path, size: int | None, *, resize: bool = False) -> np.ndarray:
    """One image file -> uint8 [H, W, 3] RGB (other modes are converted).

    ``size``: the side every image must have (square), or None for any size. ``resize``: scale
    the shorter side to ``size`` (antialiased bilinear) and keep the centre square, so photos of
    any shape fit. Raises DataError naming the file: unreadable, or of another size.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            if resize and size is not None and rgb.size != (size, size):
                rgb = _shorter_side_centre(rgb, size)
            array = np.asarray(rgb, np.uint8)
    except (
        OSError,
        UnidentifiedImageError,
        ValueError,
        SyntaxError,
        struct.error,
        Image.DecompressionBombError,
    ) as e:  # what Pillow raises for damaged or hostile files
        raise DataError(f"{path}: not a readable image ({one_line(e)})") from None
    if size is not None and array.shape[:2] != (size, size):
        height, width = array.shape[:2]
        raise DataError(
            f"{path}: {width}x{height} pixels, expected {size}x{size} (data.image_size)"
        )
    return array


def _shorter_side_centre(image, size: int):
    from PIL import Image

    width, height = image.size
    scale = size / min(width, height)
    new = (max(size, round(width * scale)), max(size, round(height * scale)))
    image = image.resize(new, Image.Resampling.BILINEAR, reducing_gap=None)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


def decode_all(
    paths: Sequence[Path], labels: np.ndarray, size: int, classes: tuple[str, ...], *,
    skip_bad: bool, resize: bool = False, threads: int | None = None,
) -> ImageSet:  # fmt: skip
    """Every image of ``paths`` decoded (in ``threads`` threads, default min(8, CPU count)), in
    order.

    ``skip_bad``: leave bad images out and count them; else the first bad one in ``paths``'s
    order raises (after the others are decoded).
    """
    images = np.empty((len(paths), size, size, 3), np.uint8)
    errors: dict[int, DataError] = {}

    def one(i: int) -> None:
        try:
            images[i] = decode(paths[i], size, resize=resize)
        except DataError as e:
            errors[i] = e

    workers = threads or min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(paths)), chunksize=256))
    if errors and not skip_bad:
        raise errors[min(errors)]
    keep = np.ones(len(paths), bool)
    keep[list(errors)] = False
    if not keep.any():
        raise DataError(f"{paths[0].parent.parent}: every image is bad ({errors[min(errors)]})")
    return ImageSet(images[keep], labels[keep], classes, skipped=int((~keep).sum()))


def read_folder(
    root: str | Path, split: str, size: int, *, classes: tuple[str, ...] | None = None,
    skip_bad: bool = False, resize: bool = False, preload: bool = True,
) -> ImageSet | ImageFiles:  # fmt: skip
    """One split of an image-folder tree; ``classes`` default: this split's own folders.

    ``preload``: decode every image now (``ImageSet``); else list the files and decode each when
    read (``ImageFiles``; a bad image then stops the run when it is reached, ``skip_bad`` aside).
    """
    root = Path(root)
    classes = classes or folder_classes(root, split)
    paths, labels = list_folder(root, split, classes)
    if not preload:
        return ImageFiles(tuple(paths), labels, classes, size, resize)
    return decode_all(paths, labels, size, classes, skip_bad=skip_bad, resize=resize)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 releases


def _planes_to_nhwc(rows: np.ndarray) -> np.ndarray:
    """[N, 3072] uint8 in R, G, B planes -> [N, 32, 32, 3]."""
    return rows.reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE).transpose(0, 2, 3, 1)


def _check_labels(labels: np.ndarray, path: Path) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= len(CIFAR_CLASSES)))
    if bad.size:
        raise DataError(
            f"{path}: record {bad[0]}: label {labels[bad[0]]} is not a CIFAR-10 class (0..9)"
        )


def read_cifar_binary_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One ``*.bin`` file -> (images [N, 32, 32, 3] uint8, labels [N] int32)."""
    try:
        raw = np.fromfile(path, np.uint8)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise DataError(
            f"{path}: {raw.size} bytes, not a whole number of {CIFAR_RECORD}-byte records "
            "(1 label byte + 3,072 pixel bytes)"
        )
    records = raw.reshape(-1, CIFAR_RECORD)
    labels = records[:, 0].astype(np.int32)
    _check_labels(labels, path)
    return _planes_to_nhwc(records[:, 1:]), labels


def read_cifar_python_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch -> (images [N, 32, 32, 3] uint8, labels [N] int32)."""
    batch = safe_pickle.load(path)
    if not isinstance(batch, dict):
        raise DataError(f"{path}: holds a {type(batch).__name__}, not a CIFAR batch dict")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise DataError(f"{path}: no 'data' and 'labels' entries (has {sorted(batch)})")
    data = batch["data"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2):
        raise DataError(f"{path}: 'data' is not a uint8 [N, 3072] array")
    if data.shape[1] != CIFAR_RECORD - 1:
        raise DataError(f"{path}: 'data' rows have {data.shape[1]} bytes, expected 3072")
    labels = np.asarray(batch["labels"], np.int64)
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {labels.size} labels for {len(data)} images")
    _check_labels(labels, path)
    return _planes_to_nhwc(data), labels.astype(np.int32)


def read_cifar(root: str | Path, split: str, *, binary: bool) -> ImageSet:
    """``split`` ``train`` (data_batch_1..5) or ``test`` (test_batch) of a CIFAR-10 release."""
    root = Path(root)
    names = CIFAR_TRAIN_FILES if split == "train" else (CIFAR_TEST_FILE,)
    suffix = ".bin" if binary else ""
    read = read_cifar_binary_file if binary else read_cifar_python_file
    parts = [read(root / f"{name}{suffix}") for name in names]
    return ImageSet(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
        CIFAR_CLASSES,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Synthetic


def synthetic(count: int, size: int, classes: int, seed: int) -> ImageSet:
    """``count`` noisy images whose class sets a colour and a stripe direction and frequency:
    learnable by a small convolutional net in a few steps, never learnable from the label
    alone (every class appears with noise and random brightness)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, count).astype(np.int32)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    images = np.empty((count, size, size, 3), np.uint8)
    palette = np.random.default_rng(1234).uniform(0.2, 1.0, (classes, 3)).astype(np.float32)
    for i, c in enumerate(labels):
        angle = np.pi * c / classes
        freq = 2.0 + (c % 3)
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (np.cos(angle) * x + np.sin(angle) * y))
        image = wave[..., None] * palette[c] * rng.uniform(0.6, 1.0)
        image += rng.normal(0.0, 0.1, image.shape)
        images[i] = np.clip(image * 255.0, 0, 255).astype(np.uint8)
    return ImageSet(images, labels, tuple(f"class{c}" for c in range(classes)))
