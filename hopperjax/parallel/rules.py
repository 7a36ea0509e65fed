"""The one table that maps logical axis names (model code) to mesh axes (placement).

Model code annotates parameters and activations with logical names only; changing parallelism means
changing this table, never the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("layers", None),
)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    """The NamedSharding of an array whose dimensions carry these logical names."""
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), LOGICAL_AXIS_RULES)
    return NamedSharding(mesh, spec)


@contextlib.contextmanager
def sharding_context(mesh: Mesh) -> Iterator[None]:
    """Mesh and rules in scope while tracing, for ``nn.with_logical_constraint`` to resolve."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        yield
