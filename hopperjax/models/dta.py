"""Drug-target binding affinity: a drug encoder, a protein encoder and an MLP head to one scalar.

The batch carries each distinct drug and protein once (``drug_tokens`` [Ud, Ld],
``protein_tokens`` [Up, Lp]) and per pair only the row it uses (``drug_index``,
``protein_index`` [B]). Encoding the distinct sequences and gathering per pair gives the same
predictions as encoding every pair's sequences, for far less work: Davis has 68 drugs and 442
proteins for 30,056 pairs, and the protein encoder dominates the FLOPs.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hopperjax.config import DtaConfig, ModelConfig, RematConfig
from hopperjax.models import layers
from hopperjax.models.gpt import scanned_blocks
from hopperjax.precision import Policy

CNN_WIDTHS = (1, 2, 3)  # DeepDTA: filters, 2x and 3x filters in the three convolutions


class ConvEncoder(nn.Module):
    """DeepDTA's sequence encoder: embed, three valid 1-D convolutions with ReLU, global max pool.

    ``pool`` > 1 max-pools the sequence by that factor after the first two convolutions (cheaper
    on 1,000-residue proteins; 1 is DeepDTA).
    """

    vocab_size: int
    dta: DtaConfig
    kernel: int
    pool: int
    policy: Policy
    init_std: float

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: [N, L] int32 (0 = padding) -> [N, 3 * filters] in the compute dtype."""
        x = layers.embed(
            self.vocab_size,
            self.dta.embed_dim,
            axes=("vocab", "embed"),
            policy=self.policy,
            std=self.init_std,
            name="embed",
        )(tokens)
        for i, width in enumerate(CNN_WIDTHS):
            x = nn.Conv(
                self.dta.filters * width,
                kernel_size=(self.kernel,),
                padding="VALID",
                dtype=self.policy.compute_dtype,
                param_dtype=self.policy.param_dtype,
                name=f"conv{i}",
            )(x)
            x = nn.relu(x)
            if self.pool > 1 and i < len(CNN_WIDTHS) - 1:
                x = nn.max_pool(x, (self.pool,), strides=(self.pool,))
        return x.max(axis=1)


class TransformerEncoder(nn.Module):
    """Bidirectional pre-norm transformer from the GPT's blocks (so precision, FP8 and remat
    apply), padding keys masked, mean-pooled over the valid positions."""

    vocab_size: int
    dta: DtaConfig
    model: ModelConfig
    policy: Policy
    remat: RematConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool) -> jax.Array:
        """tokens: [N, L] int32 (0 = padding, sequences left-aligned) -> [N, d_model]."""
        dta = self.dta
        config = ModelConfig(
            d_model=dta.d_model,
            n_layers=dta.layers,
            n_heads=dta.heads,
            max_len=tokens.shape[1],
            dropout=self.model.dropout,
            norm_eps=self.model.norm_eps,
            init_std=self.model.init_std,
        )
        valid = tokens != 0
        lengths = jnp.maximum(valid.sum(axis=1), 1).astype(jnp.int32)
        x = layers.embed(
            self.vocab_size,
            dta.d_model,
            axes=("vocab", "embed"),
            policy=self.policy,
            std=self.model.init_std,
            name="embed",
        )(tokens).astype(self.policy.compute_dtype)
        x = scanned_blocks(config, self.policy, self.remat, deterministic, causal=False)(x, lengths)
        x = layers.layer_norm(
            policy=self.policy, eps=self.model.norm_eps, use_bias=True, name="final_norm"
        )(x)
        weights = valid.astype(jnp.float32)[..., None]
        return (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1.0)


class DTA(nn.Module):
    """Affinity of each (drug, protein) pair of a batch.

    Attributes:
      config: shared model keys (dropout, init_std, norm_eps).
      dta: encoder and head sizes.
      drug_vocab, protein_vocab: token ids of the two tokenizers (``data/molecules.py``).
    """

    config: ModelConfig
    dta: DtaConfig
    policy: Policy
    remat: RematConfig
    drug_vocab: int
    protein_vocab: int

    def _encoder(self, kind: str, vocab: int, kernel: int, pool: int, name: str) -> nn.Module:
        if kind == "cnn":
            return ConvEncoder(
                vocab, self.dta, kernel, pool, self.policy, self.config.init_std, name=name
            )
        return TransformerEncoder(vocab, self.dta, self.config, self.policy, self.remat, name=name)

    def _encode(self, encoder: nn.Module, tokens: jax.Array, deterministic: bool) -> jax.Array:
        if isinstance(encoder, TransformerEncoder):
            return encoder(tokens, deterministic)
        return encoder(tokens)

    @nn.compact
    def __call__(self, batch: dict[str, jax.Array], *, deterministic: bool = True) -> jax.Array:
        """batch: drug_tokens [Ud, Ld], protein_tokens [Up, Lp], drug_index, protein_index [B]
        -> predicted affinity [B] float32."""
        dta, policy = self.dta, self.policy
        drugs = self._encoder(dta.drug_encoder, self.drug_vocab, dta.drug_kernel, 1, "drug")
        proteins = self._encoder(
            dta.protein_encoder, self.protein_vocab, dta.protein_kernel, dta.protein_pool, "protein"
        )
        drug_vectors = self._encode(drugs, batch["drug_tokens"], deterministic)
        protein_vectors = self._encode(proteins, batch["protein_tokens"], deterministic)
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
        return out[:, 0].astype(jnp.float32)
