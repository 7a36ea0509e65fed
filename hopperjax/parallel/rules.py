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

from hopperjax.parallel.mesh import MESH_AXES

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

LOGICAL_AXIS_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("layers", None),
    # One row per device (per-device state such as gradient-compression residuals).
    ("devices", MESH_AXES),
)


def merge_rules(extra: Sequence[tuple[str, str | tuple[str, ...] | None]]) -> Rules:
    """The defaults with a workload's ``extra`` rules; a name in ``extra`` replaces its default.

    Raises:
      ValueError: a rule names a mesh axis that does not exist (a workload bug, not user input).
    """
    extra = tuple((str(name), axes) for name, axes in extra)
    for name, axes in extra:
        for axis in (axes,) if isinstance(axes, str) or axes is None else axes:
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"axis rule {name!r} -> {axis!r}: no such mesh axis")
    named = {name for name, _ in extra}
    return extra + tuple(rule for rule in LOGICAL_AXIS_RULES if rule[0] not in named)


def logical_sharding(
    mesh: Mesh, logical_axes: Sequence[str | None], rules: Rules = LOGICAL_AXIS_RULES
) -> NamedSharding:
    """The NamedSharding of an array whose dimensions carry these logical names."""
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), rules)
    return NamedSharding(mesh, spec)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
    """Mesh and rules in scope while tracing, for ``nn.with_logical_constraint`` to resolve."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
