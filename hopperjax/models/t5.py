"""A T5-style encoder-decoder for translation (v1.1's shape: pre-norm RMSNorm, gated-GELU MLPs, no
biases, optionally tied embeddings), on packed rows; its config and its analytic FLOPs.

Five keys turn it, piece by piece, into the original Transformer's shape (Vaswani et al. 2017, and
fairseq's ``transformer`` that the multimodal-MT literature trains): ``norm: layer`` (LayerNorm
with its bias), ``norm_position: post`` (x = norm(x + f(x)), no final norms), ``mlp: relu`` (a
two-matrix ReLU MLP), ``positions: sinusoidal`` (fixed sinusoids added to the embeddings, which
are then scaled by sqrt(d_model)) and ``use_bias: true`` (biases on every projection but the
output head).

Inputs are the packed rows of ``data/parallel_text.py``: several examples per row, each with its
segment id and its own positions. Attention sees only its own example: self-attention within a
segment (causal in the decoder), cross-attention from a target segment to the source segment of
the same id. Positions: RoPE on the self-attention queries and keys with each example's own
positions (T5 learns relative position buckets instead; RoPE is relative too, needs no extra
parameters and runs inside cuDNN's fused attention), none on cross-attention, as in T5.

Encoder and decoder are each one ``nn.scan`` over their blocks (a "layers" parameter axis), with
their own remat policy. The output head is the embedding matrix (tied, unscaled
as in fairseq's shared embeddings; T5 v1.0 scales it by ``d_model ** -0.5`` over embeddings at
std 1) or a separate ``lm_head`` (v1.1's).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hopperjax import config as config_lib
from hopperjax.config import RematConfig
from hopperjax.memory.remat import remat_block
from hopperjax.models import layers
from hopperjax.precision import Policy
from hopperjax.precision.fp8 import FP8_COLLECTION
from hopperjax.precision.int8 import INT8_CALIBRATION

# Dense layers FP8 can run, and the activations the remat policies can keep or offload by name.
FP8_LAYERS = ("qkv", "attn_out", "cross_q", "cross_kv", "cross_out", "mlp_in", "mlp_out", "lm_head")
BLOCK_ACTIVATIONS = (
    "qkv",
    "attention",
    "attn_out",
    "cross_attention",
    "cross_out",
    "mlp_in",
    "mlp_hidden",
    "mlp_out",
)


@dataclasses.dataclass(frozen=True)
class T5Config(config_lib.ModelConfig):
    """The translation model's ``model:`` group.

    ``encoder_layers`` / ``decoder_layers``: blocks of each stack. ``mlp_dim``: the MLP's
    hidden width. ``dropout`` after the embeddings and every residual branch (training only).
    ``tie_embeddings``: the output head is the embedding matrix. ``scan_unroll``: blocks
    unrolled per iteration of each layer scan. ``norm``: ``rms`` (T5's RMSNorm) or ``layer``
    (LayerNorm with a bias). ``norm_position``: ``pre`` (x + f(norm(x)), a final norm after each
    stack) or ``post`` (norm(x + f(x)), the original Transformer's). ``mlp``:
    ``gated_gelu`` (v1.1's, three matrices) or ``relu`` (two). ``positions``: ``rope`` (rotary,
    on self-attention) or ``sinusoidal`` (added to the embeddings, scaled by sqrt(d_model)).
    ``use_bias``: biases on the attention and MLP projections.
    """

    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 3
    mlp_dim: int = 1024
    dropout: float = 0.1
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02
    tie_embeddings: bool = True
    scan_unroll: int = 1
    norm: Literal["rms", "layer"] = "rms"
    norm_position: Literal["pre", "post"] = "pre"
    mlp: Literal["gated_gelu", "relu"] = "gated_gelu"
    positions: Literal["rope", "sinusoidal"] = "rope"
    use_bias: bool = False

    def validate(self) -> None:
        """Raises ConfigError naming the ``model.*`` key of the first bad value."""
        for key in (
            "vocab_size",
            "d_model",
            "n_heads",
            "encoder_layers",
            "decoder_layers",
            "mlp_dim",
            "scan_unroll",
            "norm_eps",
            "rope_theta",
            "init_std",
        ):
            config_lib.positive(f"model.{key}", getattr(self, key))
        rope = self.positions == "rope"
        if self.d_model % self.n_heads or (rope and (self.d_model // self.n_heads) % 2):
            raise config_lib.ConfigError(
                "model.n_heads",
                f"must divide model.d_model={self.d_model} into "
                f"{'even head sizes (RoPE)' if rope else 'equal heads'}, got {self.n_heads}",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise config_lib.ConfigError(
                "model.dropout", f"expected 0 <= dropout < 1, got {self.dropout}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """[batch, 1, queries, keys] bool: a query sees the keys of its own example (segment ids
    equal and not padding)."""
    same = query_segments[:, :, None] == key_segments[:, None, :]
    return (same & (key_segments[:, None, :] > 0))[:, None]


class _Attention(nn.Module):
    """Multi-head attention; self-attention (RoPE on ``positions``) when ``memory`` is None,
    else cross-attention from x to ``memory`` (no positions).

    ``cache_len``: decoding one position per call. Self-attention then keeps the keys and values
    of the positions so far in the ``cache`` collection ([batch, cache_len, heads, head_dim] and
    the next index) and attends over them; ``mask`` is ignored (a position sees the cached ones).
    """

    config: T5Config
    policy: Policy
    causal: bool = False
    cache_len: int | None = None

    @nn.compact
    def __call__(self, x, mask, positions=None, memory=None):
        cfg, policy = self.config, self.policy
        heads, head_dim = cfg.n_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * (cfg.encoder_layers + cfg.decoder_layers))
        if memory is None:
            qkv = layers.dense(
                (3, heads, head_dim),
                axes=("embed", None, "heads", "kv"),
                policy=policy,
                std=cfg.init_std,
                use_bias=cfg.use_bias,
                name="qkv",
            )(x)
            qkv = checkpoint_name(qkv, "qkv")
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            if cfg.positions == "rope":
                q = layers.rope(q, positions, cfg.rope_theta)
                k = layers.rope(k, positions, cfg.rope_theta)
            tag, out_name = "attention", "attn_out"
            if self.cache_len is not None:
                k, v, mask = self._cached(k, v)
        else:
            q = layers.dense(
                (heads, head_dim),
                axes=("embed", "heads", "kv"),
                policy=policy,
                std=cfg.init_std,
                use_bias=cfg.use_bias,
                name="cross_q",
            )(x)
            kv = layers.dense(
                (2, heads, head_dim),
                axes=("embed", None, "heads", "kv"),
                policy=policy,
                std=cfg.init_std,
                use_bias=cfg.use_bias,
                name="cross_kv",
            )(memory)
            k, v = kv[:, :, 0], kv[:, :, 1]
            tag, out_name = "cross_attention", "cross_out"
        out = layers.attention(
            q,
            k,
            v,
            causal=self.causal and self.cache_len is None,
            mask=mask,
            implementation=policy.attention,
        )
        out = checkpoint_name(out, tag)
        out = layers.dense(
            cfg.d_model,
            axes=("heads", "kv", "embed"),
            policy=policy,
            std=out_std,
            use_bias=cfg.use_bias,
            name=out_name,
        )(out)
        return checkpoint_name(out, out_name)

    def _cached(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Writes this position's key and value at the cache's index; returns every cached key
        and value and the mask of the positions written so far."""
        batch, _, heads, head_dim = k.shape
        shape = (batch, self.cache_len, heads, head_dim)
        keys = self.variable("cache", "keys", jnp.zeros, shape, k.dtype)
        values = self.variable("cache", "values", jnp.zeros, shape, v.dtype)
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        i = index.value
        keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, i, 0, 0))
        values.value = jax.lax.dynamic_update_slice(values.value, v, (0, i, 0, 0))
        index.value = i + 1
        seen = jnp.arange(self.cache_len) <= i
        return keys.value, values.value, jnp.broadcast_to(seen, (batch, 1, 1, self.cache_len))


class _MLP(nn.Module):
    """The gated-GELU MLP (``mlp_in`` holds gate and up) or the ReLU MLP."""

    config: T5Config
    policy: Policy

    @nn.compact
    def __call__(self, x):
        cfg, policy = self.config, self.policy
        out_std = cfg.init_std / math.sqrt(2 * (cfg.encoder_layers + cfg.decoder_layers))
        gated = cfg.mlp == "gated_gelu"
        h = layers.dense(
            (2, cfg.mlp_dim) if gated else cfg.mlp_dim,
            axes=("embed", None, "mlp") if gated else ("embed", "mlp"),
            policy=policy,
            std=cfg.init_std,
            use_bias=cfg.use_bias,
            name="mlp_in",
        )(x)
        h = checkpoint_name(h, "mlp_in")
        h = layers.gelu_exact(h[..., 0, :]) * h[..., 1, :] if gated else jax.nn.relu(h)
        h = checkpoint_name(h, "mlp_hidden")
        h = layers.dense(
            cfg.d_model,
            axes=("mlp", "embed"),
            policy=policy,
            std=out_std,
            use_bias=cfg.use_bias,
            name="mlp_out",
        )(h)
        return checkpoint_name(h, "mlp_out")


def _norm(cfg: T5Config, policy: Policy, name: str):
    if cfg.norm == "rms":
        norm = layers.rms_norm(eps=cfg.norm_eps, name=name)
    else:
        norm = layers.layer_norm(policy=policy, eps=cfg.norm_eps, use_bias=True, name=name)
    return lambda x: norm(x).astype(policy.compute_dtype)


def _sublayer(cfg: T5Config, policy: Policy, drop: nn.Module, norm_name: str, x, branch):
    """One residual sublayer: x + branch(norm(x)) pre-norm, norm(x + branch(x)) post-norm."""
    norm = _norm(cfg, policy, norm_name)
    if cfg.norm_position == "pre":
        return x + drop(branch(norm(x)))
    return norm(x + drop(branch(x)))


def _final_norm(cfg: T5Config, policy: Policy, x):
    """A stack's closing norm: pre-norm's last residual sum is unnormalized; post-norm's is."""
    return _norm(cfg, policy, "final_norm")(x) if cfg.norm_position == "pre" else x


class EncoderBlock(nn.Module):
    """Self-attention within each example, then the MLP, each a residual sublayer (pre- or
    post-norm); a scan body."""

    config: T5Config
    policy: Policy
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, positions, mask):
        cfg, policy = self.config, self.policy
        drop = nn.Dropout(cfg.dropout, deterministic=self.deterministic)
        attention = _Attention(cfg, policy, name="attention")
        x = _sublayer(cfg, policy, drop, "attn_norm", x, lambda h: attention(h, mask, positions))
        x = _sublayer(cfg, policy, drop, "mlp_norm", x, _MLP(cfg, policy, name="mlp"))
        return layers.constrain(x, ("batch", "length", "embed")), None


class DecoderBlock(nn.Module):
    """Causal self-attention within each example, cross-attention to the same example's
    encoding, then the MLP; each a residual sublayer (pre- or post-norm); a scan body."""

    config: T5Config
    policy: Policy
    deterministic: bool = True
    cache_len: int | None = None  # decoding one position per call (``_Attention``)

    @nn.compact
    def __call__(self, x, positions, self_mask, memory, cross_mask):
        cfg, policy = self.config, self.policy
        drop = nn.Dropout(cfg.dropout, deterministic=self.deterministic)
        attention = _Attention(cfg, policy, causal=True, cache_len=self.cache_len,
                               name="attention")  # fmt: skip
        cross = _Attention(cfg, policy, name="cross")
        x = _sublayer(
            cfg, policy, drop, "attn_norm", x, lambda h: attention(h, self_mask, positions)
        )
        x = _sublayer(cfg, policy, drop, "cross_norm", x,
                      lambda h: cross(h, cross_mask, memory=memory))  # fmt: skip
        x = _sublayer(cfg, policy, drop, "mlp_norm", x, _MLP(cfg, policy, name="mlp"))
        return layers.constrain(x, ("batch", "length", "embed")), None


def _stack(
    block: type[nn.Module],
    n: int,
    cfg: T5Config,
    policy: Policy,
    remat: RematConfig,
    deterministic: bool,
    name: str,
    n_inputs: int,
    **fields: object,
) -> nn.Module:
    """``n`` blocks as one ``nn.scan`` over a stacked "layers" axis of their parameters (and of
    a decoding cache); ``fields``: the blocks' other attributes."""
    return nn.scan(
        remat_block(block, remat),
        variable_axes={"params": 0, FP8_COLLECTION: 0, INT8_CALIBRATION: 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * n_inputs,
        length=n,
        unroll=min(cfg.scan_unroll, n),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, policy, deterministic, name=name, **fields)


def sinusoids(positions: jax.Array, d_model: int) -> jax.Array:
    """The original Transformer's fixed position encodings, [..., d_model] fp32 for integer
    ``positions`` [...]: sines of the first half's frequencies, then cosines (fairseq's layout;
    the frequencies fall geometrically from 1 to 1/10,000)."""
    half = d_model // 2
    inv_freq = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / max(half - 1, 1))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    out = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return jnp.pad(out, [(0, 0)] * (out.ndim - 1) + [(0, d_model % 2)])


def _embed(embed: nn.Module, cfg: T5Config, policy: Policy, tokens, positions, deterministic):
    x = embed(tokens)
    if cfg.positions == "sinusoidal":
        # Scaled to unit-std entries (init std d_model ** -0.5), the sinusoids' size.
        x = x.astype(jnp.float32) * math.sqrt(cfg.d_model) + sinusoids(positions, cfg.d_model)
    x = nn.Dropout(cfg.dropout, deterministic=deterministic)(x.astype(policy.compute_dtype))
    return layers.constrain(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
    """source ids [B, S] -> the encoding [B, S, d] (compute dtype)."""

    config: T5Config
    policy: Policy
    remat: RematConfig
    embed: nn.Module

    @nn.compact
    def __call__(self, source, source_segments, source_positions, deterministic=True):
        cfg, policy = self.config, self.policy
        x = _embed(self.embed, cfg, policy, source, source_positions, deterministic)
        stack = _stack(
            EncoderBlock, cfg.encoder_layers, cfg, policy, self.remat, deterministic, "blocks", 2
        )
        x = stack(x, source_positions, segment_mask(source_segments, source_segments))[0]
        return _final_norm(cfg, policy, x)


class Decoder(nn.Module):
    """The logits [B, T, vocab] (the policy's output dtype) for ``target_inputs`` (targets
    shifted right within each example), given the encoding."""

    config: T5Config
    policy: Policy
    remat: RematConfig
    embed: nn.Module

    @nn.compact
    def __call__(
        self,
        encoded,
        source_segments,
        target_inputs,
        target_segments,
        target_positions,
        deterministic=True,
        cache_len=None,
    ):
        cfg, policy = self.config, self.policy
        x = _embed(self.embed, cfg, policy, target_inputs, target_positions, deterministic)
        extra = {} if cache_len is None else {"cache_len": cache_len}
        stack = _stack(DecoderBlock, cfg.decoder_layers, cfg, policy, self.remat, deterministic,
                       "blocks", 4, **extra)  # fmt: skip
        x = stack(
            x,
            target_positions,
            segment_mask(target_segments, target_segments),
            encoded,
            segment_mask(target_segments, source_segments),
        )[0]
        x = _final_norm(cfg, policy, x)
        if cfg.tie_embeddings:
            logits = self.embed.attend(x)
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


class T5(nn.Module):
    """Encoder-decoder over packed rows; ``encode`` and ``decode`` are its two halves (the
    decoding loop calls them apart).

    Attributes:
      config: sizes and options.
      policy: dtypes of parameters and compute.
      remat: the encoder blocks' remat; ``decoder_remat`` the decoder's (default: the same).
    """

    config: T5Config
    policy: Policy
    remat: RematConfig = RematConfig()
    decoder_remat: RematConfig | None = None

    def setup(self) -> None:
        cfg, policy = self.config, self.policy
        # Embeddings start at std d_model ** -0.5 (rows of norm ~1), and the tied head is the
        # plain product with the final norm's output (norm ~sqrt(d_model)), so its logits
        # start at std ~1 whatever d_model. An extra d_model ** -0.5 on the head would bound
        # every logit by ~1 until Adam, moving each entry by ~lr per step, grew these rows: it
        # learned slowly (docs/translation.md, "Model", has the measurements).
        embed = layers.embed(
            cfg.vocab_size,
            cfg.d_model,
            axes=("vocab", "embed"),
            policy=policy,
            std=cfg.d_model**-0.5,
            name="token_embed",
        )
        self.token_embed = embed
        self.encoder = Encoder(cfg, policy, self.remat, embed)
        self.decoder = Decoder(cfg, policy, self.decoder_remat or self.remat, embed)

    def encode(self, source, source_segments, source_positions, *, deterministic=True):
        return self.encoder(source, source_segments, source_positions, deterministic)

    def decode(
        self,
        encoded,
        source_segments,
        target_inputs,
        target_segments,
        target_positions,
        *,
        deterministic=True,
    ):
        return self.decoder(
            encoded,
            source_segments,
            target_inputs,
            target_segments,
            target_positions,
            deterministic,
        )

    def decode_step(self, encoded, source_segments, previous, positions, *, cache_len):
        """One decoder position for every row: ``previous`` [B, 1] (the last output token,
        ``PAD_ID`` first) at ``positions`` [B, 1] -> logits [B, 1, vocab]; the keys and values
        of the earlier positions live in the ``cache`` collection ([layers, B, cache_len, ...]),
        which the call must be allowed to mutate."""
        return self.decoder(encoded, source_segments, previous, jnp.ones_like(previous),
                            positions, True, cache_len)  # fmt: skip

    def __call__(
        self,
        source,
        source_segments,
        source_positions,
        target_inputs,
        target_segments,
        target_positions,
        *,
        deterministic=True,
    ):
        encoded = self.encode(
            source, source_segments, source_positions, deterministic=deterministic
        )
        return self.decode(
            encoded,
            source_segments,
            target_inputs,
            target_segments,
            target_positions,
            deterministic=deterministic,
        )


def forward_flops(config: T5Config, *, rows: int, source_len: int, target_len: int) -> int:
    """GEMM FLOPs of one forward pass over ``rows`` packed rows (2 per multiply-add).

    Counts every projection, the attention scores and values over the full [T, S] squares (what
    the kernels compute; masks are applied after), and the output head; not norms or softmax.
    """
    d, m, v = config.d_model, config.mlp_dim, config.vocab_size
    s, t = source_len, target_len
    mlp = (3 if config.mlp == "gated_gelu" else 2) * d * m
    encoder = config.encoder_layers * s * (4 * d * d + mlp) + config.encoder_layers * 2 * s * s * d
    decoder = config.decoder_layers * (
        t * (4 * d * d + 2 * d * d + mlp)  # self qkv+out, cross q+out, MLP
        + s * 2 * d * d  # cross keys and values of the encoding
        + 2 * t * t * d  # self-attention scores and values
        + 2 * t * s * d  # cross-attention scores and values
    )
    return 2 * rows * (encoder + decoder + t * d * v)


def train_flops_per_step(config: T5Config, *, rows: int, source_len: int, target_len: int) -> int:
    """Model FLOPs of one training step (forward + backward = 3 x forward)."""
    return 3 * forward_flops(config, rows=rows, source_len=source_len, target_len=target_len)
