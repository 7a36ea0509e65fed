"""Drug-target binding affinity regression (the flagship workload): pairs in, pKd out.

Data: a DeepDTA directory, a CSV/TSV of (smiles, sequence, affinity), or a synthetic set
(``data/molecules.py``). A batch holds each distinct drug and protein once plus, per pair, the
rows it uses (``models/dta.py``). Train loss is the MSE; eval reports MSE, concordance index,
rm2 and Pearson over the whole eval split (``scoring.py``), so the eval step returns
predictions, not sums.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import scoring
from hopperjax.config import Config, ConfigError, DtaConfig
from hopperjax.data import molecules
from hopperjax.workloads.base import Datasets, Field

TABLE_ROW_MULTIPLE = 8  # distinct-row tables are padded to this, so they shard over the devices


def load_table(config: Config) -> molecules.DtaTable:
    """The run's pairs, as ``data.source`` says; data errors become config errors on data.path."""
    d = config.data
    try:
        if d.source == "deepdta":
            return molecules.load_deepdta(d.path, pkd=d.pkd, bad_records=d.bad_records)
        if d.source == "dta_csv":
            return molecules.load_dta_csv(d.path, pkd=d.pkd, bad_records=d.bad_records)
        return molecules.synthetic_dta(
            num_drugs=d.synthetic_drugs,
            num_proteins=d.synthetic_proteins,
            num_pairs=d.synthetic_pairs,
            seed=config.seed,
        )
    except molecules.DataError as e:
        raise ConfigError("data.path", str(e)) from None


def split_pairs(table: molecules.DtaTable, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(train pair indices, eval pair indices).

    DeepDTA folds: train on every training fold but ``data.valid_fold``; evaluate on that fold,
    or on the test fold with ``data.eval_split: test``. Without folds: a seeded random split with
    ``data.eval_fraction`` held out.
    """
    d = config.data
    if table.train_folds is not None:
        folds = table.train_folds
        if d.valid_fold >= len(folds):
            raise ConfigError("data.valid_fold", f"{table.source} has {len(folds)} folds")
        train = np.concatenate([f for i, f in enumerate(folds) if i != d.valid_fold])
        held = table.test_fold if d.eval_split == "test" else folds[d.valid_fold]
        return train.astype(np.int64), np.asarray(held, np.int64)
    order = np.random.default_rng(config.seed).permutation(len(table.affinity))
    held = max(1, round(len(order) * d.eval_fraction))
    return np.sort(order[held:]), np.sort(order[:held])


def table_rows(local_batch: int, distinct: int, dta: DtaConfig) -> int:
    """Rows of a per-process distinct-drug (or protein) table for ``local_batch`` pairs."""
    rows = min(local_batch, distinct) if dta.deduplicate else local_batch
    return -(-rows // TABLE_ROW_MULTIPLE) * TABLE_ROW_MULTIPLE


def to_model_batch(
    batch: dict[str, np.ndarray], *, drug_rows: int, protein_rows: int, block: int, dedup: bool
) -> dict[str, np.ndarray]:
    """A batch of pairs -> distinct-row tables + per-pair indices (offset to this process's block
    of the global tables)."""
    if dedup:
        out = molecules.dedup_batch(
            {k: batch[k] for k in ("drug", "protein", "affinity")},
            drug_rows=drug_rows,
            protein_rows=protein_rows,
        )
    else:
        pairs = len(batch["affinity"])
        out = {
            "drug_tokens": _pad_rows(batch["drug"], drug_rows),
            "protein_tokens": _pad_rows(batch["protein"], protein_rows),
            "drug_index": np.arange(pairs, dtype=np.int32),
            "protein_index": np.arange(pairs, dtype=np.int32),
            "affinity": batch["affinity"].astype(np.float32),
        }
    out["drug_index"] = (out["drug_index"] + block * drug_rows).astype(np.int32)
    out["protein_index"] = (out["protein_index"] + block * protein_rows).astype(np.int32)
    out["weight"] = batch["weight"].astype(np.float32)
    return out


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)])


class AffinityRegression:
    examples_name = "pairs"

    def build_datasets(self, config: Config, *, process_index: int, process_count: int) -> Datasets:
        d, t = config.data, config.train
        drug_tok = molecules.Tokenizer(molecules.SMILES_CHARSET, d.drug_max_len, d.unknown_chars)
        protein_tok = molecules.Tokenizer(
            molecules.PROTEIN_CHARSET, d.protein_max_len, d.unknown_chars
        )
        try:
            drug_tokens, protein_tokens, table = molecules.tokenize_table(
                load_table(config), drug_tok, protein_tok
            )
        except molecules.DataError as e:
            raise ConfigError("data.path", str(e)) from None
        train_idx, eval_idx = split_pairs(table, config)
        eval_batch = t.eval_batch_size or t.batch_size
        if len(train_idx) < t.batch_size:
            raise ConfigError(
                "train.batch_size", f"{table.source} has {len(train_idx)} training pairs"
            )
        # Pad the eval split to whole global batches with weight-0 copies: every pair is scored.
        padded = -(-len(eval_idx) // eval_batch) * eval_batch
        eval_weights = np.r_[np.ones(len(eval_idx)), np.zeros(padded - len(eval_idx))]
        eval_idx = np.r_[eval_idx, np.full(padded - len(eval_idx), eval_idx[0])]

        def batches(indices, weights, local_batch):
            rows = dict(
                drug_rows=table_rows(local_batch, len(table.drugs), config.dta),
                protein_rows=table_rows(local_batch, len(table.proteins), config.dta),
            )
            source = molecules.PairSource(
                drug_tokens,
                protein_tokens,
                table.drug_index[indices],
                table.protein_index[indices],
                table.affinity[indices],
                weight=weights,
            )
            convert = functools.partial(
                to_model_batch, block=process_index, dedup=config.dta.deduplicate, **rows
            )
            return grain.MapDataset.source(source)[process_index::process_count], convert

        local = t.batch_size // process_count
        train_ds, convert = batches(train_idx, np.ones(len(train_idx)), local)
        if d.shuffle:
            train_ds = train_ds.shuffle(seed=config.seed)
        train_ds = train_ds.repeat(None).batch(local, drop_remainder=True).map(convert)
        eval_local = eval_batch // process_count
        eval_ds, convert = batches(eval_idx, eval_weights, eval_local)
        eval_ds = eval_ds.batch(eval_local, drop_remainder=True).map(convert)
        return Datasets(
            train=train_ds,
            eval=eval_ds,
            info={
                "drugs": len(table.drugs),
                "proteins": len(table.proteins),
                "train_pairs": len(train_idx),
                "eval_pairs": int(eval_weights.sum()),
                "skipped": table.skipped,
                "process_count": process_count,
            },
        )

    def batch_fields(self, config: Config, batch_size: int, datasets: Datasets) -> dict[str, Field]:
        info, d = datasets.info, config.data
        processes = info.get("process_count", 1)
        local = batch_size // processes
        drug_rows = processes * table_rows(local, info.get("drugs", local), config.dta)
        protein_rows = processes * table_rows(local, info.get("proteins", local), config.dta)
        pairs = (batch_size,)
        return {
            "drug_tokens": Field((drug_rows, d.drug_max_len), jnp.int32, ("batch", None)),
            "protein_tokens": Field((protein_rows, d.protein_max_len), jnp.int32, ("batch", None)),
            "drug_index": Field(pairs, jnp.int32, ("batch",)),
            "protein_index": Field(pairs, jnp.int32, ("batch",)),
            "affinity": Field(pairs, jnp.float32, ("batch",)),
            "weight": Field(pairs, jnp.float32, ("batch",)),
        }

    def model_inputs(self, batch: dict[str, jax.Array]) -> tuple[Any, ...]:
        return ({k: batch[k] for k in ("drug_tokens", "protein_tokens", "drug_index",
                                       "protein_index")},)  # fmt: skip

    def loss(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        w = batch["weight"]
        return (w * (outputs - batch["affinity"]) ** 2).sum() / jnp.maximum(w.sum(), 1.0)

    def eval_outputs(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {"prediction": outputs, "affinity": batch["affinity"], "weight": batch["weight"]}

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        joined = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in outputs[0]}
        keep = joined["weight"] > 0
        scores = scoring.regression_scores(joined["affinity"][keep], joined["prediction"][keep])
        return {
            "eval_loss": scores["mse"],
            **{f"eval_{k}": v for k, v in scores.items()},
            "eval_pairs": float(keep.sum()),
        }

    def examples_per_batch_row(self, config: Config) -> int:
        return 1

    def model_flops_per_step(self, config: Config, batch_size: int, datasets: Datasets) -> float:
        fields = self.batch_fields(config, batch_size, datasets)
        drugs = fields["drug_tokens"].shape[0]
        proteins = fields["protein_tokens"].shape[0]
        forward = (
            drugs * encoder_flops(config.dta, "drug", config.data.drug_max_len)
            + proteins * encoder_flops(config.dta, "protein", config.data.protein_max_len)
            + batch_size * head_flops(config.dta)
        )
        return 3.0 * forward


def encoder_flops(dta: DtaConfig, which: str, length: int) -> float:
    """Forward FLOPs of encoding one sequence (multiply-adds x 2; embeddings are lookups)."""
    kind = dta.drug_encoder if which == "drug" else dta.protein_encoder
    if kind == "transformer":
        d = dta.d_model
        # qkv 3d^2, out d^2, MLP 8d^2 per token per layer; scores and values 2Ld per token.
        return 2.0 * dta.layers * length * (12 * d * d + 2 * length * d)
    kernel = dta.drug_kernel if which == "drug" else dta.protein_kernel
    pool = 1 if which == "drug" else dta.protein_pool
    total, channels, size = 0.0, dta.embed_dim, length
    for i, width in enumerate((1, 2, 3)):
        out = dta.filters * width
        size = size - kernel + 1
        total += 2.0 * size * kernel * channels * out
        channels = out
        if pool > 1 and i < 2:
            size //= pool
    return total


def head_flops(dta: DtaConfig) -> float:
    def width(kind: str) -> int:
        return dta.d_model if kind == "transformer" else 3 * dta.filters

    sizes = [width(dta.drug_encoder) + width(dta.protein_encoder), *dta.head_sizes, 1]
    return 2.0 * sum(a * b for a, b in itertools.pairwise(sizes))
