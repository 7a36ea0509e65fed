"""Load and run a hopperjax exported artifact with JAX alone.

This file imports nothing from hopperjax (``hopperjax.export`` copies it into every artifact as
``load_artifact.py``), so a server needs only ``jax`` and ``numpy``:

    import load_artifact
    model = load_artifact.load("artifact_dir")
    outputs = model(batch)          # batch: {field: array}, any batch size

An artifact directory holds ``predict.jax`` (a serialized ``jax.export`` module: the workload's
preprocessing and ``predict``, with a symbolic batch dimension), ``variables.npz`` (its
variables, one array per path; 16-bit floats stored as their bits), ``metadata.json`` (input
signature, dtypes, platforms, versions, the files copied from the run) and those files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "hopperjax-export/1"
SEPARATOR = "/"


class ArtifactError(ValueError):
    """An artifact that cannot be loaded, or a batch it cannot take (one line, names the file or
    field)."""


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b/c": x}`` -> ``{"a": {"b": {"c": x}}}``."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(SEPARATOR)
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


class Artifact:
    """A loaded artifact: call it with a batch ``{field: array}``."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        try:
            self.metadata = json.loads((directory / "metadata.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{directory / 'metadata.json'}: cannot read ({e})") from None
        if self.metadata.get("format") != FORMAT:
            raise ArtifactError(
                f"{directory / 'metadata.json'}: format {self.metadata.get('format')!r}, "
                f"expected {FORMAT!r}"
            )
        try:
            self.exported = jax.export.deserialize(
                bytearray((directory / "predict.jax").read_bytes())
            )
            with np.load(directory / "variables.npz") as stored:
                flat = {key: stored[key] for key in stored.files}
        except Exception as e:  # unreadable, truncated, or from an incompatible JAX
            raise ArtifactError(f"{directory}: cannot load the module or variables ({e})") from None
        dtypes = self.metadata["variables"]
        for key, array in flat.items():
            if key not in dtypes:
                raise ArtifactError(f"{directory / 'variables.npz'}: unexpected array {key!r}")
            flat[key] = array.view(jnp.dtype(dtypes[key])) if array.dtype.kind == "u" and (
                jnp.dtype(dtypes[key]) != array.dtype) else array  # fmt: skip
        self.variables = jax.device_put(unflatten(flat))
        self.inputs = self.metadata["inputs"]

    def check(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch`` as the module takes it; raises ArtifactError naming the first bad field."""
        missing = [name for name in self.inputs if name not in batch]
        if missing:
            raise ArtifactError(
                f"batch: missing field {missing[0]!r} (fields: {list(self.inputs)})"
            )
        out, size = {}, None
        for name, spec in self.inputs.items():
            array = np.asarray(batch[name])
            if array.dtype != np.dtype(spec["dtype"]):
                raise ArtifactError(
                    f"batch field {name!r}: dtype {array.dtype}, expected {spec['dtype']}"
                )
            if len(array.shape) != len(spec["shape"]):
                raise ArtifactError(
                    f"batch field {name!r}: shape {list(array.shape)}, expected {spec['shape']}"
                )
            for n, want in zip(array.shape, spec["shape"], strict=True):
                if want == "batch":
                    if size is not None and n != size:
                        raise ArtifactError(f"batch field {name!r}: batch size {n}, others {size}")
                    size = n
                elif n != want:
                    raise ArtifactError(
                        f"batch field {name!r}: shape {list(array.shape)}, expected {spec['shape']}"
                    )
            out[name] = array
        return out

    def __call__(self, batch: Mapping[str, Any]) -> Any:
        return self.exported.call(self.variables, self.check(batch))


def load(directory: str | Path) -> Artifact:
    """The artifact in ``directory``, ready to call."""
    return Artifact(directory)
