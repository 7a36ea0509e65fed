"""Export a restored (optionally INT8-quantized) model as a self-contained artifact.

``export_restored`` traces the workload's evaluation path (``preprocess(train=False)`` then
``predict``) with ``jax.export``: every dimension whose logical axis is ``batch`` becomes one
symbolic size ``batch``, and the module is lowered for each platform asked (``cpu``, ``cuda``;
lowering for a platform needs no device of it), serialized (``predict.jax``) and also written
as StableHLO text (``predict.stablehlo.mlir``, for other compilers). Its variables go to
``variables.npz``, the input signature, dtypes and versions to ``metadata.json``, the run's own
files (its config, tokenizer or vocabulary) beside them, and ``load_artifact.py``
(``infer/artifact.py``, which imports nothing from hopperjax) runs it with JAX alone. The
directory is written under a hidden name and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.infer import artifact
from hopperjax.infer.restore import Restored
from hopperjax.precision import policy_from_config

PLATFORMS = ("cpu", "cuda")
# Run files an artifact never needs (the rest: config, tokenizer, vocabulary, ... are copied).
SKIPPED_RUN_FILES = ("metrics.jsonl",)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{artifact.SEPARATOR}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(_flatten(value, path))
        else:
            flat[path] = value
    return flat


def input_signature(restored: Restored) -> tuple[dict[str, jax.ShapeDtypeStruct], dict]:
    """The module's batch spec (every dimension whose logical axis is ``batch`` symbolic) and its
    description."""
    config, workload = restored.config, restored.workload
    size = config.train.eval_batch_size or config.train.batch_size
    fields = workload.batch_fields(size, None)
    (batch,) = jax.export.symbolic_shape("batch")
    specs, described = {}, {}
    for name, field in fields.items():
        symbolic = [axis == "batch" for axis in field.axes]
        shape = tuple(batch if s else n for n, s in zip(field.shape, symbolic, strict=True))
        specs[name] = jax.ShapeDtypeStruct(shape, field.dtype)
        described[name] = {
            "shape": ["batch" if s else n for n, s in zip(field.shape, symbolic, strict=True)],
            "dtype": np.dtype(field.dtype).name,
        }
    return specs, described


def export_restored(
    restored: Restored,
    out: str | Path,
    *,
    platforms: tuple[str, ...] = ("cpu",),
    quantize: str | None = None,
    run_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Writes the artifact of ``restored`` to ``out`` and returns its metadata.

    ``quantize``: the INT8 scheme ``restored`` was converted with (recorded only). ``run_dir``:
    whose files to copy beside the module.

    Raises:
      ConfigError: an unknown platform (``--platforms``), an existing ``out`` (``--out``), or a
        predict that cannot be exported with a symbolic batch size (``--run-dir``)."""
    out = Path(out)
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise ConfigError("--platforms", f"expected some of {', '.join(PLATFORMS)}, got {bad}")
    if out.exists():
        raise ConfigError("--out", f"{out} exists; export writes a new directory")
    workload, model = restored.workload, restored.model
    specs, described = input_signature(restored)

    def predict(variables: dict[str, Any], batch: dict[str, Any]) -> Any:
        batch = workload.preprocess(batch, jax.random.key(0), train=False)
        return workload.predict(model, variables, batch)

    variable_specs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), restored.variables
    )
    policy = policy_from_config(restored.config, default_fp8_layers=workload.default_fp8_layers)
    try:
        # Traced under the run's matmul precision, as its evaluation is (fp32 stays fp32 on GPUs).
        with jax.default_matmul_precision(policy.matmul_precision):
            exported = jax.export.export(jax.jit(predict), platforms=platforms)(
                variable_specs, specs
            )
    except Exception as e:  # shape polymorphism errors come as several exception types
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            "--run-dir", f"the '{restored.config.workload}' predict cannot be exported with a "
            f"symbolic batch size: {first}",
        ) from None  # fmt: skip
    flat = {k: np.asarray(jax.device_get(v)) for k, v in _flatten(restored.variables).items()}
    dtypes = {k: v.dtype.name for k, v in flat.items()}
    # npz keeps numpy's own dtypes; 16-bit floats (bfloat16) travel as their bits.
    stored = {k: v.view(f"u{v.dtype.itemsize}") if v.dtype.kind == "V" or v.dtype.name ==
              "bfloat16" else v for k, v in flat.items()}  # fmt: skip
    metadata = {
        "format": artifact.FORMAT,
        "workload": restored.config.workload,
        "step": restored.step,
        "quantize": quantize or "none",
        "platforms": list(platforms),
        "inputs": described,
        # Whether requests concatenate along the batch (the server merges them) or must run alone.
        "independent_rows": bool(restored.workload.independent_rows),
        "outputs": [str(o) for o in exported.out_avals],
        "variables": dtypes,
        "parameter_bytes": int(sum(v.nbytes for v in flat.values())),
        "versions": {"hopperjax": hopperjax.__version__, "jax": jax.__version__},
        "files": [],
    }
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, exported, stored, metadata, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(out)
    return metadata


def _write(tmp: Path, exported: Any, stored: dict, metadata: dict, run_dir: Any) -> None:
    (tmp / "predict.jax").write_bytes(exported.serialize())
    # The same module as StableHLO text: what other compilers (mlir-tensorrt's) take.
    (tmp / "predict.stablehlo.mlir").write_text(exported.mlir_module())
    np.savez(tmp / "variables.npz", **stored)
    shutil.copyfile(Path(artifact.__file__), tmp / "load_artifact.py")
    if run_dir is not None:
        for path in sorted(Path(run_dir).iterdir()):
            skipped = path.name in SKIPPED_RUN_FILES or path.name.startswith(".")
            if path.is_file() and not skipped:
                shutil.copyfile(path, tmp / path.name)
                metadata["files"].append(path.name)
    (tmp / "metadata.json").write_text(json.dumps(metadata, indent=1))
