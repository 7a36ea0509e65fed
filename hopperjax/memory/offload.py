"""Train-state parts kept in pinned host memory between steps (ZeRO-Offload's idea, done by XLA).

The state's shardings name a memory kind: ``offload.optimizer_state`` / ``offload.params`` put
those leaves in ``pinned_host``. Inside the step, ``fetch`` copies them to device memory where
they are needed, and the jit's output shardings copy the new values back to the host. Activation
offload is a remat policy (``remat.policy: offload``, ``memory/remat.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from hopperjax.config import ConfigError, OffloadConfig, RematConfig

HOST_MEMORY = "pinned_host"
DEVICE_MEMORY = "device"


def memory_kinds(device: jax.Device) -> tuple[str, ...]:
    return tuple(m.kind for m in device.addressable_memories())


def check_host_memory(
    devices: Sequence[jax.Device], offload: OffloadConfig, remat: RematConfig
) -> None:
    """Raises ConfigError, naming the key that asked, when the backend has no pinned host memory."""
    asked = [f"offload.{f}" for f in ("optimizer_state", "params") if getattr(offload, f)]
    if remat.policy == "offload":
        asked.append("remat.policy")
    if not asked:
        return
    kinds = memory_kinds(devices[0])
    if HOST_MEMORY not in kinds:
        raise ConfigError(
            asked[0],
            f"the {devices[0].platform} backend has no '{HOST_MEMORY}' memory to offload to "
            f"(it has: {', '.join(kinds) or 'none'})",
        )


def offloaded_fields(offload: OffloadConfig) -> tuple[str, ...]:
    """TrainState fields that live in host memory between steps."""
    fields = ("opt_state",) if offload.optimizer_state else ()
    return fields + (("params",) if offload.params else ())


def with_memory_kind(shardings: Any, fields: Sequence[str], kind: str) -> Any:
    """The TrainState sharding tree with the leaves of ``fields`` moved to memory ``kind``."""

    def move(tree: Any) -> Any:
        return jax.tree.map(
            lambda s: s.with_memory_kind(kind), tree, is_leaf=lambda x: isinstance(x, NamedSharding)
        )

    return dataclasses.replace(shardings, **{f: move(getattr(shardings, f)) for f in fields})


def make_fetch(device_shardings: Any, fields: Sequence[str]) -> Callable[[Any, str], Any] | None:
    """``fetch(state, field)`` -> that field's leaves copied to device memory (inside a jit).

    None when nothing is offloaded, so the step does not even trace a no-op copy.
    """
    if not fields:
        return None
    device = with_memory_kind(device_shardings, fields, DEVICE_MEMORY)

    def fetch(state: Any, field: str) -> Any:
        value = getattr(state, field)
        if field not in fields:
            return value
        return jax.device_put(value, getattr(device, field))

    return fetch


def state_bytes_by_memory(abstract_state: Any) -> dict[str, int]:
    """Per-device bytes of the train state in each memory kind: {"device": n, "pinned_host": m}."""
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(abstract_state):
        sharding = leaf.sharding
        kind = getattr(sharding, "memory_kind", None) or DEVICE_MEMORY
        shard = sharding.shard_shape(leaf.shape)
        size = 1
        for d in shard:
            size *= d
        totals[kind] = totals.get(kind, 0) + size * leaf.dtype.itemsize
    return totals


def host_transfers(jaxpr: Any) -> dict[str, int]:
    """Copies into host memory that a traced program asks for, each counted per loop trip.

    Read from the jaxpr, where the remat offload policy leaves its ``device_put``s to host
    memory: XLA:CPU drops them while compiling (host and device are one RAM there), so the
    compiled program cannot show them, but on GPU each is a device->host copy of that size.

    Returns:
      {"count": copies per step, "bytes": their total size per step (global, all devices)}.
    """
    totals = {"count": 0, "bytes": 0}

    def walk(jaxpr: Any, trips: int) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "device_put":
                for var in eqn.outvars:
                    if "host" in str(getattr(var.aval, "memory_space", "")).lower():
                        totals["count"] += trips
                        totals["bytes"] += trips * var.aval.size * var.aval.dtype.itemsize
            inner = (
                trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else trips
            )
            for sub in _subjaxprs(eqn.params):
                walk(sub, inner)

    walk(getattr(jaxpr, "jaxpr", jaxpr), 1)
    return totals


def _subjaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                found.append(item)
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                found.append(item.jaxpr)
    return found
