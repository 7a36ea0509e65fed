"""Autoregressive decoding for encoder-decoder models: greedy and beam search, jitted and batched.

Both fill one position per step of a ``lax`` loop, up to a fixed ``max_len`` (a decode compiles
once) or until every row has ended, from a ``Stepper``: what gives the next position's logits.
Two exist:

- ``uncached(logits_fn)``: ``logits_fn(target_inputs)`` runs the decoder over the whole prefix
  every step (the training path; O(max_len^2) work): the reference.
- ``cached(step_fn, cache)``: ``step_fn(previous_tokens, position, cache) -> (logits, cache)``
  runs one position, keys and values of the earlier ones kept in ``cache`` (a pytree whose
  arrays carry the decoded rows on axis 1, after the layer axis): what decoding uses.

A test checks they give the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PAD_ID, EOS_ID = 0, 1


@dataclasses.dataclass(frozen=True)
class Stepper:
    """``next(tokens [rows, max_len], i, state) -> (logits [rows, vocab], state)`` for position
    ``i``; ``reorder(state, parents)`` keeps the state of rows ``parents`` (beam search);
    ``state`` the initial state."""

    next: Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
    reorder: Callable[[Any, jax.Array], Any]
    state: Any


def uncached(logits_fn: Callable[[jax.Array], jax.Array]) -> Stepper:
    """The decoder over the whole prefix each step (no state: a row's source is fixed by its
    index, and beam search reorders hypotheses only within a source row)."""

    def next_logits(tokens, i, state):
        inputs = jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]
        return jnp.take(logits_fn(inputs), i, axis=1), state

    return Stepper(next_logits, lambda state, parents: state, None)


def cached(
    step_fn: Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]], cache: Any
) -> Stepper:
    """One position per step; ``step_fn(previous [rows, 1], position, cache) -> (logits [rows,
    1, vocab], cache)``."""

    def next_logits(tokens, i, cache):
        previous = jnp.where(i == 0, PAD_ID, jnp.take(tokens, jnp.maximum(i - 1, 0), axis=1))
        logits, cache = step_fn(previous[:, None], i, cache)
        return logits[:, 0], cache

    def reorder(cache, parents):
        return jax.tree.map(lambda x: x[:, parents] if x.ndim >= 2 else x, cache)

    return Stepper(next_logits, reorder, cache)


def _until_done(step: Callable[[jax.Array, Any], Any], init: Any, max_len: int, done: int) -> Any:
    """``step(i, carry)`` for i = 0, 1, ... until ``max_len`` or every row is done (the carry's
    item ``done``): short sentences stop the loop early."""

    def cond(state):
        i, carry = state
        return (i < max_len) & ~jnp.all(carry[done])

    def body(state):
        i, carry = state
        return i + 1, step(i, carry)

    return jax.lax.while_loop(cond, body, (jnp.asarray(0), init))[1]


def greedy(stepper: Stepper, batch: int, max_len: int) -> jax.Array:
    """The most likely token at each position, until ``EOS_ID`` (then padding): [batch,
    max_len] int32."""

    def step(i, carry):
        tokens, done, state = carry
        logits, state = stepper.next(tokens, i, state)
        logits = logits.at[:, PAD_ID].set(-jnp.inf)  # padding is never an output
        token = jnp.where(done, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return tokens.at[:, i].set(token), done | (token == EOS_ID), state

    init = (jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), bool), stepper.state)
    return _until_done(step, init, max_len, done=1)[0]


def beam_search(
    stepper: Stepper, batch: int, max_len: int, *, beams: int, length_penalty: float = 0.6
) -> jax.Array:
    """The best of ``beams`` hypotheses per row by log-probability / length penalty (GNMT's
    ((5 + length) / 6) ** alpha; alpha 0 ranks by log-probability alone): [batch, max_len].

    The stepper decodes ``batch * beams`` rows (row r's hypotheses are rows r * beams ...).
    Finished hypotheses (ended in ``EOS_ID``) keep their score and extend only with padding;
    with ``beams=1`` this is greedy decoding.
    """
    k = beams
    neg = jnp.finfo(jnp.float32).min / 4

    def penalty(length):
        return ((5.0 + length) / 6.0) ** length_penalty

    def step(i, carry):
        tokens, scores, done, state = carry  # [B*K, T], [B, K], [B, K], stepper state
        logits, state = stepper.next(tokens, i, state)
        logits = logits.astype(jnp.float32).at[:, PAD_ID].set(-jnp.inf)  # never an output
        logp = jax.nn.log_softmax(logits).reshape(batch, k, -1)
        vocab = logp.shape[-1]
        pad_only = jnp.full((vocab,), neg).at[PAD_ID].set(0.0)  # a finished hypothesis
        logp = jnp.where(done[..., None], pad_only, logp)
        total = scores[..., None] + logp  # [B, K, V]
        first = jnp.where(jnp.arange(k) == 0, 0.0, neg)  # step 0: the beams are one
        total = jnp.where(i == 0, total + first[None, :, None], total)
        flat = total.reshape(batch, k * vocab)
        # Rank by the length-penalized score; keep the raw sum to extend.
        length = jnp.sum(tokens.reshape(batch, k, -1) != PAD_ID, axis=-1)
        length = jnp.where(done, length, length + 1).astype(jnp.float32)
        ranked = flat / jnp.repeat(penalty(length), vocab, axis=-1)
        _, best = jax.lax.top_k(ranked, k)  # [B, K]
        parent, token = best // vocab, (best % vocab).astype(jnp.int32)
        parents = (jnp.arange(batch)[:, None] * k + parent).reshape(-1)
        tokens = tokens[parents].at[:, i].set(token.reshape(-1))
        done = jnp.take_along_axis(done, parent, axis=-1) | (token == EOS_ID)
        scores = jnp.take_along_axis(flat, best, axis=-1)
        return tokens, scores, done, stepper.reorder(state, parents)

    init = (
        jnp.zeros((batch * k, max_len), jnp.int32),
        jnp.zeros((batch, k), jnp.float32),
        jnp.zeros((batch, k), bool),
        stepper.state,
    )
    tokens, scores, _, _ = _until_done(step, init, max_len, done=2)
    lengths = jnp.sum(tokens.reshape(batch, k, -1) != PAD_ID, axis=-1).astype(jnp.float32)
    best = jnp.argmax(scores / penalty(lengths), axis=-1)
    return tokens.reshape(batch, k, -1)[jnp.arange(batch), best]
