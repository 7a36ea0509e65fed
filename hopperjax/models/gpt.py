"""GPT-style decoder-only transformer (pre-norm), blocks stacked with ``nn.scan``; its config
and its analytic FLOPs."""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.linen as nn
import jax

from hopperjax import config as config_lib
from hopperjax.config import RematConfig
from hopperjax.models import layers
from hopperjax.models.transformer import StackConfig, scanned_blocks
from hopperjax.precision import Policy

# Dense layers FP8 can run: the blocks' projections, and the output head when untied.
FP8_LAYERS = ("qkv", "attn_out", "mlp_in", "mlp_out", "lm_head")


@dataclasses.dataclass(frozen=True)
class GPTConfig(config_lib.ModelConfig):
    """The GPT's ``model:`` group. ``mlp_dim`` None means 4 x ``d_model``.

    ``scan_unroll``: blocks unrolled per iteration of the layer scan (``n_layers``: no loop left;
    worth it for small models, whose step time the loop's overhead dominates). Sizes, ``norm_eps``,
    ``rope_theta`` and ``init_std`` are > 0; ``dropout`` is in [0, 1).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_dim: int | None = None
    max_len: int = 128
    positions: Literal["rope", "learned"] = "rope"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    use_bias: bool = False
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    scan_unroll: int = 1

    @property
    def stack(self) -> StackConfig:
        """The blocks' part of this config."""
        return StackConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(StackConfig)}
        )

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.*`` key of the first bad value."""
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "scan_unroll"):
            config_lib.positive(f"model.{key}", getattr(self, key))
        config_lib.positive("model.mlp_dim", self.mlp_dim, allow_none=True)
        for key in ("norm_eps", "rope_theta", "init_std"):
            config_lib.positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_heads:
            raise config_lib.ConfigError(
                "model.n_heads", f"must divide model.d_model={self.d_model}, got {self.n_heads}"
            )
        head_dim = self.d_model // self.n_heads
        if self.positions == "rope" and head_dim % 2:
            raise config_lib.ConfigError(
                "model.n_heads", f"RoPE needs an even head dim, got {head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise config_lib.ConfigError(
                "model.dropout", f"expected 0 <= dropout < 1, got {self.dropout}"
            )


class GPT(nn.Module):
    """Decoder-only language model.

    Attributes:
      config: sizes and options.
      policy: dtypes of parameters and compute.
      remat: what each block keeps for the backward pass (``memory/remat.py``).
    """

    config: GPTConfig
    policy: Policy
    remat: RematConfig = RematConfig()

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Next-token logits.

        Args:
          tokens: [batch, length] int32.
          deterministic: disables dropout.
        Returns:
          logits: [batch, length, vocab] in the policy's output dtype (fp32).
        """
        cfg, policy = self.config, self.policy
        token_embed = layers.embed(
            cfg.vocab_size,
            cfg.d_model,
            axes=("vocab", "embed"),
            policy=policy,
            std=cfg.init_std,
            name="token_embed",
        )
        x = token_embed(tokens)  # (B, T, d)
        if cfg.positions == "learned":
            pos = self.param(
                "pos_embed",
                layers.normal_init(cfg.init_std, ("length", "embed")),
                (cfg.max_len, cfg.d_model),
                policy.param_dtype,
            )
            x = x + pos[None, : tokens.shape[1]].astype(x.dtype)
        x = x.astype(policy.compute_dtype)
        x = nn.Dropout(cfg.dropout, deterministic=deterministic)(x)
        x = layers.constrain(x, ("batch", "length", "embed"))

        x = scanned_blocks(cfg.stack, policy, self.remat, deterministic, causal=True)(x)

        x = layers.layer_norm(
            policy=policy, eps=cfg.norm_eps, use_bias=cfg.use_bias, name="final_norm"
        )(x).astype(policy.compute_dtype)
        if cfg.tie_embeddings:
            logits = token_embed.attend(x)
        else:
            logits = layers.dense(
                cfg.vocab_size,
                axes=("embed", "vocab"),
                policy=policy,
                std=cfg.init_std,
                use_bias=False,
                name="lm_head",
            )(x)
        return logits.astype(policy.output_dtype)


def matmul_params(config: GPTConfig) -> int:
    """Parameters used in matmuls (the output head included, embedding lookups not)."""
    d = config.d_model
    mlp = config.mlp_dim or 4 * d
    mlp_in = 2 * mlp if config.mlp == "swiglu" else mlp
    per_layer = d * 3 * d + d * d + d * mlp_in + mlp * d
    return config.n_layers * per_layer + d * config.vocab_size


def forward_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """2 FLOPs per matmul parameter, plus attention scores and values: 2 x 2 x layers x T x d.

    Attention is counted over the full T x T square, which is what the XLA attention computes
    (the causal mask is applied after the product).
    """
    return 2 * matmul_params(config) + 4 * config.n_layers * seq_len * config.d_model


def train_flops_per_step(config: GPTConfig, *, batch_size: int, seq_len: int) -> int:
    """Model FLOPs of one training step (forward + backward = 3 x forward), all devices."""
    return 3 * batch_size * seq_len * forward_flops_per_token(config, seq_len)
