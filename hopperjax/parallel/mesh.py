"""The ``(data, fsdp, tensor)`` device mesh, multi-process start-up, and who reads which rows.

Device order: ``tensor`` is the innermost (fastest-varying) mesh axis, so a tensor-parallel group
is consecutive devices, which JAX numbers node by node: it stays on a node's NVLink/NVSwitch.
With one process per node, ``mesh.dcn_data`` / ``mesh.dcn_fsdp`` place the cross-node part of
those axes explicitly (``create_hybrid_device_mesh``, processes as the slow-link granules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding

from hopperjax.config import ConfigError, DistributedConfig, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
# Mesh axes the global batch is split over; the rules table maps the logical 'batch' axis to these.
BATCH_MESH_AXES = ("data", "fsdp")


def initialize_distributed(config: DistributedConfig) -> bool:
    """Starts ``jax.distributed`` when the config asks for it; returns whether it did.

    Must run before anything touches a device. ``auto`` lets JAX read SLURM / Open MPI /
    Kubernetes variables; otherwise the coordinator address, process count and id are explicit.
    """
    if not config.enabled:
        return False
    timeouts = {
        "initialization_timeout": config.initialization_timeout_s,
        "heartbeat_timeout_seconds": config.heartbeat_timeout_s,
    }
    if config.auto:
        jax.distributed.initialize(**timeouts)
    else:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            **timeouts,
        )
    return True


def resolve_axis_sizes(config: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with -1 filled in.

    Raises:
      ConfigError: the sizes cannot multiply to ``num_devices``.
    """
    sizes = {"data": config.data, "fsdp": config.fsdp, "tensor": config.tensor}
    known = math.prod(v for v in sizes.values() if v != -1)
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % known:
                raise ConfigError(
                    f"mesh.{axis}",
                    f"-1 cannot fill {num_devices} devices when the other axes multiply to {known}",
                )
            sizes[axis] = num_devices // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != num_devices:
        raise ConfigError(
            "mesh",
            f"data*fsdp*tensor = {math.prod(shape)} must equal the {num_devices} available devices",
        )
    return shape  # type: ignore[return-value]


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Lays the devices out as a mesh with axes ``MESH_AXES``.

    Args:
      config: axis sizes; one may be -1 (all remaining devices).
      devices: the devices to use; default all of ``jax.devices()`` (every process's).

    Raises:
      ConfigError: the sizes do not multiply to the device count, or the cross-node split does
        not match the process count.
    """
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_axis_sizes(config, len(devices))
    # Auto axes: XLA propagates shardings between our explicit constraints (GSPMD style).
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    dcn = (config.dcn_data, config.dcn_fsdp, 1)
    if math.prod(dcn) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    processes = len({d.process_index for d in devices})
    if math.prod(dcn) != processes:
        raise ConfigError(
            "mesh.dcn_data",
            f"dcn_data*dcn_fsdp = {math.prod(dcn)} must equal the {processes} processes "
            f"(one per node)",
        )
    for axis, size, ways in zip(MESH_AXES, shape, dcn, strict=True):
        if size % ways:
            raise ConfigError(f"mesh.dcn_{axis}", f"must divide mesh.{axis}={size}")
    per_node = tuple(s // w for s, w in zip(shape, dcn, strict=True))
    grid = mesh_utils.create_hybrid_device_mesh(per_node, dcn, devices, process_is_granule=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def batch_axis_size(mesh: Mesh) -> int:
    """How many ways the global batch is split."""
    return math.prod(mesh.shape[a] for a in BATCH_MESH_AXES)


def process_batch_shard(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """Which contiguous block of the global batch this process's devices hold, and of how many.

    Processes whose devices hold the same rows (e.g. a tensor-parallel group spanning processes)
    get the same block, so they read the same examples. Returns: (block index, block count).
    """
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch, 1)).values():
        start, stop, _ = index[0].indices(global_batch)
        rows.update(range(start, stop))
    lo, hi = min(rows), max(rows) + 1
    if hi - lo != len(rows) or global_batch % len(rows):
        raise ValueError(
            f"this process holds batch rows {sorted(rows)}, not one contiguous "
            f"block; order the mesh so each process's devices share one block"
        )
    return lo // len(rows), global_batch // len(rows)


def process_agrees(flag: bool) -> bool:
    """True if any process's ``flag`` is set (every process gets the same answer)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils  # Only needed with several processes.

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
