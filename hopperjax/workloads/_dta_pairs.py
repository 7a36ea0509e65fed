"""The drug-target affinity workload's pairs (``workloads/dta.py`` uses and re-exports them):
read as the run's config says (``data.source``: a DeepDTA directory, a CSV/TSV, a synthetic set,
or ArrayRecord shards; ``model.drug_encoder: gin`` adds each drug's graph), then split into
training and held-out pairs (DeepDTA's folds, or a seeded random ``data.eval_fraction``). Data
errors become one-line ``ConfigError``s on the key at fault (``data.path``, ``data.valid_fold``,
...). A module of the workload, not of ``data/``: it reads the run's config, which the sources it
composes (``molecules``, ``mol_graphs``, ``dta_shards``, ``dta_batches``) never do. A
``DataConfig`` here is the workload's ``AffinityData`` (not imported: that would be a cycle)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax.config import Config, ConfigError, DataConfig
from hopperjax.data import dta_batches, dta_shards, mol_graphs, molecules


def load_table(config: Config) -> molecules.DtaTable:
    """The run's pairs, as ``data.source`` says; data errors become config errors on data.path."""
    d = config.data
    try:
        if d.source == "deepdta":
            return molecules.load_deepdta(d.path, pkd=d.pkd, bad_records=d.bad_records)
        if d.source == "csv":
            return molecules.load_dta_csv(d.path, pkd=d.pkd, bad_records=d.bad_records)
        return molecules.synthetic_dta(
            num_drugs=d.synthetic_drugs,
            num_proteins=d.synthetic_proteins,
            num_pairs=d.synthetic_pairs,
            seed=config.seed,
            valid_smiles=d.synthetic_smiles,
        )
    except molecules.DataError as e:
        raise ConfigError("data.path", str(e)) from None


def split_pairs(
    folds: tuple[list[np.ndarray], np.ndarray] | None, num_pairs: int, config: Config
) -> tuple[np.ndarray, np.ndarray]:
    """(train pair indices, eval pair indices).

    DeepDTA ``folds`` (training folds, test fold): train on every training fold but
    ``data.valid_fold`` (null: on all of them); evaluate on that fold, or on the test fold with
    ``data.eval_split: test``. Without folds: a seeded random split with ``data.eval_fraction``
    held out.

    Raises:
      ConfigError: the held-out fold is empty (naming the key that selects it and the folds
        file), or ``data.eval_split`` is ``test`` without folds.
    """
    d = config.data
    if folds is not None:
        train_folds, test_fold = folds
        if d.valid_fold is not None and d.valid_fold >= len(train_folds):
            raise ConfigError("data.valid_fold", f"the data has {len(train_folds)} folds")
        train = np.concatenate([f for i, f in enumerate(train_folds) if i != d.valid_fold])
        if d.eval_split == "test":
            key, held, what = "data.eval_split", test_fold, "the test fold"
        else:
            key, held, what = "data.valid_fold", train_folds[d.valid_fold], f"fold {d.valid_fold}"
        if not len(held):
            raise ConfigError(key, f"{what} of {_folds_file(d)} has no pairs to evaluate on")
        return train.astype(np.int64), np.asarray(held, np.int64)
    where = {"deepdta": f"{d.path} has no folds/", "shards": f"{d.path} has no folds"}.get(
        d.source, f"data.source={d.source} has no folds"
    )
    if d.valid_fold is None:  # validation let it through with eval_split: test; say the cause
        raise ConfigError(
            "data.valid_fold",
            f"null trains on every DeepDTA training fold, but {where}; leave it out (a random "
            f"data.eval_fraction of the pairs is held out)",
        )
    if d.eval_split == "test":  # a random split is no held-out test set: never report it as one
        raise ConfigError(
            "data.eval_split",
            f"'test' needs DeepDTA's held-out test fold, but {where}; use data.eval_split=valid "
            f"(a random data.eval_fraction of the pairs)",
        )
    order = np.random.default_rng(config.seed).permutation(num_pairs)
    held = max(1, round(num_pairs * d.eval_fraction))
    return np.sort(order[held:]), np.sort(order[:held])


def _folds_file(data: DataConfig) -> Path:
    """Where the folds of ``data`` come from (for messages)."""
    if data.source == "shards":
        return Path(data.path) / dta_shards.META_NAME
    return Path(data.path) / (
        molecules.TEST_FOLD_FILE if data.eval_split == "test" else molecules.TRAIN_FOLDS_FILE
    )


@dataclasses.dataclass(frozen=True)
class PairData:
    """A random-access source over all of a run's pairs, with what the batches need to know."""

    pairs: Any  # dta_batches.PairIds (a table in memory) or dta_shards.ArrayRecordPairs
    drugs: int  # distinct drugs and proteins: they size the per-batch tables
    proteins: int
    folds: tuple[list[np.ndarray], np.ndarray] | None
    source: str
    skipped: int
    drug_index: np.ndarray | None = None  # per pair, when the pairs come from a table in memory
    protein_index: np.ndarray | None = None
    tokens: tuple[np.ndarray, np.ndarray] | None = None  # then pairs are ids into these tables
    graphs: tuple[np.ndarray, np.ndarray] | None = None  # per drug id, for the graph encoder


def load_pairs(config: Config) -> PairData:
    """The run's pairs: a table in memory (DeepDTA, CSV, synthetic) or ArrayRecord shards.

    Raises:
      ConfigError: unreadable or bad data (``data.path``), shards written with other token
        lengths or targets than the config's (``data.drug_max_len``, ``data.protein_max_len``,
        ``data.pkd``), or a molecule larger than the graph allows (``data.drug_max_atoms``).
    """
    d = config.data
    try:
        if d.source == "shards":
            shards = dta_shards.read_shards(d.path)
            for key in ("drug_max_len", "protein_max_len"):
                if getattr(shards, key) != getattr(d, key):
                    raise ConfigError(
                        f"data.{key}",
                        f"{d.path} holds tokens of length {getattr(shards, key)}, "
                        f"got {getattr(d, key)}",
                    )
            if shards.pkd is not None and shards.pkd != d.pkd:
                held = "pKd (converted from Kd)" if shards.pkd else "the file's values (no pKd)"
                raise ConfigError("data.pkd", f"{d.path} holds {held}, got {d.pkd}")
            folds = None if shards.splits is None else (shards.train_folds, shards.test_fold)
            return PairData(
                dta_shards.open_pairs(shards),
                shards.drugs,
                shards.proteins,
                folds,
                shards.source,
                shards.skipped,
            )
        drug_tok, protein_tok = tokenizers(d)
        drug_tokens, protein_tokens, table = molecules.tokenize_table(
            load_table(config), drug_tok, protein_tok
        )
        graphs = None
        if config.model.drug_encoder == "gin":
            graphs = mol_graphs.graph_table(
                table.drugs, d.drug_max_atoms, names=table.drug_ids, source=table.source
            )
    except mol_graphs.TooLarge as e:
        raise ConfigError("data.drug_max_atoms", str(e)) from None
    except molecules.DataError as e:
        raise ConfigError("data.path", str(e)) from None
    pairs = dta_batches.PairIds(table.drug_index, table.protein_index, table.affinity)
    folds = None if table.train_folds is None else (table.train_folds, table.test_fold)
    return PairData(
        pairs,
        len(table.drugs),
        len(table.proteins),
        folds,
        table.source,
        table.skipped,
        drug_index=np.asarray(table.drug_index, np.int64),
        protein_index=np.asarray(table.protein_index, np.int64),
        tokens=(drug_tokens, protein_tokens),
        graphs=graphs,
    )


def tokenizers(data: DataConfig) -> tuple[molecules.Tokenizer, molecules.Tokenizer]:
    """The (drug, protein) tokenizers the data config asks for."""
    return (
        molecules.Tokenizer(molecules.SMILES_CHARSET, data.drug_max_len, data.unknown_chars),
        molecules.Tokenizer(molecules.PROTEIN_CHARSET, data.protein_max_len, data.unknown_chars),
    )
