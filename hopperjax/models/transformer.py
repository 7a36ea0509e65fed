"""The transformer block every model shares (pre-norm, RoPE or none, GELU or SwiGLU MLP), and
the layer scan that stacks them.

A model that uses them (the GPT, the DTA's transformer encoders, ...) gives a ``StackConfig``:
the blocks' own sizes, not a whole model's config. Precision (the layer factories), FP8 (the
Dense layers named in ``BLOCK_DENSE_LAYERS``) and remat (``BLOCK_ACTIVATIONS``) work the same in
all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hopperjax.config import RematConfig
from hopperjax.memory.remat import remat_block
from hopperjax.models import layers
from hopperjax.precision import Policy
from hopperjax.precision.fp8 import FP8_COLLECTION
from hopperjax.precision.int8 import INT8_CALIBRATION

# Intermediates every block tags with ``checkpoint_name``, which the named remat policies choose
# from. The block's input needs no name: the layer scan keeps it.
BLOCK_ACTIVATIONS = ("qkv", "attention", "attn_out", "mlp_in", "mlp_hidden", "mlp_out")
# The block's Dense layers by name (the ones ``fp8.layers`` can put in FP8).
BLOCK_DENSE_LAYERS = ("qkv", "attn_out", "mlp_in", "mlp_out")


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """Sizes and options of a stack of blocks. ``mlp_dim`` None means 4 x ``d_model``.

    ``scan_unroll``: blocks unrolled per iteration of the layer scan (``n_layers``: no loop left).
    ``init_std``: kernel init; residual projections use ``init_std / sqrt(2 * n_layers)``.
    """

    d_model: int
    n_layers: int
    n_heads: int
    mlp_dim: int | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    positions: Literal["rope", "learned", "none"] = "rope"
    use_bias: bool = False
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    scan_unroll: int = 1


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    Intermediates are tagged with ``checkpoint_name`` (``BLOCK_ACTIVATIONS``) for the remat
    policies that save or offload activations by name.
    """

    config: StackConfig
    policy: Policy
    deterministic: bool = True
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array | None = None) -> tuple[jax.Array, None]:
        """x: [batch, length, embed] -> (same, None) as a scan body.

        ``lengths`` ([batch] valid positions, broadcast to every layer) masks padded keys; the
        bidirectional encoders of ``models/dta.py`` use it with ``causal=False``.
        """
        cfg, policy = self.config, self.policy
        heads, head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        # GPT-2: residual projections scaled by 1/sqrt(2 * layers) keep the stream's variance flat.
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        dropout = nn.Dropout(cfg.dropout, deterministic=self.deterministic)
        compute = policy.compute_dtype

        h = layers.layer_norm(
            policy=policy, eps=cfg.norm_eps, use_bias=cfg.use_bias, name="attn_norm"
        )(x).astype(compute)
        qkv = layers.dense(
            (3, heads, head_dim),
            axes=("embed", None, "heads", "kv"),
            policy=policy,
            std=cfg.init_std,
            use_bias=cfg.use_bias,
            name="qkv",
        )(h)
        qkv = checkpoint_name(qkv, "qkv")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each (B, T, nh, hd)
        if cfg.positions == "rope":
            positions = jnp.arange(x.shape[1])
            q = layers.rope(q, positions, cfg.rope_theta)
            k = layers.rope(k, positions, cfg.rope_theta)
        attn = layers.attention(
            q, k, v, causal=self.causal, lengths=lengths, implementation=policy.attention
        )  # (B, T, nh, hd)
        attn = checkpoint_name(attn, "attention")
        attn = layers.dense(
            cfg.d_model,
            axes=("heads", "kv", "embed"),
            policy=policy,
            std=out_std,
            use_bias=cfg.use_bias,
            name="attn_out",
        )(attn)
        x = x + dropout(checkpoint_name(attn, "attn_out"))

        h = layers.layer_norm(
            policy=policy, eps=cfg.norm_eps, use_bias=cfg.use_bias, name="mlp_norm"
        )(x).astype(compute)
        mlp_dim = cfg.mlp_dim or 4 * cfg.d_model
        if cfg.mlp == "swiglu":
            gate_up = layers.dense(
                (2, mlp_dim),
                axes=("embed", None, "mlp"),
                policy=policy,
                std=cfg.init_std,
                use_bias=cfg.use_bias,
                name="mlp_in",
            )(h)
            gate_up = checkpoint_name(gate_up, "mlp_in")
            h = nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        else:
            h = layers.dense(
                mlp_dim,
                axes=("embed", "mlp"),
                policy=policy,
                std=cfg.init_std,
                use_bias=cfg.use_bias,
                name="mlp_in",
            )(h)
            h = layers.gelu_exact(checkpoint_name(h, "mlp_in"))
        h = checkpoint_name(h, "mlp_hidden")
        h = layers.dense(
            cfg.d_model,
            axes=("mlp", "embed"),
            policy=policy,
            std=out_std,
            use_bias=cfg.use_bias,
            name="mlp_out",
        )(h)
        x = x + dropout(checkpoint_name(h, "mlp_out"))
        return layers.constrain(x, ("batch", "length", "embed")), None


def scanned_blocks(
    config: StackConfig,
    policy: Policy,
    remat: RematConfig,
    deterministic: bool,
    *,
    causal: bool,
    name: str = "blocks",
) -> Callable[..., jax.Array]:
    """``config.n_layers`` Blocks as one ``nn.scan`` over a stacked "layers" parameter axis.

    Scanning keeps compile time flat in depth; ``config.scan_unroll`` > 1 unrolls that many
    blocks per loop iteration (same parameters, so checkpoints do not change): for small models,
    where the loop's per-iteration overhead and the lost cross-layer fusion cost more than the
    longer compile. ``remat`` wraps each block. The returned callable
    takes x [batch, length, embed] and optional ``lengths`` [batch] (padding mask).
    """
    blocks = nn.scan(
        remat_block(Block, remat),
        variable_axes={"params": 0, FP8_COLLECTION: 0, INT8_CALIBRATION: 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=config.n_layers,
        unroll=min(config.scan_unroll, config.n_layers),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(config, policy, deterministic, causal, name=name)

    def run(x: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        return blocks(x, lengths)[0]

    return run
