"""Exported artifacts: every workload's predict exported with a symbolic batch size, loaded by
the artifact's own ``load_artifact.py`` (JAX alone) and equal to the in-process predict at two
batch sizes; INT8 artifacts; the CLI and its one-line errors."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json

import jax
import numpy as np
import pytest
from infer_helpers import predict_batch, restored_from_init

import hopperjax
from hopperjax import workloads
from hopperjax.config import ConfigError
from hopperjax.infer.export import export_restored
from hopperjax.infer.quantize import quantize_restored


def _load_module(path):
    spec = importlib.util.spec_from_file_location(f"load_artifact_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fitted(batch, inputs, rows):
    """``batch`` at ``rows`` examples: each field whose signature starts with the symbolic batch
    cut to ``rows``, or padded with zero rows (DTA's molecule tables hold fewer rows than pairs;
    padding rows are never indexed)."""
    out = {}
    for name, value in batch.items():
        if inputs[name]["shape"][:1] == ["batch"]:
            value = value[:rows]
            pad = [(0, rows - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
            value = np.pad(value, pad)
        out[name] = value
    return out


def _batch_size(restored):
    t = restored.config.train
    return t.eval_batch_size or t.batch_size


@pytest.mark.parametrize("name", workloads.builtin_names())
def test_exported_predict_equals_in_process_predict_at_two_batch_sizes(name, tmp_path):
    restored, batches = restored_from_init(name, tmp_path / "run")
    out = tmp_path / "artifact"
    meta = export_restored(restored, out, platforms=("cpu", "cuda"))
    assert meta["platforms"] == ["cpu", "cuda"] and "batch" in json.dumps(meta["inputs"])
    assert "stablehlo" in (out / "predict.stablehlo.mlir").read_text()
    loader = out / "load_artifact.py"
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(loader.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [m for m in imported if m and m.startswith("hopperjax")], imported
    model = _load_module(loader).load(out)
    size = _batch_size(restored)
    for rows in (size, size // 2):
        batch = _fitted(batches[0], meta["inputs"], rows)
        got = np.asarray(jax.tree.leaves(model(batch))[0], np.float32)
        np.testing.assert_allclose(got, predict_batch(restored, batch), rtol=1e-5, atol=1e-5)


def test_a_graph_encoder_artifact_takes_the_drugs_graph_in_fixed_slots(tmp_path):
    """``drug_encoder: gin``: only pairs and table rows are symbolic; the drugs' graph comes in
    the artifact's fixed atom and bond slots (room for every row's molecule at its largest), so a
    packed training batch, its slots padded with no atoms and no bonds, predicts as in process."""
    overrides = ("model.drug_encoder=gin", "data.synthetic_smiles=true")
    restored, batches = restored_from_init("dta", tmp_path / "run", *overrides)
    out = tmp_path / "artifact"
    meta = export_restored(restored, out)
    inputs = meta["inputs"]
    size = _batch_size(restored)
    rows = inputs["drug_sizes"]["shape"]
    assert rows == ["batch"] and inputs["drug_atoms"]["shape"][0] == size * 96
    assert inputs["drug_bonds"]["shape"] == [size * 4 * 96, 3]
    batch = dict(batches[0])
    for name, fill in (("drug_atoms", 0), ("drug_bonds", -1), ("drug_graph", -1)):
        slots = inputs[name]["shape"][0]
        pad = [(0, slots - batch[name].shape[0])] + [(0, 0)] * (batch[name].ndim - 1)
        batch[name] = np.pad(batch[name], pad, constant_values=fill)
    batch["drug_bonds"][len(batches[0]["drug_bonds"]) :, 2] = 0
    batch = _fitted(batch, inputs, size)
    model = _load_module(out / "load_artifact.py").load(out)
    got = np.asarray(jax.tree.leaves(model(batch))[0], np.float32)
    np.testing.assert_allclose(got, predict_batch(restored, batch), rtol=1e-5, atol=1e-5)
    packed = predict_batch(restored, batches[0])  # the same molecules in fewer slots
    np.testing.assert_allclose(got[: len(packed)], packed, rtol=1e-5, atol=1e-5)


def test_only_batch_axes_are_symbolic_even_when_another_dimension_equals_the_batch(tmp_path):
    """An eval batch of 32 windows of 32 tokens: the length stays 32."""
    from hopperjax.infer.export import input_signature

    restored, _ = restored_from_init("lm", tmp_path)
    config = restored.config.replace(**{"train.eval_batch_size": 32})
    specs, described = input_signature(dataclasses.replace(restored, config=config))
    assert described["inputs"]["shape"] == ["batch", 32]
    assert str(specs["inputs"].shape[0]) == "batch" and specs["inputs"].shape[1] == 32


def test_int8_artifact_runs_the_quantized_model_and_errors_name_the_field(tmp_path):
    restored, batches = restored_from_init("lm", tmp_path / "run")
    q = quantize_restored(restored, "w8a8")
    out = tmp_path / "int8"
    meta = export_restored(q, out, quantize="w8a8")
    assert meta["quantize"] == "w8a8" and "int8" in meta["variables"].values()
    loader = _load_module(out / "load_artifact.py")
    model = loader.load(out)
    np.testing.assert_allclose(
        np.asarray(model(batches[0]), np.float32), predict_batch(q, batches[0]), rtol=1e-5,
        atol=1e-5,
    )  # fmt: skip
    bad = {**batches[0], "inputs": batches[0]["inputs"].astype(np.int64)}
    with pytest.raises(loader.ArtifactError, match="'inputs'"):
        model(bad)
    with pytest.raises(ValueError, match="missing field 'inputs'"):
        model({})
    with pytest.raises(ConfigError, match="--out"):
        export_restored(q, out)
    with pytest.raises(ConfigError, match="--platforms"):
        export_restored(q, tmp_path / "x", platforms=("tpu7",))
    assert not (tmp_path / "x").exists()


def test_export_cli_writes_an_artifact_from_a_run(tmp_path, capsys):
    from hopperjax import export

    run = tmp_path / "run"
    config = hopperjax.load_config(
        None, ["workload=lm", *workloads.get("lm").smoke_overrides, "mesh.data=1",
               "train.steps=2", f"run_dir={run}"],
    )  # fmt: skip
    hopperjax.train(config, devices=jax.devices()[:1], console=False)
    out = tmp_path / "artifact"
    argv = ["--run-dir", str(run), "--out", str(out), "--quantize", "w8a8_static",
            "--calibration-batches", "2"]  # fmt: skip
    assert export.main(argv) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["step"] == 2 and meta["quantize"] == "w8a8_static"
    assert "config.yaml" in meta["files"] and (out / "config.yaml").is_file()
    assert "metrics.jsonl" not in meta["files"]
    assert export.main(argv) == 2  # the directory exists
    assert export.main(["--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "y")]) == 2
    assert export.main([*argv[:2], "--out", str(tmp_path / "z"), "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("hopperjax.export: ") for line in err)
    assert not list(tmp_path.glob(".*partial"))
