"""Device meshes, multi-process start-up, and the logical-axis rules that place arrays on meshes."""

from hopperjax.parallel.mesh import (
    MESH_AXES,
    batch_axis_size,
    build_mesh,
    initialize_distributed,
    process_agrees,
    process_batch_shard,
)
from hopperjax.parallel.rules import (
    LOGICAL_AXIS_RULES,
    Rules,
    logical_sharding,
    merge_rules,
    sharding_context,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "Rules",
    "batch_axis_size",
    "build_mesh",
    "initialize_distributed",
    "logical_sharding",
    "merge_rules",
    "process_agrees",
    "process_batch_shard",
    "sharding_context",
]
