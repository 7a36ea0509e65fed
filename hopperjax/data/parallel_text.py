"""Parallel text for translation: aligned sentence pairs, a joint SentencePiece vocabulary, and
packed rows of token ids.

Sources (one split at a time, ``read_pairs(directory, split, source_lang, target_lang)``):

- two aligned files ``<split>.<source_lang>`` and ``<split>.<target_lang>``, plain or ``.gz``,
  line i of one translating line i of the other (Multi30k's layout: ``train.en.gz``,
  ``train.de.gz``);
- one file ``<split>.tsv`` (or ``.tsv.gz``): ``source<TAB>target`` per line.

A bad record is a one-line ``DataError`` naming the file and line: bytes that are not UTF-8, an
empty sentence, a TSV line without exactly two fields; a split whose two files differ in line
count names both files and counts. ``bad_records="skip"`` counts and leaves out the pairs with
an empty side (an alignment or encoding error always stops: it means the files are wrong).

Tokenizer: SentencePiece (unigram or BPE) trained on the training split's source and target
sentences together, one vocabulary for both sides (what lets a model tie its embeddings), with
T5's special ids: 0 padding, 1 end of sentence, 2 unknown, no beginning-of-sentence token.

Packing (``pack``): examples go first-fit into rows of ``source_len`` and ``target_len``
tokens, each with segment ids (1, 2, ... per example in the row, 0 for padding) and positions
that restart at every example, so a model that masks attention by segment never lets examples
see each other; every row has one shape, so a step compiles once. The padding left over is
reported (``Packed.padding``).

Subword regularization (Kudo 2018, with a unigram model):
``Resampled`` is a training source whose examples are segmented anew every epoch, one
segmentation sampled per sentence (``Tokenizer.sample``), and packed again, so the model sees
many segmentations of the same text; the text itself never changes. An epoch's view is a pure
function of the seed and the epoch: every process and worker builds the same rows, and a run
resumes exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import itertools
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax import files
from hopperjax.data.errors import DataError, one_line

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Pairs:
    """One split's aligned sentences; ``skipped``: pairs left out under ``bad_records=skip``."""

    sources: list[str]
    targets: list[str]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.sources)

    def head(self, n: int) -> Pairs:
        """The first ``n`` pairs (all of them if there are fewer)."""
        return Pairs(self.sources[:n], self.targets[:n])


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, f"{stem}.gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (``.gz`` read through gzip), without line endings."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib: a corrupt stream
        raise DataError(f"{path}: cannot read ({one_line(e)})") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise DataError(f"{path}: empty")
    out = []
    for number, line in enumerate(lines, 1):
        try:
            out.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    return out


def read_pairs(
    directory: str | Path, split: str, source_lang: str, target_lang: str, *,
    bad_records: str = "error",
) -> Pairs:  # fmt: skip
    """Split ``split`` of a parallel-text directory (see the module docstring)."""
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory")
    src, tgt = _find(root, f"{split}.{source_lang}"), _find(root, f"{split}.{target_lang}")
    tsv = _find(root, f"{split}.tsv")
    if src is not None and tgt is not None:
        sources, targets = _lines(src), _lines(tgt)
        if len(sources) != len(targets):
            raise DataError(
                f"{src}: {len(sources):,} lines, {tgt}: {len(targets):,} lines; line i of one "
                "must translate line i of the other"
            )
        where = [(src, tgt, i) for i in range(1, len(sources) + 1)]
    elif tsv is not None:
        sources, targets, where = [], [], []
        for number, line in enumerate(_lines(tsv), 1):
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(
                    f"{tsv}:{number}: expected 2 tab-separated fields, got {len(fields)}"
                )
            sources.append(fields[0])
            targets.append(fields[1])
            where.append((tsv, tsv, number))
    else:
        raise DataError(
            f"{root}: no {split}.{source_lang} and {split}.{target_lang} (or .gz), and no "
            f"{split}.tsv; files there: {', '.join(sorted(p.name for p in root.iterdir())[:8])}"
        )
    keep, skipped = [], 0
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        if s.strip() and t.strip():
            keep.append(i)
            continue
        if bad_records != "skip":
            path = where[i][0] if not s.strip() else where[i][1]
            raise DataError(f"{path}:{where[i][2]}: empty sentence")
        skipped += 1
    return Pairs([sources[i] for i in keep], [targets[i] for i in keep], skipped)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _sentencepiece() -> Any:
    try:
        import sentencepiece
    except ImportError:
        raise DataError(
            "translation needs SentencePiece: pip install 'hopperjax[translate]'"
        ) from None
    return sentencepiece


def train_tokenizer(
    sentences: Iterable[str], *, vocab_size: int, model_type: str = "unigram"
) -> Tokenizer:
    """A SentencePiece model trained on ``sentences`` (in memory; ``Tokenizer.save`` writes it).

    One training thread: the same sentences give the same model on every process and rerun.
    """
    spm = _sentencepiece()
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            num_threads=1,
            minloglevel=2,  # warnings and errors only
        )
    except RuntimeError as e:  # e.g. a vocabulary larger than the text allows
        raise DataError(f"SentencePiece training failed: {one_line(e)}") from None
    return Tokenizer(model.getvalue(), name=f"a {model_type} model of {vocab_size} pieces")


class Tokenizer:
    """A SentencePiece model (its serialized bytes): text <-> ids, every encoded sentence ending
    in ``EOS_ID``. ``name`` says where it came from, in errors."""

    def __init__(self, proto: bytes, *, name: str):
        spm = _sentencepiece()
        self.proto, self.name = proto, name
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except (OSError, RuntimeError, TypeError) as e:
            raise DataError(f"{name}: not a SentencePiece model ({one_line(e)})") from None
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD_ID, EOS_ID, UNK_ID):
            raise DataError(
                f"{name}: special ids (pad, eos, unk) are {ids}, expected "
                f"{(PAD_ID, EOS_ID, UNK_ID)}"
            )

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        try:
            proto = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        return cls(proto, name=str(path))

    def save(self, path: str | Path) -> None:
        files.atomic_write(Path(path), lambda temp: temp.write_bytes(self.proto))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, sentences: Sequence[str]) -> list[np.ndarray]:
        """Each sentence's ids, ``EOS_ID`` last (int32)."""
        ids = self._sp.encode(list(sentences), out_type=int)
        return [np.asarray([*x, EOS_ID], np.int32) for x in ids]

    @functools.cached_property
    def _scores(self) -> np.ndarray:
        """Each piece's log-probability (unigram), read once, when ``sample`` first needs it."""
        return np.asarray(
            [self._sp.get_score(i) for i in range(self._sp.get_piece_size())], np.float64
        )

    def sample(
        self,
        sentences: Sequence[str],
        *,
        alpha: float,
        nbest: int,
        seed: int | np.random.SeedSequence,
    ) -> list[np.ndarray]:
        """Like ``encode``, but each sentence's segmentation is drawn from the unigram model's
        ``nbest`` best with probability proportional to P(segmentation) ** ``alpha`` (smaller
        alpha, more uniform): Kudo 2018's subword regularization with l-best sampling. The draw
        is numpy's, from ``seed``: the same ids on every process, thread and rerun.
        SentencePiece's own sampler (``enable_sampling``) is not used because seeding it
        (``set_random_generator_seed``) did not make it reproducible across processes here
        (sentencepiece 0.2.3: the same seed, model and text gave other ids in each fresh
        process). Decoding gives back the sentence. A unigram model only (BPE has no n-best)."""
        try:
            nbests = self._sp.nbest_encode(list(sentences), nbest_size=nbest, out_type=int)
        except RuntimeError as e:  # a BPE model: "NBestEncode is not available"
            raise DataError(f"{self.name}: cannot sample segmentations ({one_line(e)})") from None
        draws = np.random.default_rng(seed).random(len(sentences))
        out = []
        for candidates, u in zip(nbests, draws, strict=True):
            if len(candidates) < 2 or not all(candidates):  # one way, or a sentence that
                out.append(np.asarray([*candidates[0], EOS_ID], np.int32))  # normalizes to ""
                continue
            # A segmentation's log-probability: the sum of its pieces' (an unknown piece scores
            # 0 here, but every candidate holds the same unknown runs, so the draw is exact).
            lengths = np.fromiter(map(len, candidates), np.int64, len(candidates))
            flat = np.fromiter(itertools.chain.from_iterable(candidates), np.int64, lengths.sum())
            logp = alpha * np.add.reduceat(self._scores[flat], np.r_[0, np.cumsum(lengths)[:-1]])
            weights = np.cumsum(np.exp(logp - logp.max()))
            k = min(int(np.searchsorted(weights, u * weights[-1], side="right")), len(lengths) - 1)
            out.append(np.asarray([*candidates[k], EOS_ID], np.int32))
        return out

    def __getstate__(self) -> dict[str, Any]:  # to grain's worker processes: the model's bytes
        return {"proto": self.proto, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["proto"], name=state["name"])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` up to the first ``EOS_ID`` (padding and what follows dropped)."""
        out = []
        for i in np.asarray(ids).tolist():
            if i == EOS_ID:
                break
            if i != PAD_ID:
                out.append(i)
        return self._sp.decode(out)


_LEXICON = (
    ("a", "ein"), ("the", "der"), ("man", "Mann"), ("woman", "Frau"), ("dog", "Hund"),
    ("child", "Kind"), ("sees", "sieht"), ("holds", "hält"), ("red", "roten"), ("big", "großen"),
    ("ball", "Ball"), ("hat", "Hut"), ("in", "im"), ("park", "Park"), ("snow", "Schnee"),
    ("and", "und"), ("runs", "rennt"), ("small", "kleinen"), ("blue", "blauen"), ("car", "Wagen"),
)  # fmt: skip


def synthetic_pairs(count: int, seed: int) -> Pairs:
    """``count`` generated pairs, each target the word-by-word translation of its source over a
    20-word English-German lexicon (3 to 9 words): a learnable task for smoke runs and tests."""
    rng = np.random.default_rng(seed)
    sources, targets = [], []
    for n in rng.integers(3, 10, count):
        words = rng.integers(0, len(_LEXICON), n)
        sources.append(" ".join(_LEXICON[w][0] for w in words) + " .")
        targets.append(" ".join(_LEXICON[w][1] for w in words) + " .")
    return Pairs(sources, targets)


# ---------------------------------------------------------------------------------------------
# Packing


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of packed examples. Source side: ``source`` ids, ``source_segments``,
    ``source_positions`` [rows, source_len]; target side likewise [rows, target_len]: ``target``
    (what the decoder predicts) and ``target_inputs`` (the same shifted right within each
    example, ``PAD_ID`` first: T5's decoder start). ``truncated``: examples cut to fit a row;
    ``padding``: the fraction of token slots (both sides) left empty."""

    arrays: dict[str, np.ndarray]
    examples: int
    truncated: int

    @property
    def rows(self) -> int:
        return len(self.arrays["source"])

    def __len__(self) -> int:  # a source of ``grain_io.EpochBatches``: rows are its examples
        return self.rows

    def batch(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``order`` as one batch."""
        return {k: v[order] for k, v in self.arrays.items()}

    def padded(self, multiple: int) -> Packed:
        """Grown to a multiple of ``multiple`` rows with empty rows (segment 0: masked)."""
        extra = -self.rows % multiple
        arrays = {k: np.concatenate([v, np.zeros((extra, v.shape[1]), v.dtype)])
                  for k, v in self.arrays.items()}  # fmt: skip
        return dataclasses.replace(self, arrays=arrays)

    def with_rows(self, rows: int) -> Packed:
        """The first ``rows`` rows, or all of them and empty rows (segment 0: masked) to make
        ``rows``. ``examples`` counts the rows kept; ``truncated`` still counts every row's."""
        if rows >= self.rows:
            return self.padded(rows)
        arrays = {k: v[:rows] for k, v in self.arrays.items()}
        kept = int(arrays["source_segments"].max(axis=1).sum())  # segment ids run 1..n per row
        return dataclasses.replace(self, arrays=arrays, examples=kept)

    @property
    def padding(self) -> float:
        slots = self.arrays["source"].size + self.arrays["target"].size
        used = np.count_nonzero(self.arrays["source_segments"]) + np.count_nonzero(
            self.arrays["target_segments"]
        )
        return 1.0 - used / slots


def pack(
    sources: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    order: Sequence[int],
    *,
    source_len: int,
    target_len: int,
    open_rows: int = 64,
) -> Packed:
    """Packs examples ``order`` (indices into ``sources``/``targets``) first-fit into rows.

    An example goes into the first of the last ``open_rows`` rows with room on both sides (a
    bounded window keeps packing linear in the examples), else starts a new row. An example
    longer than a row is cut to it (its last token stays ``EOS_ID``) and counted.
    """
    if source_len < 2 or target_len < 2:
        raise ValueError(f"rows need >= 2 tokens a side, got {source_len}, {target_len}")
    rows: list[list[int]] = []  # example indices per row
    room: list[tuple[int, int]] = []  # free (source, target) tokens per row
    cut = {}
    truncated = 0
    for i in order:
        s, t = len(sources[i]), len(targets[i])
        if s > source_len or t > target_len:
            truncated += 1
            s, t = min(s, source_len), min(t, target_len)
        cut[i] = (s, t)
        first = max(0, len(rows) - open_rows)
        for r in range(first, len(rows)):
            if room[r][0] >= s and room[r][1] >= t:
                rows[r].append(i)
                room[r] = (room[r][0] - s, room[r][1] - t)
                break
        else:
            rows.append([i])
            room.append((source_len - s, target_len - t))
    arrays = {
        name: np.zeros((len(rows), length), np.int32)
        for name, length in (
            ("source", source_len), ("source_segments", source_len),
            ("source_positions", source_len), ("target", target_len),
            ("target_inputs", target_len), ("target_segments", target_len),
            ("target_positions", target_len),
        )
    }  # fmt: skip
    for r, members in enumerate(rows):
        at_s = at_t = 0
        for segment, i in enumerate(members, 1):
            s, t = cut[i]
            src, tgt = sources[i][:s].copy(), targets[i][:t].copy()
            src[-1], tgt[-1] = EOS_ID, EOS_ID
            arrays["source"][r, at_s : at_s + s] = src
            arrays["source_segments"][r, at_s : at_s + s] = segment
            arrays["source_positions"][r, at_s : at_s + s] = np.arange(s)
            arrays["target"][r, at_t : at_t + t] = tgt
            arrays["target_inputs"][r, at_t + 1 : at_t + t] = tgt[:-1]  # PAD_ID starts it
            arrays["target_segments"][r, at_t : at_t + t] = segment
            arrays["target_positions"][r, at_t : at_t + t] = np.arange(t)
            at_s, at_t = at_s + s, at_t + t
    return Packed(arrays, examples=len(order), truncated=truncated)


@dataclasses.dataclass(frozen=True)
class Resampled:
    """Training rows for subword regularization: ``rows`` rows per epoch, rebuilt every epoch
    (``for_epoch``, which ``grain_io.EpochBatches`` calls) from a fresh sampled segmentation of
    every pair (``Tokenizer.sample`` with ``alpha`` and ``nbest``) packed in a fresh order.

    ``rows`` is what epoch 0 packs into (``Resampled.build``); a later epoch whose sampled
    pieces pack into more rows leaves its last examples out (a different few each epoch, the
    packing order being shuffled), one that packs into fewer gets empty rows, so every epoch has
    the same batches. A pure function of ``seed`` and the epoch. Building an epoch takes ~15-25 s
    for Multi30k's 29,000 pairs at 64-best on one core, inside a data reader (``EpochBatches``
    builds it when the epoch's first batch is read; the readers' buffer hides it here); it
    grows with the corpus, and every data worker builds every epoch.
    """

    tokenizer: Tokenizer
    pairs: Pairs
    alpha: float
    nbest: int
    seed: int
    source_len: int
    target_len: int
    rows: int
    # Epoch 0 as ``build`` packed it, for the first read; not an init field, so that
    # ``dataclasses.replace`` (another seed, say) starts without it.
    first: Packed | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, tokenizer: Tokenizer, pairs: Pairs, **kw: Any) -> tuple[Resampled, Packed]:
        """The source and its epoch 0 (which fixes ``rows``); ``kw``: the other fields."""
        first = cls(tokenizer, pairs, rows=0, **kw)._pack(0)
        source = cls(tokenizer, pairs, rows=first.rows, **kw)
        object.__setattr__(source, "first", first)  # frozen
        return source, first

    def __len__(self) -> int:
        return self.rows

    def for_epoch(self, epoch: int) -> Packed:
        """Epoch ``epoch``'s ``rows`` rows."""
        if epoch == 0 and self.first is not None:
            return self.first
        return self._pack(epoch).with_rows(self.rows)

    def __getstate__(self) -> dict[str, Any]:  # a worker builds its own epochs, 0 included
        return {**self.__dict__, "first": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _pack(self, epoch: int) -> Packed:
        draws, shuffle = np.random.SeedSequence((self.seed, epoch)).spawn(2)
        n = len(self.pairs)
        ids = self.tokenizer.sample(
            [*self.pairs.sources, *self.pairs.targets], alpha=self.alpha, nbest=self.nbest,
            seed=draws,
        )  # fmt: skip
        order = np.random.default_rng(shuffle).permutation(n)
        return pack(ids[:n], ids[n:], order, source_len=self.source_len,
                    target_len=self.target_len)  # fmt: skip
