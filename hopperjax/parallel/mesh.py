"""Builds the ``(data, fsdp, tensor)`` device mesh from config."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from hopperjax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
# Mesh axes the global batch is split over; the rules table maps the logical 'batch' axis to these.
BATCH_MESH_AXES = ("data", "fsdp")


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Resolves -1 and lays the devices out as a mesh with axes ``MESH_AXES``.

    Args:
      config: axis sizes; one may be -1 (all remaining devices).
      devices: the devices to use; default all of ``jax.devices()``.

    Raises:
      ConfigError: the sizes do not multiply to the device count.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = dataclasses.asdict(config)
    known = math.prod(v for v in sizes.values() if v != -1)
    for axis, size in sizes.items():
        if size == -1:
            if len(devices) % known:
                raise ConfigError(
                    f"mesh.{axis}",
                    f"-1 cannot fill {len(devices)} devices "
                    f"when the other axes multiply to {known}",
                )
            sizes[axis] = len(devices) // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ConfigError(
            "mesh",
            f"data*fsdp*tensor = {math.prod(shape)} must equal the "
            f"{len(devices)} available devices",
        )
    # Auto axes: XLA propagates shardings between our explicit constraints (GSPMD style).
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def batch_axis_size(mesh: Mesh) -> int:
    """How many ways the global batch is split."""
    return math.prod(mesh.shape[a] for a in BATCH_MESH_AXES)
