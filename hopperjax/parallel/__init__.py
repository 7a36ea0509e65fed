"""Device meshes and the logical-axis rules that place parameters and activations on them."""

from hopperjax.parallel.mesh import MESH_AXES, batch_axis_size, build_mesh
from hopperjax.parallel.rules import LOGICAL_AXIS_RULES, logical_sharding, sharding_context

__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "batch_axis_size",
    "build_mesh",
    "logical_sharding",
    "sharding_context",
]
