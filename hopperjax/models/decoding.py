"""Autoregressive decoding for encoder-decoder models: greedy and beam search, jitted and batched.

Both take ``logits_fn(target_inputs, rows)``: the decoder's logits [rows, length, vocab] for
teacher-forced inputs [rows, length] (padding id 0 first, as in training), given which encoded
source row each input row belongs to (``rows``, for beams). They fill one position per step of a
``lax`` loop over a fixed ``max_len``, so a decode compiles once; every step runs the decoder
over the whole prefix (no cache: O(max_len^2) work, simple and exact).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

PAD_ID, EOS_ID = 0, 1
LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]


def _shift_right(tokens: jax.Array) -> jax.Array:
    return jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]


def greedy(logits_fn: LogitsFn, batch: int, max_len: int) -> jax.Array:
    """The most likely token at each position, until ``EOS_ID`` (then padding): [batch,
    max_len] int32."""
    rows = jnp.arange(batch)

    def step(i, state):
        tokens, done = state
        logits = logits_fn(_shift_right(tokens), rows)[:, i]
        token = jnp.where(done, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return tokens.at[:, i].set(token), done | (token == EOS_ID)

    init = (jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), bool))
    return jax.lax.fori_loop(0, max_len, step, init)[0]


def beam_search(
    logits_fn: LogitsFn, batch: int, max_len: int, *, beams: int = 4, length_penalty: float = 0.6
) -> jax.Array:
    """The best of ``beams`` hypotheses per row by log-probability / length-penalty (GNMT's
    ((5 + length) / 6) ** alpha; alpha 0 ranks by log-probability alone): [batch, max_len].

    Finished hypotheses (ended in ``EOS_ID``) keep their score and extend only with padding;
    with ``beams=1`` this is greedy decoding.
    """
    k = beams
    rows = jnp.repeat(jnp.arange(batch), k)  # the source row of every hypothesis
    neg = jnp.finfo(jnp.float32).min / 4

    def penalty(length):
        return ((5.0 + length) / 6.0) ** length_penalty

    def step(i, state):
        tokens, scores, done = state  # [B*K, T], [B, K], [B, K]
        logits = logits_fn(_shift_right(tokens), rows)[:, i].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits).reshape(batch, k, -1)
        vocab = logp.shape[-1]
        # A finished hypothesis continues only with padding, at no cost.
        pad_only = jnp.full((vocab,), neg).at[PAD_ID].set(0.0)
        logp = jnp.where(done[..., None], pad_only, logp)
        total = scores[..., None] + logp  # [B, K, V]
        if_first = jnp.where(jnp.arange(k) == 0, 0.0, neg)  # step 0: all beams are one
        total = jnp.where(i == 0, total + if_first[None, :, None], total)
        flat = total.reshape(batch, k * vocab)
        # Rank by the length-penalized score; keep the raw sum to extend.
        ended = jnp.sum(tokens.reshape(batch, k, -1) != PAD_ID, axis=-1)  # tokens so far
        grown = jnp.where(done, ended, ended + 1)[..., None].repeat(vocab, -1).reshape(batch, -1)
        ranked = flat / penalty(grown.astype(jnp.float32))
        _, best = jax.lax.top_k(ranked, k)  # [B, K]
        parent, token = best // vocab, (best % vocab).astype(jnp.int32)
        new_scores = jnp.take_along_axis(flat, best, axis=-1)
        parents = (jnp.arange(batch)[:, None] * k + parent).reshape(-1)
        tokens = tokens[parents].at[:, i].set(token.reshape(-1))
        was_done = jnp.take_along_axis(done, parent, axis=-1)
        done = was_done | (token == EOS_ID)
        return tokens, new_scores, done

    init = (
        jnp.zeros((batch * k, max_len), jnp.int32),
        jnp.zeros((batch, k), jnp.float32),
        jnp.zeros((batch, k), bool),
    )
    tokens, scores, _ = jax.lax.fori_loop(0, max_len, step, init)
    lengths = jnp.sum(tokens.reshape(batch, k, -1) != PAD_ID, axis=-1).astype(jnp.float32)
    best = jnp.argmax(scores / penalty(lengths), axis=-1)
    return tokens.reshape(batch, k, -1)[jnp.arange(batch), best]
