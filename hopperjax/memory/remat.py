"""Activation rematerialization: what each transformer block keeps for the backward pass.

Every block is wrapped in ``jax.checkpoint`` (``nn.remat``) inside the layer scan, so the scan
stores only the block input per layer plus whatever the policy saves; everything else is
recomputed from that input during the backward pass. The model tags its intermediates with
``checkpoint_name`` (``config.REMAT_NAMES``) so that the named policies have something to select.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from hopperjax.config import RematConfig

# Where offloaded activations live until the backward pass reads them back.
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


def checkpoint_policy(config: RematConfig) -> Callable[..., object] | None:
    """The ``jax.checkpoint`` policy for ``remat.policy``; None for ``none`` (no remat at all).

    ``full`` is ``nothing_saveable``: only the block input survives the forward pass.
    """
    policies = jax.checkpoint_policies
    if config.policy == "none":
        return None
    if config.policy == "full":
        return policies.nothing_saveable
    if config.policy == "dots":
        return policies.dots_saveable
    if config.policy == "dots_no_batch":
        return policies.dots_with_no_batch_dims_saveable
    if config.policy == "save_names":
        return policies.save_only_these_names(*config.saved)
    if config.policy == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(config.saved),
            names_which_can_be_offloaded=list(config.offloaded),
            offload_src=OFFLOAD_SRC,
            offload_dst=OFFLOAD_DST,
        )
    raise ValueError(f"unknown remat policy {config.policy!r}")  # config validation prevents it


def remat_block(
    block: type[nn.Module], config: RematConfig, *, static_argnums: tuple[int, ...] = ()
) -> type[nn.Module]:
    """``block`` wrapped so that its backward pass recomputes what ``config`` does not save.

    ``static_argnums``: ``__call__`` arguments that are Python values, not arrays (e.g. a
    ``train`` flag the block branches on), counting ``self`` as 0.
    """
    if config.policy == "none":
        return block
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the recompute
    # with the forward pass, and the barriers prevent_cse adds would only block fusion.
    return nn.remat(
        block,
        policy=checkpoint_policy(config),
        prevent_cse=False,
        static_argnums=static_argnums,
    )
