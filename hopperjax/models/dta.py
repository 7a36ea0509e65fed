"""Drug-target binding affinity: a drug encoder, a protein encoder and an MLP head to one scalar.

The batch carries each distinct drug and protein once (``drug_tokens`` [Ud, Ld],
``protein_tokens`` [Up, Lp]) and per pair only the row it uses (``drug_index``,
``protein_index`` [B]). Encoding the distinct sequences and gathering per pair gives the same
predictions as encoding every pair's sequences, for far less work: Davis has 68 drugs and 442
proteins for 30,056 pairs, and the protein encoder dominates the FLOPs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from hopperjax import config as config_lib
from hopperjax.config import RematConfig
from hopperjax.models import layers
from hopperjax.models.transformer import StackConfig, scanned_blocks
from hopperjax.precision import Policy

# Logical axis of the character-vocabulary rows: a few dozen rows (not a multiple of any mesh
# axis), replicated by the DTA workload's axis rules rather than sharded like a word vocabulary.
CHARS = "chars"

CNN_WIDTHS = (1, 2, 3)  # DeepDTA: filters, 2x and 3x filters in the three convolutions


# The variable collection of the standardization constants (not trained, checkpointed).
TARGET_STATS = "target_stats"


@dataclasses.dataclass(frozen=True)
class DTAConfig(config_lib.ModelConfig):
    """The DTA model's ``model:`` group.

    Each encoder is ``cnn`` (DeepDTA: three 1-D convolutions of ``filters``, 2x and 3x channels,
    ReLU, global max pool) or ``transformer`` (``layers`` pre-norm blocks of width ``d_model`` from
    the shared transformer blocks, bidirectional with padding masked, mean-pooled). The drug
    encoder can also be ``gin``: a graph isomorphism network over the molecule's atoms and bonds
    (``GraphEncoder``: ``gnn_layers`` rounds of width ``gnn_dim``).
    ``protein_pool`` > 1 max-pools the protein sequence by that factor after each of the first two
    convolutions. ``head_dims``: the MLP on the concatenated drug and protein vectors
    (comma-separated). ``dropout``: after each head layer but the last, and in the transformer
    blocks, in [0, 1). Sizes, ``norm_eps`` and ``init_std`` are > 0.
    ``members`` > 1 makes the model a deep ensemble: that many copies of the network, each
    initialized from its own key and trained on its own loss (the workload's loss is the mean of
    the members'), predicting the mean of their predictions; it costs ``members`` times the
    FLOPs and parameters. 1 (the default) is one network, its parameters as without the key.
    """

    drug_encoder: Literal["cnn", "transformer", "gin"] = "cnn"
    protein_encoder: Literal["cnn", "transformer"] = "cnn"
    embed_dim: int = 128
    filters: int = 32
    drug_kernel: int = 4
    protein_kernel: int = 8
    protein_pool: int = 1
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    head_dims: str = "1024,1024,512"
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    gnn_dim: int = 128
    gnn_layers: int = 4
    members: int = 1

    @property
    def head_sizes(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.head_dims.split(",") if x.strip())

    @property
    def stack(self) -> StackConfig:
        """The transformer encoders' blocks (RoPE positions, GELU MLPs of 4 x d_model)."""
        return StackConfig(
            d_model=self.d_model,
            n_layers=self.layers,
            n_heads=self.heads,
            dropout=self.dropout,
            norm_eps=self.norm_eps,
            init_std=self.init_std,
        )

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.*`` key of the first bad value."""
        for key in ("embed_dim", "filters", "drug_kernel", "protein_kernel", "protein_pool"):
            config_lib.positive(f"model.{key}", getattr(self, key))
        for key in ("d_model", "layers", "heads", "norm_eps", "init_std", "gnn_dim", "gnn_layers"):
            config_lib.positive(f"model.{key}", getattr(self, key))
        config_lib.positive("model.members", self.members)
        if self.d_model % self.heads:
            raise config_lib.ConfigError(
                "model.heads", f"must divide model.d_model={self.d_model}, got {self.heads}"
            )
        try:
            sizes = self.head_sizes
        except ValueError:
            raise config_lib.ConfigError(
                "model.head_dims",
                f"expected comma-separated integers, got {config_lib.shown(self.head_dims)}",
            ) from None
        if not sizes or min(sizes) <= 0:
            raise config_lib.ConfigError(
                "model.head_dims",
                f"expected positive sizes, got {config_lib.shown(self.head_dims)}",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise config_lib.ConfigError(
                "model.dropout", f"expected 0 <= dropout < 1, got {self.dropout}"
            )


class ConvEncoder(nn.Module):
    """DeepDTA's sequence encoder: embed, three valid 1-D convolutions with ReLU, global max pool.

    ``pool`` > 1 max-pools the sequence by that factor after the first two convolutions (cheaper
    on 1,000-residue proteins; 1 is DeepDTA).
    """

    vocab_size: int
    config: DTAConfig
    kernel: int
    pool: int
    policy: Policy

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: [N, L] int32 (0 = padding) -> [N, 3 * filters] in the compute dtype."""
        x = layers.embed(
            self.vocab_size,
            self.config.embed_dim,
            axes=(CHARS, "embed"),
            policy=self.policy,
            std=self.config.init_std,
            name="embed",
        )(tokens)
        for i, width in enumerate(CNN_WIDTHS):
            x = layers.conv(
                self.policy,
                self.config.filters * width,
                (self.kernel,),
                padding="VALID",
                name=f"conv{i}",
            )(x)
            x = nn.relu(x)
            if self.pool > 1 and i < len(CNN_WIDTHS) - 1:
                x = nn.max_pool(x, (self.pool,), strides=(self.pool,))
        return x.max(axis=1)


class TransformerEncoder(nn.Module):
    """Bidirectional pre-norm transformer from the shared blocks (so precision, FP8 and remat
    apply), padding keys masked, mean-pooled over the valid positions."""

    vocab_size: int
    config: DTAConfig
    policy: Policy
    remat: RematConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool) -> jax.Array:
        """tokens: [N, L] int32 (0 = padding, sequences left-aligned) -> [N, d_model]."""
        cfg = self.config
        valid = tokens != 0
        lengths = jnp.maximum(valid.sum(axis=1), 1).astype(jnp.int32)
        x = layers.embed(
            self.vocab_size,
            cfg.d_model,
            axes=(CHARS, "embed"),
            policy=self.policy,
            std=cfg.init_std,
            name="embed",
        )(tokens).astype(self.policy.compute_dtype)
        x = scanned_blocks(cfg.stack, self.policy, self.remat, deterministic, causal=False)(
            x, lengths
        )
        x = layers.layer_norm(
            policy=self.policy, eps=cfg.norm_eps, use_bias=True, name="final_norm"
        )(x)
        weights = valid.astype(jnp.float32)[..., None]
        return (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)


class GraphEncoder(nn.Module):
    """A graph isomorphism network (GIN, with bond types in the messages) over each molecule.

    A batch's molecules come as one graph (``mol_graphs.batch_graph``): atoms and directed bonds
    in flat slot arrays, each atom tagged with its molecule's table row. Node states start as the
    sum of one embedding per atom feature. Each of ``gnn_layers`` rounds sends ``relu(h[source] +
    bond_embedding)`` along every directed bond, sums what each atom receives
    (``jax.ops.segment_sum``), and updates ``h += relu(norm(mlp((1 + eps) h + received)))``. The
    readout normalizes the atom states, concatenates their mean and max over each molecule's
    atoms (so the scale does not grow with the molecule) and projects to ``gnn_dim``.
    Padding atoms (element 0) and bonds (source -1) take no part, so the output depends neither
    on the padding nor on where in the slots, or in which order, the atoms and bonds lie.
    """

    atom_vocab: tuple[int, ...]  # categories per atom feature (the data's ATOM_FEATURES)
    bond_types: int
    config: DTAConfig
    policy: Policy

    @nn.compact
    def __call__(
        self, atoms: jax.Array, bonds: jax.Array, graph: jax.Array, sizes: jax.Array
    ) -> jax.Array:
        """atoms [T, features], bonds [S, 3] (source, target, type), graph [T] (each atom's
        table row, -1 for padding), sizes [R] (atoms per row; its length is the row count)
        -> [R, gnn_dim]."""
        if len(self.atom_vocab) != atoms.shape[-1] or self.bond_types < 1:
            raise ValueError(
                f"GraphEncoder: atom_vocab has {len(self.atom_vocab)} features for atoms with "
                f"{atoms.shape[-1]}, bond_types {self.bond_types}: pass the data's (mol_graphs)"
            )
        cfg, policy = self.config, self.policy
        dim, compute = cfg.gnn_dim, policy.compute_dtype
        slots, rows = atoms.shape[0], sizes.shape[0]
        atoms, bonds = atoms.astype(jnp.int32), bonds.astype(jnp.int32)
        h = sum(
            layers.embed(
                vocab, dim, axes=(CHARS, "embed"), policy=policy, std=cfg.init_std, name=f"atom{i}"
            )(atoms[:, i])
            for i, vocab in enumerate(self.atom_vocab)
        ).astype(compute)
        real_bond = bonds[:, 0] >= 0
        source = jnp.where(real_bond, bonds[:, 0], 0)
        # Padding bonds deliver to one extra segment past the last atom, dropped after the sum.
        target = jnp.where(real_bond, bonds[:, 1], slots)
        kinds = bonds[:, 2]

        def dense(width: int, fan_in: int, name: str) -> nn.Module:
            return layers.dense(
                width,
                axes=("embed", "mlp") if name.endswith("in") else ("mlp", "embed"),
                policy=policy,
                std=math.sqrt(2.0 / fan_in),  # He init for ReLU
                use_bias=True,
                name=name,
            )

        for i in range(cfg.gnn_layers):
            edge = layers.embed(
                self.bond_types,
                dim,
                axes=(CHARS, "embed"),
                policy=policy,
                std=cfg.init_std,
                name=f"bond{i}",
            )(kinds)
            message = nn.relu(h[source] + edge.astype(compute))
            received = jax.ops.segment_sum(message, target, num_segments=slots + 1)[:-1]
            eps = self.param(f"eps{i}", nn.initializers.zeros_init(), (), jnp.float32)
            x = ((1.0 + eps) * h + received).astype(compute)
            x = nn.relu(dense(dim, dim, f"gin{i}_in")(x))
            x = dense(dim, dim, f"gin{i}_out")(x)
            x = layers.layer_norm(policy=policy, eps=cfg.norm_eps, use_bias=True, name=f"norm{i}")(
                x
            )
            h = h + nn.relu(x).astype(compute)
        h = layers.layer_norm(policy=policy, eps=cfg.norm_eps, use_bias=True, name="final_norm")(h)
        # Padding atoms pool into one extra row past the table's, dropped. (``sizes`` gives the
        # number of rows; the atoms are counted here, from the atoms themselves.)
        real = (atoms[:, 0] > 0) & (graph >= 0)
        row = jnp.where(real, graph, rows)
        count = jax.ops.segment_sum(real.astype(jnp.float32), row, num_segments=rows + 1)[:-1]
        total = jax.ops.segment_sum(h.astype(jnp.float32), row, num_segments=rows + 1)[:-1]
        mean = total / jnp.maximum(count, 1.0)[:, None]
        peak = jax.ops.segment_max(h, row, num_segments=rows + 1)[:-1]
        peak = jnp.where((count > 0)[:, None], peak, 0.0)  # padding table rows: no atoms
        pooled = jnp.concatenate([mean.astype(peak.dtype), peak], axis=-1).astype(compute)
        return nn.relu(dense(dim, 2 * dim, "readout_in")(pooled))


class DTA(nn.Module):
    """Affinity of each (drug, protein) pair of a batch.

    Attributes:
      config: encoder and head sizes, and ``members``: more than 1 builds that many networks
        (``member0``, ``member1``, ...: each initialized, and given dropout, from its own key
        by its name) and returns each one's predictions; the workload trains each on its own
        loss and predicts their mean. Separate networks, not one ``nn.vmap`` over stacked
        parameters: a vmapped convolution becomes a grouped one, whose batch-split rows XLA's
        partitioner gathers onto every device (measured on 8 CPU devices).
      drug_vocab, protein_vocab: token ids of the two tokenizers (the workload passes them in;
        models never read data).
      atom_vocab, bond_types: the graph encoder's categories per atom feature and bond types
        (``drug_encoder: gin``; the workload passes the data's).
      target_stats: (mean, std) when the head predicts standardized affinities: the model then
        returns ``head * std + mean`` with both held in the ``target_stats`` variable collection
        (initialized from these values, the training split's; checkpointed with the model, so
        a restored model predicts in the data's units without them). None: the head's output is
        the affinity.
    """

    config: DTAConfig
    policy: Policy
    remat: RematConfig
    drug_vocab: int
    protein_vocab: int
    target_stats: tuple[float, float] | None = None
    atom_vocab: tuple[int, ...] = ()
    bond_types: int = 0

    @nn.nowrap  # a helper of __call__: no profiling scope of its own in op names
    def _encoder(self, kind: str, vocab: int, kernel: int, pool: int, name: str) -> nn.Module:
        if kind == "gin":
            return GraphEncoder(
                self.atom_vocab, self.bond_types, self.config, self.policy, name=name
            )
        if kind == "cnn":
            return ConvEncoder(vocab, self.config, kernel, pool, self.policy, name=name)
        return TransformerEncoder(vocab, self.config, self.policy, self.remat, name=name)

    @nn.nowrap
    def _encode(
        self, encoder: nn.Module, batch: dict[str, jax.Array], which: str, deterministic: bool
    ) -> jax.Array:
        if isinstance(encoder, GraphEncoder):
            fields = ("atoms", "bonds", "graph", "sizes")
            return encoder(*(batch[f"{which}_{field}"] for field in fields))
        if isinstance(encoder, TransformerEncoder):
            return encoder(batch[f"{which}_tokens"], deterministic)
        return encoder(batch[f"{which}_tokens"])

    @nn.compact
    def __call__(self, batch: dict[str, jax.Array], *, deterministic: bool = True) -> jax.Array:
        """batch: drug_tokens [Ud, Ld] (or, for ``gin``, the drugs as one graph: drug_atoms [T,
        features], drug_bonds [S, 3], drug_graph [T], drug_sizes [Ud]; ``GraphEncoder``),
        protein_tokens [Up, Lp], drug_index, protein_index [B]
        -> predicted affinity [B] float32; with ``members`` > 1, each member's: [members, B]."""
        dta, policy = self.config, self.policy
        if dta.members > 1:  # each member a one-network DTA; the standardization is shared
            one = dataclasses.replace(dta, members=1)
            out = jnp.stack(
                [
                    DTA(
                        one,
                        policy,
                        self.remat,
                        self.drug_vocab,
                        self.protein_vocab,
                        atom_vocab=self.atom_vocab,
                        bond_types=self.bond_types,
                        name=f"member{i}",
                    )(batch, deterministic=deterministic)
                    for i in range(dta.members)
                ]
            )
            return self._standardized(out)
        drugs = self._encoder(dta.drug_encoder, self.drug_vocab, dta.drug_kernel, 1, "drug")
        proteins = self._encoder(
            dta.protein_encoder, self.protein_vocab, dta.protein_kernel, dta.protein_pool, "protein"
        )
        drug_vectors = self._encode(drugs, batch, "drug", deterministic)
        protein_vectors = self._encode(proteins, batch, "protein", deterministic)
        x = jnp.concatenate(
            [
                jnp.take(drug_vectors, batch["drug_index"], axis=0),
                jnp.take(protein_vectors, batch["protein_index"], axis=0),
            ],
            axis=-1,
        ).astype(policy.compute_dtype)
        x = layers.constrain(x, ("batch", "embed"))
        axis = "embed"  # logical name of x's feature dim; the head alternates embed <-> mlp
        for i, width in enumerate(dta.head_sizes):
            out_axis = "mlp" if axis == "embed" else "embed"
            x = layers.dense(
                width,
                axes=(axis, out_axis),
                policy=policy,
                std=math.sqrt(2.0 / x.shape[-1]),  # He init for ReLU
                use_bias=True,
                name=f"head{i}",
            )(x)
            axis = out_axis
            x = nn.relu(x)
            if i < len(dta.head_sizes) - 1:  # DeepDTA: dropout after all but the last layer
                x = nn.Dropout(self.config.dropout, deterministic=deterministic)(x)
        out = layers.dense(
            1,
            axes=(axis, None),
            policy=policy,
            std=math.sqrt(1.0 / x.shape[-1]),
            use_bias=True,
            name="out",
        )(x)
        return self._standardized(out[:, 0].astype(jnp.float32))

    @nn.nowrap
    def _standardized(self, out: jax.Array) -> jax.Array:
        """The head's output in the data's units (``target_stats``), or as is."""
        if self.target_stats is None:
            return out
        mean0, std0 = self.target_stats
        mean = self.variable(TARGET_STATS, "mean", lambda: jnp.float32(mean0))
        std = self.variable(TARGET_STATS, "std", lambda: jnp.float32(std0))
        return out * std.value + mean.value


def encoder_flops(config: DTAConfig, which: str, length: int) -> float:
    """Forward FLOPs of encoding one sequence (multiply-adds x 2; embeddings are lookups).

    ``which``: "drug" or "protein"; ``length``: tokens. Token encoders only: a batch's drug
    graph is counted whole (``graph_flops``)."""
    kind = config.drug_encoder if which == "drug" else config.protein_encoder
    if kind == "gin":
        raise ValueError("encoder_flops counts token encoders; use graph_flops for gin")
    if kind == "transformer":
        d = config.d_model
        # qkv 3d^2, out d^2, MLP 8d^2 per token per layer; scores and values 2Ld per token.
        return 2.0 * config.layers * length * (12 * d * d + 2 * length * d)
    kernel = config.drug_kernel if which == "drug" else config.protein_kernel
    pool = 1 if which == "drug" else config.protein_pool
    total, channels, size = 0.0, config.embed_dim, length
    for i, width in enumerate(CNN_WIDTHS):
        out = config.filters * width
        size = size - kernel + 1
        total += 2.0 * size * kernel * channels * out
        channels = out
        if pool > 1 and i < len(CNN_WIDTHS) - 1:
            size //= pool
    return total


def graph_flops(config: DTAConfig, atoms: int, molecules: int) -> float:
    """Forward FLOPs of the graph encoder over ``atoms`` atom slots holding ``molecules``
    molecules (table rows): two GEMMs per atom per round, the readout per molecule. The message
    sums (bonds x gnn_dim additions a round) are left out like other non-matmul work."""
    dim = config.gnn_dim
    return 2.0 * (config.gnn_layers * atoms * 2 * dim * dim + molecules * 2 * dim * dim)


def head_flops(config: DTAConfig) -> float:
    """Forward FLOPs of the head for one pair."""

    def width(kind: str) -> int:
        if kind == "gin":
            return config.gnn_dim
        return config.d_model if kind == "transformer" else CNN_WIDTHS[-1] * config.filters

    sizes = [width(config.drug_encoder) + width(config.protein_encoder), *config.head_sizes, 1]
    return 2.0 * sum(a * b for a, b in itertools.pairwise(sizes))


def train_flops_per_step(
    config: DTAConfig,
    *,
    drugs: int,
    proteins: int,
    pairs: int,
    drug_len: int,
    protein_len: int,
) -> float:
    """Model FLOPs of one training step (3 x forward) that encodes ``drugs`` and ``proteins``
    sequences (table rows) and scores ``pairs``, in each of the ``members`` networks. For
    ``gin`` drugs, ``drug_len`` is the atom slots of the batch's whole graph."""
    if config.drug_encoder == "gin":
        drug = graph_flops(config, drug_len, drugs)
    else:
        drug = drugs * encoder_flops(config, "drug", drug_len)
    forward = (
        drug + proteins * encoder_flops(config, "protein", protein_len) + pairs * head_flops(config)
    )
    return 3.0 * config.members * forward
