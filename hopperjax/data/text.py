"""Text sources for language modeling: a local file, or the embedded hopperjax corpus.

Tokens are bytes (vocabulary 256: any file works, no tokenizer download) or characters (the
sorted distinct characters of the text, as nanoGPT's character-level recipes use; the vocabulary
is saved with the run). Two samplers: ``ByteWindows`` example ``i`` is the ``seq_len + 1``
tokens starting at ``i * seq_len`` (neighbours share one token, so every token is a target once
per epoch); ``RandomWindows`` draws each example at a uniform random offset, with replacement.
Inputs are a window's first ``seq_len`` tokens, targets its last ``seq_len``.
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


class CharVocabulary:
    """The sorted distinct characters of a text; token id = rank of the character.

    ``chars`` is the vocabulary as one string (what ``vocab.json`` stores with a run).
    """

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise ValueError("a vocabulary needs at least one character and no repeats")
        self.chars = "".join(sorted(chars))
        self._codes = np.frombuffer(self.chars.encode("utf-32-le"), np.uint32)

    @classmethod
    def of(cls, text: str) -> CharVocabulary:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str, *, where: str = "text") -> np.ndarray:
        """text -> [len] uint16 ids. Raises ValueError naming the first character not in it."""
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        ids = np.searchsorted(self._codes, codes)
        bad = (ids >= len(self._codes)) | (
            self._codes[np.minimum(ids, len(self._codes) - 1)] != codes
        )
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(f"{where}: character {text[at]!r} at {at} is not in the vocabulary")
        return ids.astype(np.uint16 if len(self) <= 1 << 16 else np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def read_chars(path: str | Path | None) -> str:
    """The text of a UTF-8 file (or of the embedded corpus when ``path`` is None).

    Raises: ValueError naming the file and the byte offset of the first invalid UTF-8.
    """
    raw = embedded_corpus().tobytes() if path is None else Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = path or "the embedded corpus"
        raise ValueError(
            f"{where}: not UTF-8 at byte {e.start}; use data.tokenizer=bytes"
        ) from None


class ByteWindows:
    """Random-access source of token windows over ``[start, stop)`` of a token array or file.

    A file is memory-mapped lazily in each process (grain workers pickle the source), so large
    files are neither copied nor read up front.

    Args:
      data: a token array (bytes or character ids), or the path of a file (bytes).
      start, stop: token range of this split.
      seq_len: tokens per example; each window holds ``seq_len + 1`` tokens.
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
        origin = self._path or "array"
        return (
            f"{type(self).__name__}({origin}, tokens {self._start}:{self._stop}, "
            f"seq_len={self._seq_len})"
        )


class RandomWindows(ByteWindows):
    """Windows of ``seq_len + 1`` tokens at uniform random offsets in ``[start, stop)``, drawn
    with replacement (nanoGPT's ``get_batch``). Item ``i`` is a pure function of ``(seed, i)``,
    so workers and resumed iterators draw the same windows; the length is virtual (never ends).
    ``data``: a token array, or a file path (bytes, memory-mapped as ``ByteWindows`` does).
    """

    LENGTH = 1 << 40

    def __init__(
        self, data: np.ndarray | str | Path, start: int, stop: int, seq_len: int, seed: int
    ):
        if stop - start < seq_len + 1:
            raise ValueError(f"{stop - start} tokens cannot hold one window of {seq_len + 1}")
        super().__init__(data, start, stop, seq_len)
        self._seed = seed

    def __len__(self) -> int:
        return self.LENGTH

    def offset(self, index: int) -> int:
        rng = np.random.default_rng((self._seed, int(index)))
        return self._start + int(rng.integers(0, self._stop - self._start - self._seq_len))

    def __getitem__(self, index: int) -> np.ndarray:
        begin = self.offset(index)
        return np.asarray(self._bytes()[begin : begin + self._seq_len + 1])


def byte_length(data: np.ndarray | str | Path) -> int:
    return Path(data).stat().st_size if isinstance(data, (str, Path)) else int(data.shape[0])


def to_lm_example(window: np.ndarray) -> dict[str, np.ndarray]:
    """window: [seq_len + 1] token ids -> {"inputs", "targets"}: [seq_len] int32, shifted by one."""
    tokens = window.astype(np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:]}
