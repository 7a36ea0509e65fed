"""Drug-target binding affinity (DTA) data: loaders and tokenizers (dta_batches.py batches them).

A ``DtaTable`` holds each distinct drug (SMILES) and protein (amino-acid sequence) once, plus one
row per measured pair that points into them; Davis has 68 drugs and 442 proteins but 30,056 pairs,
so everything per-molecule (tokenizing, and in the model, encoding) is done once per molecule,
never once per pair. Sources: a DeepDTA directory (``load_deepdta``), a CSV/TSV of (smiles,
sequence, affinity) rows (``load_dta_csv``) and a generated set with a hidden structure
(``synthetic_dta``). Every data problem raises ``DataError``, one line that names the file and the
record, so a bad download fails at load time and not as a NaN loss hours later.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from hopperjax.data import safe_pickle
from hopperjax.data.errors import DataError, one_line

# Our own alphabet, built from the SMILES grammar rather than from one data set, so that a new set
# rarely needs a new (incompatible) vocabulary. The order fixes the token ids: append, never insert.
SMILES_CHARSET = (
    "ABCDEFGHIKLMNOPRSTUVWXYZ"  # first letters of all element symbols (none starts with J or Q)
    "abcdefghiklmnoprstuvy"  # second letters of element symbols, and aromatic b c n o p s
    "0123456789"  # ring-closure digits, isotopes, charges and hydrogen counts
    "()[]=#$:+-@/\\.%*"  # branch, bracket atom, bonds, charge, chirality, cis/trans, dot, %nn, *
)
PROTEIN_CHARSET = "ABCDEFGHIKLMNOPQRSTUVWXYZ"  # 20 amino acids, U, O and ambiguity codes B Z X

# Motifs of ``synthetic_dta``'s hidden structure: amide, pyridine, sulfonyl, nitrile; the kinase
# glycine-rich loop, the HRD catalytic loop, the DFG and APE motifs.
DRUG_MOTIFS = ("C(=O)N", "c1ccncc1", "S(=O)(=O)", "C#N")
PROTEIN_MOTIFS = ("GTGSFG", "HRDLKP", "DFG", "APE")


class Tokenizer:
    """Characters -> int32 ids: 0 pads, 1..len(charset) are the characters, len(charset)+1 unknown.

    Args:
      charset: the known characters, each once.
      max_len: tokens per sequence; longer sequences are truncated (as DeepDTA does), shorter ones
        zero-padded. Only the kept characters are checked: cut ones never reach the model.
      unknown: a character outside ``charset`` raises ``DataError`` ("error"), makes ``encode``
        return None so that the caller drops the molecule ("skip"), or becomes the unknown id.
    """

    def __init__(
        self, charset: str, max_len: int, unknown: Literal["error", "skip", "unk"] = "error"
    ):
        if len(set(charset)) != len(charset) or not charset.isascii() or not charset:
            raise ValueError(f"charset must be distinct ASCII characters, got {charset!r}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if unknown not in ("error", "skip", "unk"):
            raise ValueError(f"unknown must be 'error', 'skip' or 'unk', got {unknown!r}")
        self.charset, self.max_len, self.unknown = charset, max_len, unknown
        self._ids = np.full(128, -1, np.int32)  # ASCII code -> id; -1 unknown
        self._ids[[ord(c) for c in charset]] = np.arange(1, len(charset) + 1)

    @property
    def vocab_size(self) -> int:
        return len(self.charset) + 2

    @property
    def unknown_id(self) -> int:
        return len(self.charset) + 1

    def encode(self, text: str, *, where: str) -> np.ndarray | None:
        """text -> [max_len] int32, or None for an unknown character under ``unknown="skip"``.

        Args:
          where: names the record in errors, e.g. "ligands_can.txt: drug '11314340'".
        """
        if not text:
            raise DataError(f"{where}: empty sequence")
        kept = text[: self.max_len]
        codes = np.frombuffer(kept.encode("utf-32-le"), np.uint32)  # one code point per character
        ids = np.where(codes < 128, self._ids[np.minimum(codes, 127)], -1)
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            if self.unknown == "error":
                i = int(bad[0])
                raise DataError(f"{where}: unknown character {kept[i]!r} at position {i}")
            if self.unknown == "skip":
                return None
            ids[bad] = self.unknown_id
        out = np.zeros(self.max_len, np.int32)
        out[: len(ids)] = ids
        return out


@dataclasses.dataclass(frozen=True)
class DtaTable:
    """Distinct drugs and proteins, and the measured pairs that index them.

    ``drug_index``, ``protein_index``: [pairs] int32; ``affinity``: [pairs] float32 (pKd, or the
    file's values). ``train_folds`` / ``test_fold``: pair indices of the DeepDTA split, else None.
    ``source`` names where the table came from, for messages; ``skipped`` counts the pairs dropped
    as bad records or for unknown characters. ``pkd``: True when ``affinity`` was converted from
    Kd (nM) to pKd, False when it holds the file's values, None when neither applies (synthetic).
    """

    drug_ids: list[str]
    drugs: list[str]
    protein_ids: list[str]
    proteins: list[str]
    drug_index: np.ndarray
    protein_index: np.ndarray
    affinity: np.ndarray
    train_folds: list[np.ndarray] | None
    test_fold: np.ndarray | None
    source: str
    skipped: int = 0
    pkd: bool | None = None

    def subset(self, pair_indices: Sequence[int] | np.ndarray) -> DtaTable:
        """The given pairs (same drug and protein lists); folds do not carry over."""
        idx = np.asarray(pair_indices, np.int64)
        return dataclasses.replace(
            self,
            drug_index=self.drug_index[idx],
            protein_index=self.protein_index[idx],
            affinity=self.affinity[idx],
            train_folds=None,
            test_fold=None,
        )


def _keep_pairs(table: DtaTable, keep: np.ndarray) -> DtaTable:
    """Drops the pairs where ``keep`` is False; fold indices follow the kept pairs."""
    new_index = np.cumsum(keep) - 1

    def remap(fold: np.ndarray) -> np.ndarray:
        return new_index[fold[keep[fold]]].astype(np.int64)

    return dataclasses.replace(
        table,
        drug_index=table.drug_index[keep],
        protein_index=table.protein_index[keep],
        affinity=table.affinity[keep],
        train_folds=None if table.train_folds is None else [remap(f) for f in table.train_folds],
        test_fold=None if table.test_fold is None else remap(table.test_fold),
        skipped=table.skipped + int((~keep).sum()),
    )


def load_restricted_pickle(path: str | Path) -> np.ndarray:
    """A numeric numpy array from a (Python 2 or 3) pickle, without running the pickle's code
    (``safe_pickle.load``). Raises: DataError naming the file (and a refused global)."""
    array = safe_pickle.load(path)
    if not isinstance(array, np.ndarray):
        raise DataError(f"{path}: holds a {type(array).__name__}, not a numpy array")
    if array.dtype.kind not in "biuf":
        raise DataError(f"{path}: holds a {array.dtype} array, not a numeric one")
    return array


def pkd_from_kd_nm(kd: np.ndarray | Sequence[float] | float) -> np.ndarray:
    """pKd = -log10(Kd in molar) from Kd in nM: 10 µM -> 5.0, 1 nM -> 9.0. Returns float64."""
    return -np.log10(np.asarray(kd, np.float64) / 1e9)


class _JsonObject(list):
    """The (key, value) pairs of one JSON object in file order, duplicates kept to report them."""


@contextlib.contextmanager
def _file_errors(path: Path) -> Iterator[None]:
    """Turns the errors of reading a text file into one-line DataErrors naming it."""
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _read_json(path: Path):
    with _file_errors(path):
        text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text, object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON (line {e.lineno}: {e.msg})") from None


def _read_id_map(path: Path, what: str) -> tuple[list[str], list[str]]:
    """A JSON object id -> sequence, in file order: (ids, sequences)."""
    pairs = _read_json(path)
    if not isinstance(pairs, _JsonObject):
        raise DataError(f"{path}: expected one JSON object of {what} id -> sequence")
    ids, values, seen = [], [], set()
    for key, value in pairs:
        if key in seen:
            raise DataError(f"{path}: {what} '{key}' appears twice")
        if not isinstance(value, str):
            raise DataError(f"{path}: {what} '{key}' is a {type(value).__name__}, not a string")
        seen.add(key)
        ids.append(key)
        values.append(value)
    return ids, values


def _read_matrix(root: Path) -> tuple[np.ndarray, Path]:
    pickled, text = root / "Y", root / "Y.txt"
    if pickled.exists():
        y, path = load_restricted_pickle(pickled), pickled
    elif text.exists():
        try:
            y, path = np.loadtxt(text, dtype=np.float64, ndmin=2), text
        except ValueError as e:
            raise DataError(f"{text}: not a whitespace-separated matrix ({one_line(e)})") from None
    else:
        raise DataError(f"{pickled}: no such file (nor {text.name})")
    if y.ndim != 2:
        raise DataError(f"{path}: affinity matrix has {y.ndim} dimensions, not 2")
    return y.astype(np.float64), path


TRAIN_FOLDS_FILE = "folds/train_fold_setting1.txt"  # DeepDTA's split, relative to its directory
TEST_FOLD_FILE = "folds/test_fold_setting1.txt"


def _index_array(values: object, path: Path, what: str) -> np.ndarray:
    if type(values) is not list or not all(type(v) is int for v in values):
        raise DataError(f"{path}: {what} must be a list of integer pair indices")
    return np.asarray(values, np.int64)


def _read_folds(root: Path) -> tuple[list[np.ndarray], np.ndarray] | None:
    """(training folds, test fold), each distinct pair indices not yet checked against Y; None
    when the directory has neither folds file."""
    train_path, test_path = root / TRAIN_FOLDS_FILE, root / TEST_FOLD_FILE
    if not train_path.exists() and not test_path.exists():
        return None
    train = _read_json(train_path)
    if not isinstance(train, list) or isinstance(train, _JsonObject) or not train:
        raise DataError(f"{train_path}: expected a JSON list of folds (lists of pair indices)")
    folds = [_index_array(f, train_path, f"fold {k}") for k, f in enumerate(train)]
    test = _index_array(_read_json(test_path), test_path, "test fold")
    values, counts = np.unique(np.concatenate(folds), return_counts=True)
    if (counts > 1).any():
        raise DataError(f"{train_path}: pair {values[counts > 1][0]} is in the folds twice")
    values, counts = np.unique(test, return_counts=True)
    if (counts > 1).any():
        raise DataError(f"{test_path}: pair {values[counts > 1][0]} is in the test fold twice")
    both = np.intersect1d(np.concatenate(folds), test)
    if both.size:
        raise DataError(f"{test_path}: pair {both[0]} is also in {train_path.name}")
    return folds, test


def _check_nan_at_fold_pairs(
    y: np.ndarray, y_path: Path, used: np.ndarray, drug_ids: list[str], protein_ids: list[str]
) -> None:
    """Raises naming ``y_path`` when a NaN sits at a pair the folds use.

    The folds number Y's measured (non-NaN) pairs, so a NaN where a value should be shifts the
    numbering and the folds then index past the last pair. When the folds (``used``: all their
    indices, distinct) are exactly 0..n-1 with n between the measured pairs and the cells of Y,
    they were made for a Y with n measured pairs: the NaN is the error, not the folds. Only when
    n is every cell (Davis) can we tell which NaN; otherwise (KIBA, where NaN means unmeasured)
    the first few are listed.
    """
    pairs = y.size - int(np.isnan(y).sum())
    needed = int(used.max()) + 1 if used.size else 0
    if not pairs < needed <= y.size or len(used) != needed or used.min() < 0:
        return
    nan = np.argwhere(np.isnan(y))  # [NaN cells, (drug, protein)], row-major
    if needed == y.size:
        i, j = nan[0]
        more = f" (and {len(nan) - 1} more)" if len(nan) > 1 else ""
        raise DataError(
            f"{y_path}: Y[{i}, {j}] (drug '{drug_ids[i]}', protein '{protein_ids[j]}') is NaN"
            f"{more}, but the folds use every pair of the {y.shape[0]} x {y.shape[1]} matrix"
        )
    cells = ", ".join(f"Y[{i}, {j}]" for i, j in nan[:3])
    cells += f", ... ({len(nan)} in all)" if len(nan) > 3 else ""
    raise DataError(
        f"{y_path}: NaN at a pair the folds use (they number {needed} measured pairs, Y has "
        f"{pairs}; its NaN are at {cells})"
    )


def _check_fold_range(root: Path, folds: list[np.ndarray], test: np.ndarray, pairs: int) -> None:
    named = [(TRAIN_FOLDS_FILE, f"fold {k}", f) for k, f in enumerate(folds)]
    for file, what, indices in [*named, (TEST_FOLD_FILE, "test fold", test)]:
        bad = np.flatnonzero((indices < 0) | (indices >= pairs))
        if bad.size:
            raise DataError(
                f"{root / file}: {what} index {indices[bad[0]]} is outside 0..{pairs - 1}"
            )


def load_deepdta(
    directory: str | Path,
    *,
    pkd: bool = True,
    bad_records: Literal["error", "skip"] = "error",
    ligands: str = "ligands_can.txt",
) -> DtaTable:
    """A DeepDTA data directory (Davis, KIBA) as a ``DtaTable``.

    Files: ``ligands`` (JSON object drug id -> SMILES), ``proteins.txt`` (JSON object protein id ->
    sequence), ``Y`` (pickled float matrix [drugs, proteins], NaN = not measured; or ``Y.txt``,
    the same as whitespace-separated text) and, optionally, ``folds/train_fold_setting1.txt`` and
    ``folds/test_fold_setting1.txt``, whose indices point into the measured pairs in row-major
    order, ``np.where(~np.isnan(Y))``, which is the pair order of the table.

    Args:
      pkd: ``Y`` holds Kd in nM (Davis); train on pKd = -log10(Kd / 1e9). False for KIBA scores.
      bad_records: a non-finite value, or a non-positive Kd when ``pkd``, raises ("error") or drops
        the pair from the table and the folds ("skip", counted in ``skipped``).
      ligands: the SMILES file; ``ligands_iso.txt`` holds isomeric SMILES.
    """
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"{root}: no such directory")
    drug_ids, drugs = _read_id_map(root / ligands, "drug")
    protein_ids, proteins = _read_id_map(root / "proteins.txt", "protein")
    y, y_path = _read_matrix(root)
    if y.shape != (len(drugs), len(proteins)):
        raise DataError(
            f"{y_path}: affinity matrix is {y.shape[0]} x {y.shape[1]}, but {ligands} has "
            f"{len(drugs)} drugs and proteins.txt has {len(proteins)} proteins"
        )
    rows, cols = np.nonzero(~np.isnan(y))  # row-major, the order the folds index
    if not rows.size:
        raise DataError(f"{y_path}: no measured pairs (every value is NaN)")
    values = y[rows, cols]
    bad = ~np.isfinite(values) | ((values <= 0) if pkd else False)
    if bad.any() and bad_records == "error":
        i = int(np.flatnonzero(bad)[0])
        why = "is not finite" if not np.isfinite(values[i]) else "is not a positive Kd (nM)"
        raise DataError(
            f"{y_path}: pair {i} (drug '{drug_ids[rows[i]]}', protein '{protein_ids[cols[i]]}'): "
            f"value {values[i]} {why}"
        )
    with np.errstate(divide="ignore", invalid="ignore"):  # bad values are dropped below
        affinity = pkd_from_kd_nm(values) if pkd else values
    train_folds, test_fold = _read_folds(root) or (None, None)
    if train_folds is not None:
        _check_nan_at_fold_pairs(
            y, y_path, np.concatenate([*train_folds, test_fold]), drug_ids, protein_ids
        )
        _check_fold_range(root, train_folds, test_fold, len(values))
    table = DtaTable(
        drug_ids=drug_ids,
        drugs=drugs,
        protein_ids=protein_ids,
        proteins=proteins,
        drug_index=rows.astype(np.int32),
        protein_index=cols.astype(np.int32),
        affinity=affinity.astype(np.float32),
        train_folds=train_folds,
        test_fold=test_fold,
        source=str(root),
        pkd=pkd,
    )
    if bad.all():
        raise DataError(f"{y_path}: every measured pair is a bad record")
    return _keep_pairs(table, ~bad) if bad.any() else table


_CSV_COLUMNS = ("smiles", "sequence", "affinity")


def _parse_row(row: list[str], columns: dict[str, int], width: int, pkd: bool):
    """(smiles, sequence, affinity), or the reason the row is bad."""
    if len(row) != width:
        return f"{len(row)} fields, the header has {width}"
    smiles, sequence, text = (row[columns[name]].strip() for name in _CSV_COLUMNS)
    for name, value in zip(_CSV_COLUMNS, (smiles, sequence, text), strict=True):
        if not value:
            return f"empty {name}"
    try:
        value = float(text)
    except ValueError:
        return f"affinity {text!r} is not a number"
    if not math.isfinite(value):
        return f"affinity {text!r} is not finite"
    if pkd and value <= 0:
        return f"affinity {text!r} is not a positive Kd (nM)"
    return smiles, sequence, value


def load_dta_csv(
    path: str | Path, *, bad_records: Literal["error", "skip"] = "error", pkd: bool = False
) -> DtaTable:
    """Pairs from a CSV file (``.tsv`` / ``.tab``: tab-separated) with a header row.

    The header names the columns ``smiles``, ``sequence`` and ``affinity`` (any case, any order;
    other columns are ignored). Repeated SMILES and sequences become one drug / protein, in
    first-seen order; their ids are "line N", the line where each first appears.

    Args:
      bad_records: a row with the wrong number of fields, an empty field, or an affinity that is
        not a finite number raises ``DataError`` naming the line ("error") or is skipped and
        counted in ``skipped`` ("skip").
      pkd: the affinity column is Kd in nM; convert it to pKd.
    """
    path = Path(path)
    delimiter = "\t" if path.suffix.lower() in (".tsv", ".tab") else ","
    drugs: dict[str, int] = {}
    proteins: dict[str, int] = {}
    drug_ids, protein_ids, drug_index, protein_index, affinity = [], [], [], [], []
    skipped = 0
    try:
        # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first column name.
        with _file_errors(path), path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = [name.strip().lower() for name in next(reader, [])]
            missing = [name for name in _CSV_COLUMNS if name not in header]
            if missing:
                found = ", ".join(name[:30] for name in header[:6]) + (", ..." * (len(header) > 6))
                raise DataError(
                    f"{path}: line 1: the header ({found}) lacks column(s) {', '.join(missing)}"
                )
            columns = {name: header.index(name) for name in _CSV_COLUMNS}
            for row in reader:
                if not any(field.strip() for field in row):
                    continue  # blank line
                parsed = _parse_row(row, columns, len(header), pkd)
                if isinstance(parsed, str):
                    if bad_records == "error":
                        raise DataError(f"{path}: line {reader.line_num}: {parsed}")
                    skipped += 1
                    continue
                smiles, sequence, value = parsed
                if smiles not in drugs:
                    drugs[smiles] = len(drugs)
                    drug_ids.append(f"line {reader.line_num}")
                if sequence not in proteins:
                    proteins[sequence] = len(proteins)
                    protein_ids.append(f"line {reader.line_num}")
                drug_index.append(drugs[smiles])
                protein_index.append(proteins[sequence])
                affinity.append(value)
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: {one_line(e)}") from None
    if not affinity:
        raise DataError(f"{path}: no pairs ({skipped} bad rows skipped)")
    values = np.asarray(affinity, np.float64)
    return DtaTable(
        drug_ids=drug_ids,
        drugs=list(drugs),
        protein_ids=protein_ids,
        proteins=list(proteins),
        drug_index=np.asarray(drug_index, np.int32),
        protein_index=np.asarray(protein_index, np.int32),
        affinity=(pkd_from_kd_nm(values) if pkd else values).astype(np.float32),
        train_folds=None,
        test_fold=None,
        source=str(path),
        skipped=skipped,
        pkd=pkd,
    )


def motif_counts(strings: Sequence[str], motifs: Sequence[str]) -> np.ndarray:
    """Occurrences (overlapping) of each motif in each ASCII string: [strings, motifs] int64.

    Vectorized over one joined buffer, so that millions of characters take milliseconds.
    """
    lengths = np.fromiter(map(len, strings), np.int64, len(strings))
    starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
    # "\n" is in no motif, so no match spans two strings.
    buf = np.frombuffer("\n".join(strings).encode("ascii"), np.uint8)
    counts = np.zeros((len(strings), len(motifs)), np.int64)
    for k, motif in enumerate(motifs):
        pattern = np.frombuffer(motif.encode("ascii"), np.uint8)
        n = len(buf) - len(pattern) + 1
        if n <= 0:
            continue
        hit = np.ones(n, bool)
        for j, code in enumerate(pattern):
            hit &= buf[j : j + n] == code
        owner = np.searchsorted(starts, np.flatnonzero(hit), side="right") - 1
        counts[:, k] = np.bincount(owner, minlength=len(strings))
    return counts


def _random_strings(
    rng: np.random.Generator,
    count: int,
    length: tuple[int, int],
    filler: str,
    motifs: Sequence[str],
    per_100: float,
) -> list[str]:
    """Random filler characters with motifs written over them at random places.

    Each string draws its own rate per motif (exponential around ``per_100`` per 100 characters),
    so motif counts differ a lot between strings: that variation is what the affinity encodes.
    """
    lengths = rng.integers(length[0], length[1] + 1, count)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    alphabet = np.frombuffer(filler.encode("ascii"), np.uint8)
    buf = alphabet[rng.integers(0, len(alphabet), int(lengths.sum()))]
    for motif in motifs:
        pattern = np.frombuffer(motif.encode("ascii"), np.uint8)
        rates = rng.exponential(per_100, count) * lengths / 100
        owner = np.repeat(np.arange(count), rng.poisson(rates))
        room = lengths[owner] - len(pattern) + 1
        at = starts[owner] + (rng.random(len(owner)) * room).astype(np.int64)
        buf[at[:, None] + np.arange(len(pattern))] = pattern  # [insertions, motif length]
    text = buf.tobytes().decode("ascii")
    return [text[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


# Whole fragments a random chain is built from: each keeps every atom's valence legal wherever
# it is joined (a nitrile only as a branch: "C#N" followed by an atom would give nitrogen four
# bonds). The motifs of ``DRUG_MOTIFS`` are written as such fragments too.
FILLER_FRAGMENTS = ("C", "C", "C", "CC", "N", "O", "C(C)", "C(=O)", "c1ccccc1", "C1CCNCC1")
MOTIF_FRAGMENTS = {
    "C(=O)N": "C(=O)N",
    "c1ccncc1": "c1ccncc1",
    "S(=O)(=O)": "S(=O)(=O)",
    "C#N": "C(C#N)",
}


def fragment_smiles(
    rng: np.random.Generator,
    count: int,
    length: tuple[int, int],
    motifs: Sequence[str],
    per_100: float,
) -> list[str]:
    """``count`` random valid SMILES of ``length`` characters or a fragment more: each motif
    fragment comes a per-molecule number of times (Poisson, its rate exponential around
    ``per_100`` per 100 characters; at most the length's worth), ``FILLER_FRAGMENTS`` fill the
    rest, all in random order (as ``_random_strings`` does for plain strings)."""
    targets = rng.integers(length[0], length[1] + 1, count)
    out = []
    for target in targets.tolist():
        pieces = [
            MOTIF_FRAGMENTS[motif]
            for motif in motifs
            for _ in range(rng.poisson(rng.exponential(per_100) * target / 100))
        ]
        rng.shuffle(pieces)
        while pieces and sum(map(len, pieces)) > target:
            pieces.pop()
        size = sum(map(len, pieces))
        while size < target:
            piece = FILLER_FRAGMENTS[rng.integers(len(FILLER_FRAGMENTS))]
            pieces.append(piece)
            size += len(piece)
        rng.shuffle(pieces)
        out.append("".join(pieces))
    return out


def _standardize(counts: np.ndarray) -> np.ndarray:
    return (counts - counts.mean(0)) / (counts.std(0) + 1e-6)


def synthetic_dta(
    *,
    num_drugs: int,
    num_proteins: int,
    num_pairs: int,
    seed: int = 0,
    drug_len: tuple[int, int] = (30, 80),
    protein_len: tuple[int, int] = (200, 1000),
    valid_smiles: bool = False,
) -> DtaTable:
    """Random drugs, proteins and pairs whose affinity a model can learn only from the sequences.

    Drugs are SMILES-like strings (mostly C, c, N, O, branches, ring digits) and proteins random
    amino-acid strings, with the motifs ``DRUG_MOTIFS`` / ``PROTEIN_MOTIFS`` written in at
    rates that vary per molecule. With ``d`` = the drug's standardized motif counts
    (``motif_counts``, standardized over the drugs; [4]) and ``p`` the protein's ([4]):

        affinity = 6 + 0.6 * u.d + 0.4 * v.p + 0.8 * d^T W p + 0.1 * noise

    where ``u``, ``v``, ``W`` (and the noise, N(0, 1)) are drawn from ``seed``. Noise is ~2 % of
    the variance; the drug and protein effects alone explain 20-60 % of it, depending on the
    seed, and the drug-protein interaction the rest: a model must read both sequences to fit it.
    Pairs are drawn uniformly with replacement. Vectorized: only the distinct molecules are
    strings, so tens of millions of pairs take seconds. ``valid_smiles``: drugs are chains of
    whole fragments that RDKit parses (``fragment_smiles``; the graph encoder needs
    them) instead of random characters; the motifs and the affinity formula are the same.
    """
    for name, value in (("drugs", num_drugs), ("proteins", num_proteins), ("pairs", num_pairs)):
        if value < 1:
            raise ValueError(f"num_{name} must be >= 1, got {value}")
    for name, (lo, hi), motifs in (
        ("drug_len", drug_len, DRUG_MOTIFS),
        ("protein_len", protein_len, PROTEIN_MOTIFS),
    ):
        if not max(map(len, motifs)) <= lo <= hi:
            raise ValueError(f"{name} must be (lo, hi) with {max(map(len, motifs))} <= lo <= hi")
    rng = np.random.default_rng(seed)
    if valid_smiles:
        drugs = fragment_smiles(rng, num_drugs, drug_len, DRUG_MOTIFS, 2.0)
    else:
        drugs = _random_strings(rng, num_drugs, drug_len, "CCCCCCcccccNNOO()=12", DRUG_MOTIFS, 2.0)
    proteins = _random_strings(
        rng, num_proteins, protein_len, "ACDEFGHIKLMNPQRSTVWY", PROTEIN_MOTIFS, 0.5
    )
    d = _standardize(motif_counts(drugs, DRUG_MOTIFS))  # [drugs, 4]
    p = _standardize(motif_counts(proteins, PROTEIN_MOTIFS))  # [proteins, 4]
    k, m = len(DRUG_MOTIFS), len(PROTEIN_MOTIFS)
    u, v = rng.normal(size=k) / np.sqrt(k), rng.normal(size=m) / np.sqrt(m)
    w = rng.normal(size=(k, m)) / np.sqrt(k * m)
    drug_index = rng.integers(0, num_drugs, num_pairs)
    protein_index = rng.integers(0, num_proteins, num_pairs)
    interaction = np.einsum("pm,pm->p", (d @ w)[drug_index], p[protein_index])  # [pairs]
    affinity = (
        6.0
        + 0.6 * (d @ u)[drug_index]
        + 0.4 * (p @ v)[protein_index]
        + 0.8 * interaction
        + 0.1 * rng.normal(size=num_pairs)
    )
    return DtaTable(
        drug_ids=[f"D{i}" for i in range(num_drugs)],
        drugs=drugs,
        protein_ids=[f"P{i}" for i in range(num_proteins)],
        proteins=proteins,
        drug_index=drug_index.astype(np.int32),
        protein_index=protein_index.astype(np.int32),
        affinity=affinity.astype(np.float32),
        train_folds=None,
        test_fold=None,
        source=f"synthetic(seed={seed}, drugs={num_drugs}, proteins={num_proteins})",
    )


def _encode_all(
    texts: list[str], ids: list[str], tokenizer: Tokenizer, where: str
) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(texts), tokenizer.max_len), np.int32)
    keep = np.ones(len(texts), bool)
    for i, (name, text) in enumerate(zip(ids, texts, strict=True)):
        row = tokenizer.encode(text, where=f"{where} '{name}'")
        if row is None:
            keep[i] = False
        else:
            tokens[i] = row
    return tokens, keep


def tokenize_table(
    table: DtaTable, drug_tokenizer: Tokenizer, protein_tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray, DtaTable]:
    """Token tables of the distinct molecules, and the table whose indices point into them.

    Under ``unknown="skip"`` the molecules that do not encode are removed, with the pairs that use
    them (counted in ``skipped``); the returned table's indices and folds point at what is left.

    Returns:
      (drug_tokens [n_drugs, Ld] int32, protein_tokens [n_proteins, Lp] int32, table).

    Raises:
      DataError: naming ``table.source`` and the drug or protein id.
    """
    drug_tokens, drug_keep = _encode_all(
        table.drugs, table.drug_ids, drug_tokenizer, f"{table.source}: drug"
    )
    protein_tokens, protein_keep = _encode_all(
        table.proteins, table.protein_ids, protein_tokenizer, f"{table.source}: protein"
    )
    if drug_keep.all() and protein_keep.all():
        return drug_tokens, protein_tokens, table
    pair_keep = drug_keep[table.drug_index] & protein_keep[table.protein_index]
    if not pair_keep.any():
        raise DataError(f"{table.source}: every pair uses a molecule with unknown characters")
    kept = _keep_pairs(table, pair_keep)
    new_drug, new_protein = np.cumsum(drug_keep) - 1, np.cumsum(protein_keep) - 1
    kept = dataclasses.replace(
        kept,
        drug_ids=[x for x, k in zip(table.drug_ids, drug_keep, strict=True) if k],
        drugs=[x for x, k in zip(table.drugs, drug_keep, strict=True) if k],
        protein_ids=[x for x, k in zip(table.protein_ids, protein_keep, strict=True) if k],
        proteins=[x for x, k in zip(table.proteins, protein_keep, strict=True) if k],
        drug_index=new_drug[kept.drug_index].astype(np.int32),
        protein_index=new_protein[kept.protein_index].astype(np.int32),
    )
    return drug_tokens[drug_keep], protein_tokens[protein_keep], kept
