"""Byte-level text sources: a local UTF-8 (or any) file, or the embedded hopperjax corpus.

Tokens are bytes (vocabulary 256), so any file works without a tokenizer download. Example ``i``
is the ``seq_len + 1`` bytes starting at ``i * seq_len`` (neighbours share one byte, so every byte
is a target once); inputs are its first ``seq_len`` bytes, targets its last ``seq_len``.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import numpy as np

BYTE_VOCAB_SIZE = 256
_CORPUS_SUFFIXES = (".py", ".md")


@functools.cache
def embedded_corpus() -> np.ndarray:
    """hopperjax's own source and documentation, read from the installed package, as bytes.

    Real, learnable text that needs no file or download; sorted by path so that every install of
    the same version yields the same bytes. Returns: [num_bytes] uint8.
    """
    root = importlib.resources.files("hopperjax")
    chunks = []
    stack = [root]
    files = []
    while stack:
        node = stack.pop()
        for child in node.iterdir():
            if child.is_dir() and child.name != "__pycache__":
                stack.append(child)
            elif child.is_file() and child.name.endswith(_CORPUS_SUFFIXES):
                files.append(child)
    for child in sorted(files, key=lambda f: str(f)):
        chunks.append(child.read_bytes())
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


class ByteWindows:
    """Random-access source of byte windows over ``[start, stop)`` of a byte array or file.

    A file is memory-mapped lazily in each process (grain workers pickle the source), so large
    files are neither copied nor read up front.

    Args:
      data: a uint8 array, or the path of a file.
      start, stop: byte range of this split.
      seq_len: tokens per example; each window holds ``seq_len + 1`` bytes.
    """

    def __init__(self, data: np.ndarray | str | Path, start: int, stop: int, seq_len: int):
        self._path = str(data) if isinstance(data, (str, Path)) else None
        self._array = None if self._path else data
        self._start, self._stop, self._seq_len = start, stop, seq_len

    def _bytes(self) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self._path, dtype=np.uint8, mode="r")
        return self._array

    def __len__(self) -> int:
        return max(0, (self._stop - self._start - 1) // self._seq_len)

    def __getitem__(self, index: int) -> np.ndarray:
        begin = self._start + index * self._seq_len
        return np.asarray(self._bytes()[begin : begin + self._seq_len + 1])  # (seq_len + 1,)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._path is not None:
            state["_array"] = None  # Re-mapped in the worker, never pickled.
        return state

    def __repr__(self) -> str:
        origin = self._path or "embedded"
        return f"ByteWindows({origin}, bytes {self._start}:{self._stop}, seq_len={self._seq_len})"


def byte_length(data: np.ndarray | str | Path) -> int:
    return Path(data).stat().st_size if isinstance(data, (str, Path)) else int(data.shape[0])


def to_lm_example(window: np.ndarray) -> dict[str, np.ndarray]:
    """window: [seq_len + 1] uint8 -> {"inputs", "targets"}: [seq_len] int32, shifted by one."""
    tokens = window.astype(np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:]}
