"""Drug-target binding affinity regression (the flagship workload): pairs in, pKd out.

Data: a DeepDTA directory, a CSV/TSV of (smiles, sequence, affinity), a synthetic set
(``data/molecules.py``), or ArrayRecord shards of any of them (``data/dta_shards.py``), read and
split into folds by ``workloads/_dta_pairs.py``. A batch holds each distinct drug and protein once
plus, per pair, the rows it uses (``models/dta.py``).
Train loss is the MSE; eval reports MSE, concordance index, rm2 and Pearson over the whole eval
split (``scoring.py``), so the eval step returns predictions, not sums.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Literal

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np

from hopperjax import config as config_lib
from hopperjax import scoring
from hopperjax.config import Config, ConfigError, RematConfig
from hopperjax.data import dta_batches, mol_graphs
from hopperjax.data.datasets import not_found
from hopperjax.models import dta as dta_model
from hopperjax.models.transformer import BLOCK_ACTIVATIONS, BLOCK_DENSE_LAYERS
from hopperjax.parallel.rules import LOGICAL_AXIS_RULES
from hopperjax.precision import Policy
from hopperjax.workloads._dta_pairs import load_pairs, split_pairs, tokenizers
from hopperjax.workloads._dta_pairs import load_table as load_table  # re-exported
from hopperjax.workloads.base import Datasets, Field, ProcessShard, Workload

# Logical axes of the drugs' graph (``gin``): its atom slots and its directed-bond slots.
GRAPH_ATOMS, GRAPH_BONDS = "graph_atoms", "graph_bonds"


@dataclasses.dataclass(frozen=True)
class AffinityData(config_lib.DataConfig):
    """The ``data:`` group of drug-target affinity.

    ``source``: ``deepdta`` (a DeepDTA directory: JSON ligands and proteins, the affinity matrix
    ``Y``, ``folds/``), ``csv`` (a CSV/TSV file with columns smiles, sequence, affinity),
    ``synthetic`` (generated pairs with a hidden structure, for scale tests) or ``shards`` (a
    directory of ArrayRecord shards written by ``tools/convert_dta.py`` from any of these; read
    by grain, with ``workers`` processes). ``valid_fold``: the DeepDTA training fold held out for
    eval when ``eval_split`` is ``valid``; ``eval_split: test`` evaluates on the test fold
    instead (report, never select, on it); ``valid_fold: null`` holds no training fold out and
    trains on all five (GraphDTA's split: its only eval is then the test fold, so it needs
    ``eval_split: test`` and a step fixed in advance). Without folds, ``eval_fraction`` of the
    pairs, drawn with the run's seed, is held out (and ``eval_split: test`` is refused). ``group_by:
    protein`` (or ``drug``) orders each epoch group by group, in random order, so a batch holds
    the pairs of a few proteins and the model encodes a few instead of hundreds. ``group_mix``:
    groups shuffled together per stretch of the order, so a batch holds at least about that many
    (1: one group after another; more: closer to i.i.d. batches, more molecules to encode).
    ``deduplicate``: encode each distinct drug and protein of a batch once and gather per pair
    (same predictions, far fewer FLOPs). ``standardize``: the head predicts (affinity - mean) /
    std with the training split's mean and std (checkpointed with the model, undone for every
    prediction and score), and the loss is the MSE of standardized affinities, so its scale, the
    gradients' and the head's starting point do not depend on the dataset's units (pKd, KIBA
    scores); ``eval_loss`` is then standardized too, ``eval_mse`` stays in the data's units.
    ``drug_max_atoms``: heavy-atom slots per drug graph (``model.drug_encoder: gin``; a bigger
    molecule is refused, naming it). ``pack_graphs``: a batch's drug graphs lie one after
    another in slots sized by the data's largest molecules (``mol_graphs.batch_graph``), rather
    than each padded to ``drug_max_atoms``; the same encoding, on Davis a third of the atom
    slots and a sixth of the bond slots; either way the step compiles once.
    ``synthetic_smiles``: the synthetic drugs are valid SMILES built from fragments (the graph
    encoder needs molecules RDKit parses) instead of random SMILES characters.
    ``rank_weight``: adds that weight times a pairwise ranking loss to the MSE: over every pair
    of a batch's pairs whose affinities differ, the logistic loss of the predicted difference
    having the true difference's sign, averaged; the concordance index scores exactly that order
    (0: the MSE alone). ``rank_scale``: the unit of the predicted differences: ``sd`` (the
    training split's standard deviation, so it needs ``standardize``: the term also rewards
    spreading predictions apart) or ``batch`` (the batch's own predictions' standard deviation:
    the term is blind to the predictions' scale and offset, which the MSE alone sets, and only
    orders them).
    """

    source: Literal["deepdta", "csv", "synthetic", "shards"] = "deepdta"
    path: str | None = None
    drug_max_len: int = 85
    protein_max_len: int = 1200
    drug_max_atoms: int = 96
    pack_graphs: bool = True
    pkd: bool = True
    unknown_chars: Literal["error", "skip", "unk"] = "error"
    bad_records: Literal["error", "skip"] = "error"
    valid_fold: int | None = 0
    eval_split: Literal["valid", "test"] = "valid"
    eval_fraction: float = 0.1
    group_by: Literal["none", "protein", "drug"] = "none"
    group_mix: int = 1
    deduplicate: bool = True
    standardize: bool = False
    synthetic_pairs: int = 100_000
    synthetic_drugs: int = 2_000
    synthetic_proteins: int = 500
    synthetic_smiles: bool = False
    rank_weight: float = 0.0
    rank_scale: Literal["sd", "batch"] = "sd"


@dataclasses.dataclass(frozen=True)
class PairMeta:
    """What the batches of a run hold.

    Attributes:
      drugs, proteins: distinct molecules in the data.
      table_rows: per global batch size, rows of the (global) distinct-drug and distinct-protein
        tables every batch of that size carries.
      graph_slots: per global batch size, the (global) atom and bond slots of the drugs' graph
        (``model.drug_encoder: gin``; else empty).
      graph_sizes: atoms and directed bonds of each of the data's drugs (``gin``; else None),
        which size the graph of any other batch size.
      train_pairs, eval_pairs: pairs in each split (eval: without the padding copies).
      skipped: records the loader skipped (``bad_records: skip``).
      process_count: row blocks a global batch is read in.
    """

    drugs: int
    proteins: int
    table_rows: dict[int, tuple[int, int]]
    graph_slots: dict[int, tuple[int, int]]
    graph_sizes: tuple[np.ndarray, np.ndarray] | None
    train_pairs: int
    eval_pairs: int
    skipped: int
    process_count: int


def graph_slots(
    data: AffinityData, sizes: tuple[np.ndarray, np.ndarray], local: int, distinct: int, rows: int
) -> tuple[int, int]:
    """(atom, bond) slots of a process's drug graph for ``local`` pairs, ``distinct`` molecules
    at most (``sizes``: ``mol_graphs.graph_sizes`` of the data's drugs) in ``rows`` table rows:
    what the largest molecules need (``pack_graphs``), or every row as large as allowed."""
    if not data.pack_graphs:
        return mol_graphs.padded_slots(rows, data.drug_max_atoms)
    molecules = min(local, distinct) if data.deduplicate else local
    return tuple(
        mol_graphs.slot_budget(
            n, molecules, distinct=data.deduplicate, multiple=dta_batches.TABLE_ROW_MULTIPLE
        )
        for n in sizes
    )


def rank_loss(prediction: jax.Array, target: jax.Array, weight: jax.Array) -> jax.Array:
    """Mean logistic loss of the pairs (i, j) with ``target[i] > target[j]`` over ``softplus(
    prediction[j] - prediction[i])``: small when each such pair is predicted in the same order
    (the order the concordance index counts). Pairs weigh ``weight[i] * weight[j]``; padding
    (weight 0) takes no part. O(batch^2) elementwise work, no extra FLOPs worth counting beside
    the encoders'."""
    above = target[:, None] > target[None, :]
    pair_weight = jnp.where(above, weight[:, None] * weight[None, :], 0.0)
    margin = prediction[:, None] - prediction[None, :]
    total = (pair_weight * jax.nn.softplus(-margin)).sum()
    return total / jnp.maximum(pair_weight.sum(), 1.0)


class AffinityRegression(Workload):
    ModelConfig = dta_model.DTAConfig
    DataConfig = AffinityData
    examples_name = "pairs"
    independent_rows = False  # pairs index into the batch's drug and protein tables
    remat_names = BLOCK_ACTIVATIONS  # the transformer encoders' blocks
    fp8_layers = BLOCK_DENSE_LAYERS
    default_fp8_layers = BLOCK_DENSE_LAYERS
    smoke_overrides = (
        "model.embed_dim=8",
        "model.filters=4",
        "model.head_dims=32,16",
        "data.source=synthetic",
        "data.path=null",
        "data.synthetic_drugs=8",
        "data.synthetic_proteins=8",
        "data.synthetic_pairs=400",
        "train.batch_size=32",
    )

    @classmethod
    def validate_config(cls, config: Config) -> None:
        d = config.data
        config.model.validate()
        if d.source == "csv":
            if not d.path:
                raise ConfigError("data.path", f"required when data.source is '{d.source}'")
            if Path(d.path).is_dir():
                raise ConfigError("data.path", f"a directory, not a CSV/TSV file: {d.path}")
            if not Path(d.path).is_file():
                raise ConfigError("data.path", not_found(d.path))
        elif d.source in ("deepdta", "shards"):
            what = "a DeepDTA" if d.source == "deepdta" else "a shard"
            if not d.path:
                raise ConfigError("data.path", f"required when data.source is '{d.source}'")
            if not Path(d.path).exists():
                raise ConfigError("data.path", not_found(d.path))
            if not Path(d.path).is_dir():
                raise ConfigError("data.path", f"not {what} directory: {d.path}")
        elif d.path:
            raise ConfigError("data.path", f"not used by data.source '{d.source}'")
        if config.model.drug_encoder == "gin":
            reason = mol_graphs.rdkit_error()
            if reason is not None:
                raise ConfigError(
                    "model.drug_encoder", f"gin needs {mol_graphs.INSTALL_HINT} ({reason})"
                )
            if d.source == "shards":
                raise ConfigError(
                    "model.drug_encoder",
                    "gin needs the drugs' SMILES in memory (deepdta, csv, synthetic), not shards",
                )
            if d.source == "synthetic" and not d.synthetic_smiles:
                raise ConfigError(
                    "data.synthetic_smiles",
                    "model.drug_encoder=gin needs drugs RDKit parses: set it to true",
                )
        for key in ("drug_max_len", "protein_max_len", "drug_max_atoms", "synthetic_pairs"):
            config_lib.positive(f"data.{key}", getattr(d, key))
        config_lib.positive("data.synthetic_drugs", d.synthetic_drugs)
        config_lib.positive("data.synthetic_proteins", d.synthetic_proteins)
        config_lib.positive("data.group_mix", d.group_mix)
        if d.rank_weight < 0:
            raise ConfigError("data.rank_weight", f"expected a weight >= 0, got {d.rank_weight}")
        if d.rank_scale != "sd" and not d.rank_weight:
            raise ConfigError("data.rank_scale", "has no effect without data.rank_weight > 0")
        if d.rank_weight and d.rank_scale == "sd" and not d.standardize:
            raise ConfigError(
                "data.rank_scale",
                "'sd' measures differences in the training split's standard deviations, which "
                "data.standardize=true computes; set it, or use data.rank_scale=batch",
            )
        if d.valid_fold is None:
            if d.eval_split != "test":
                raise ConfigError(
                    "data.valid_fold",
                    "null trains on every training fold, so only the test fold is left to "
                    "evaluate on: set data.eval_split=test (and score a step fixed in advance)",
                )
        elif not 0 <= d.valid_fold < 5:
            raise ConfigError(
                "data.valid_fold", f"expected a DeepDTA fold 0..4 or null, got {d.valid_fold}"
            )
        if not 0.0 < d.eval_fraction < 1.0:
            raise ConfigError(
                "data.eval_fraction", f"expected 0 < fraction < 1, got {d.eval_fraction}"
            )
        if d.group_by != "none" and d.source == "shards":
            raise ConfigError(
                "data.group_by",
                "needs a pair table in memory (deepdta, csv, synthetic), not shards",
            )
        if config.train.microbatches > 1:
            raise ConfigError(
                "train.microbatches",
                "not supported by the dta workload: its batches share deduplicated drug/protein "
                "tables",
            )

    def __init__(self, config: Config):
        super().__init__(config)
        # (mean, std) of the training split's affinities, once build_datasets has read them.
        self.target_stats: tuple[float, float] | None = None
        if config.data.standardize:
            self.mutable = (dta_model.TARGET_STATS,)

    def build_model(self, policy: Policy, remat: RematConfig) -> dta_model.DTA:
        drug, protein = tokenizers(self.config.data)
        stats = None
        if self.config.data.standardize:
            # Without the data (a restored model), the checkpoint's values replace these.
            stats = self.target_stats or (0.0, 1.0)
        return dta_model.DTA(
            config=self.config.model,
            policy=policy,
            remat=remat,
            drug_vocab=drug.vocab_size,
            protein_vocab=protein.vocab_size,
            target_stats=stats,
            atom_vocab=tuple(categories for _, categories in mol_graphs.ATOM_FEATURES),
            bond_types=mol_graphs.BOND_TYPES,
        )

    def _std(self) -> float:
        """The standardization's std (1 without it): the train loss is divided by its square."""
        if not self.config.data.standardize:
            return 1.0
        if self.target_stats is None:
            raise RuntimeError("build_datasets computes the affinity statistics before a loss")
        return self.target_stats[1]

    def build_datasets(self, shard: ProcessShard) -> Datasets[PairMeta]:
        config = self.config
        t, d = config.train, config.data
        index, count = shard.index, shard.count
        data = load_pairs(config)
        train_idx, eval_idx = split_pairs(data.folds, len(data.pairs), config)
        if d.standardize:
            y = np.asarray(data.pairs.affinities(train_idx), np.float64)
            std = float(y.std())
            self.target_stats = (float(y.mean()), std if std > 0 else 1.0)
        eval_batch = t.eval_batch_size or t.batch_size
        if len(train_idx) < t.batch_size:
            raise ConfigError(
                "train.batch_size", f"{data.source} has {len(train_idx)} training pairs"
            )
        group_of = None
        if d.group_by != "none":
            group_of = data.drug_index if d.group_by == "drug" else data.protein_index
            eval_idx = eval_idx[np.argsort(group_of[eval_idx], kind="stable")]
        # Pad the eval split to whole global batches with weight-0 copies: every pair is scored.
        padded = -(-len(eval_idx) // eval_batch) * eval_batch
        eval_weights = np.r_[np.ones(len(eval_idx)), np.zeros(padded - len(eval_idx))]
        eval_idx = np.r_[eval_idx, np.full(padded - len(eval_idx), eval_idx[-1])]

        # Rows of the distinct-molecule tables, per global batch size: the distinct molecules in
        # the data, or fewer where grouped batches can hold no more (GroupedOrder).
        def distinct(indices: np.ndarray, batch: int) -> dict[str, int]:
            bound = {"drug": data.drugs, "protein": data.proteins}
            if group_of is not None:
                order = dta_batches.GroupedOrder(group_of[indices], seed=0, mix=d.group_mix)
                bound[d.group_by] = order.max_groups_per_batch(batch)
            return bound

        rows: dict[int, tuple[int, int]] = {}
        slots: dict[int, tuple[int, int]] = {}  # the drugs' graph: atom and bond slots
        sizes = mol_graphs.graph_sizes(*data.graphs) if data.graphs is not None else None
        for indices, batch in ((train_idx, t.batch_size), (eval_idx, eval_batch)):
            local = shard.rows(batch)
            bound = distinct(indices, batch)
            new = (
                dta_batches.table_rows(local, bound["drug"], d.deduplicate),
                dta_batches.table_rows(local, bound["protein"], d.deduplicate),
            )
            rows[batch] = tuple(max(x) for x in zip(rows.get(batch, new), new, strict=True))
            if sizes is not None:
                new = graph_slots(d, sizes, local, bound["drug"], rows[batch][0])
                slots[batch] = tuple(max(x) for x in zip(slots.get(batch, new), new, strict=True))

        def batches(order: grain.MapDataset, source: Any, batch: int) -> grain.MapDataset:
            drug_rows, protein_rows = rows[batch]
            graphs = None
            if sizes is not None:
                graphs = functools.partial(
                    mol_graphs.batch_graph,
                    graphs=data.graphs,
                    sizes=sizes,
                    atom_slots=slots[batch][0],
                    bond_slots=slots[batch][1],
                    packed=d.pack_graphs,
                )
            convert = functools.partial(
                dta_batches.to_model_batch,
                drug_rows=drug_rows,
                protein_rows=protein_rows,
                block=index,
                dedup=d.deduplicate,
                tokens=data.tokens,
                graphs=graphs,
            )
            local = shard.rows(batch)
            order = order[index::count]
            if source.vectorized:  # pairs in memory: batch the positions, gather once
                return order.batch(local, drop_remainder=True).map(source.take).map(convert)
            return order.map(source.__getitem__).batch(local, drop_remainder=True).map(convert)

        train_pairs = dta_batches.PairSubset(data.pairs, train_idx)
        if group_of is not None:
            order = grain.MapDataset.source(
                dta_batches.GroupedOrder(group_of[train_idx], seed=config.seed, mix=d.group_mix)
            )
        else:
            order = grain.MapDataset.range(len(train_idx))
            order = order.shuffle(seed=config.seed) if d.shuffle else order
            order = order.repeat(None)
        train_ds = batches(order, train_pairs, t.batch_size)
        eval_pairs = dta_batches.PairSubset(data.pairs, eval_idx, eval_weights)
        eval_ds = batches(grain.MapDataset.range(len(eval_idx)), eval_pairs, eval_batch)
        meta = PairMeta(
            drugs=data.drugs,
            proteins=data.proteins,
            table_rows={b: (count * r[0], count * r[1]) for b, r in rows.items()},
            graph_slots={b: (count * n[0], count * n[1]) for b, n in slots.items()},
            graph_sizes=sizes,
            train_pairs=len(train_idx),
            eval_pairs=int(eval_weights.sum()),
            skipped=data.skipped,
            process_count=count,
        )
        return Datasets(train=train_ds, eval=eval_ds, meta=meta)

    def batch_fields(self, batch_size: int, datasets: Datasets | None) -> dict[str, Field]:
        d = self.config.data
        meta: PairMeta | None = datasets.meta if datasets is not None else None
        if meta is not None and batch_size in meta.table_rows:
            drug_rows, protein_rows = meta.table_rows[batch_size]
        else:  # other batch sizes (and no data): as many rows as pairs, or molecules if fewer
            processes = meta.process_count if meta is not None else 1
            local = batch_size // processes
            drugs = meta.drugs if meta is not None else local
            proteins = meta.proteins if meta is not None else local
            drug_rows = processes * dta_batches.table_rows(local, drugs, d.deduplicate)
            protein_rows = processes * dta_batches.table_rows(local, proteins, d.deduplicate)
        pairs = (batch_size,)
        if self.config.model.drug_encoder == "gin":
            if meta is not None and batch_size in meta.graph_slots:
                atoms, bonds = meta.graph_slots[batch_size]
            elif meta is not None and meta.graph_sizes is not None:  # another batch size
                processes = meta.process_count
                local = graph_slots(
                    d, meta.graph_sizes, batch_size // processes, meta.drugs,
                    drug_rows // processes,
                )  # fmt: skip
                atoms, bonds = (processes * n for n in local)
            else:  # no data to size them by (an exported model): molecules as large as allowed
                atoms, bonds = mol_graphs.padded_slots(drug_rows, d.drug_max_atoms)
            features = len(mol_graphs.ATOM_FEATURES)
            # Slots, not table rows: axes of their own, sharded as the batch is, so that an
            # exported model's symbolic batch (its pairs and table rows) leaves them fixed.
            drug = {
                "drug_atoms": Field((atoms, features), jnp.uint8, (GRAPH_ATOMS, None)),
                "drug_bonds": Field((bonds, 3), jnp.int32, (GRAPH_BONDS, None)),
                "drug_graph": Field((atoms,), jnp.int32, (GRAPH_ATOMS,)),
                "drug_sizes": Field((drug_rows,), jnp.int32, ("batch",)),
            }
        else:
            drug = {"drug_tokens": Field((drug_rows, d.drug_max_len), jnp.int32, ("batch", None))}
        return {
            **drug,
            "protein_tokens": Field((protein_rows, d.protein_max_len), jnp.int32, ("batch", None)),
            "drug_index": Field(pairs, jnp.int32, ("batch",)),
            "protein_index": Field(pairs, jnp.int32, ("batch",)),
            "affinity": Field(pairs, jnp.float32, ("batch",)),
            "weight": Field(pairs, jnp.float32, ("batch",)),
        }

    def model_inputs(self, batch: Any) -> tuple[Any, ...]:
        graph = ("drug_atoms", "drug_bonds", "drug_graph", "drug_sizes")
        drug = graph if "drug_atoms" in batch else ("drug_tokens",)
        keys = (*drug, "protein_tokens", "drug_index", "protein_index")
        return ({k: batch[k] for k in keys},)

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        if self.config.model.members > 1:
            # A deep ensemble, outputs [members, B]: each member's loss on its own predictions.
            # Their mean, not their sum, keeps the logged loss on one network's scale; each
            # member's gradient is then its own loss's divided by members, which Adam's
            # normalization undoes (but for eps). eval_loss is the mean prediction's loss.
            return jax.vmap(lambda member: self._loss(member, batch))(outputs).mean()
        return self._loss(outputs, batch)

    def _loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        w = batch["weight"]
        mse = (w * (outputs - batch["affinity"]) ** 2).sum() / jnp.maximum(w.sum(), 1.0)
        loss = mse / self._std() ** 2
        if self.config.data.rank_weight:
            if self.config.data.rank_scale == "batch":
                mean = (w * outputs).sum() / jnp.maximum(w.sum(), 1.0)
                var = (w * (outputs - mean) ** 2).sum() / jnp.maximum(w.sum(), 1.0)
                scaled = (outputs - mean) * jax.lax.rsqrt(var + 1e-6)
            else:
                scaled = outputs / self._std()
            loss += self.config.data.rank_weight * rank_loss(scaled, batch["affinity"], w)
        return loss

    def predict(self, model: nn.Module, variables: dict[str, Any], batch: Any) -> jax.Array:
        """Each pair's predicted affinity [B]: an ensemble's is the mean of its members'."""
        outputs = super().predict(model, variables, batch)
        return outputs.mean(axis=0) if self.config.model.members > 1 else outputs

    def eval_outputs(self, outputs: jax.Array, batch: Any) -> dict[str, jax.Array]:
        return {"prediction": outputs, "affinity": batch["affinity"], "weight": batch["weight"]}

    def summarize(self, outputs: list[dict[str, np.ndarray]]) -> dict[str, float]:
        joined = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in outputs[0]}
        keep = joined["weight"] > 0
        scores = scoring.regression_scores(joined["affinity"][keep], joined["prediction"][keep])
        return {
            "eval_loss": scores["mse"] / self._std() ** 2,
            **{f"eval_{k}": v for k, v in scores.items()},
            "eval_pairs": float(keep.sum()),
        }

    def axis_rules(self) -> tuple[tuple[str, Any], ...]:
        # The SMILES and amino-acid vocabularies (a few dozen rows) stay whole on every device;
        # the drugs' graph slots split over the devices as the batch does.
        batch = dict(LOGICAL_AXIS_RULES)["batch"]
        return ((dta_model.CHARS, None), (GRAPH_ATOMS, batch), (GRAPH_BONDS, batch))

    def model_flops_per_step(self, batch_size: int, datasets: Datasets | None) -> float:
        fields = self.batch_fields(batch_size, datasets)
        if self.config.model.drug_encoder == "gin":  # rows, and the atom slots of all of them
            drugs, drug_len = fields["drug_sizes"].shape[0], fields["drug_atoms"].shape[0]
        else:
            drugs, drug_len = fields["drug_tokens"].shape
        return dta_model.train_flops_per_step(
            self.config.model,
            drugs=drugs,
            proteins=fields["protein_tokens"].shape[0],
            pairs=batch_size,
            drug_len=drug_len,
            protein_len=self.config.data.protein_max_len,
        )

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size


WORKLOAD = AffinityRegression
