"""The workload contract, run for every workload: each built-in one (``hopperjax/workloads/``,
so a new module is covered by existing) and the test-defined ``toy`` (``toy_workload.py``).

Each is shrunk with its own ``smoke_overrides`` (a ``VARIANTS`` case adds its own keys: another
encoder of the same workload) and must build, train, evaluate, resume exactly, give one
device's losses on 8 devices, restore its parameters without its optimizer or data, compile to
the FLOPs its model's formula gives, and lay its parameters out as its golden file says.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import toy_workload  # noqa: F401  (registers the "toy" workload)
from conftest import REPO

import hopperjax
from hopperjax import workloads
from hopperjax.inspect import inspect_config
from hopperjax.parallel import merge_rules

NAMES = [*workloads.builtin_names(), "toy"]
# Other models of a workload that the contract covers too: case -> (workload, extra overrides).
VARIANTS = {
    "dta-gin": (
        "dta",
        (
            "model.drug_encoder=gin",
            "data.synthetic_smiles=true",
            "model.gnn_dim=16",
            "model.gnn_layers=2",
            "data.synthetic_drugs=4",
        ),
    ),
    # airbench: frozen whitening filters from the training images (restored without the data),
    # BatchNorm biases in a group of their own, multi-crop test-time augmentation, lookahead
    # weight averaging every 2 steps (the step-2 eval, 8 devices against 1, is of averaged
    # weights; resuming between two averaging steps is tests/test_train.py's).
    "image-airbench": (
        "image",
        (
            "model.arch=airbench",
            "model.init=dirac",
            "model.bn_bias_lr_scale=64",
            "optim.name=sgd",
            "model.whiten_images=64",
            "data.tta_translate=1",
            "data.tta_flip=true",
            "optim.ema_decay=0.5",
            "optim.ema_every=2",
            "optim.ema_ramp=1",
        ),
    ),
    # Row-sparse tables: accumulators in the state (exact resume), no dense table gradient.
    "recommendation-sparse": ("recommendation", ("model.sparse_updates=true",)),
    # Table-wise: one grouped table [groups, rows, dim], updated row-sparsely group by group.
    "recommendation-tables": (
        "recommendation",
        ("model.table_placement=tables", "model.table_groups=2", "model.sparse_updates=true"),
    ),
}
CASES = [*NAMES, *VARIANTS]
# The eval at step 2 follows the second update, whose gradient can hang on float rounding: the
# graph encoder's max over atoms sends its gradient to whichever of a molecule's near-tied
# symmetric atoms is largest by an ulp, which the 8-device program and the 1-device one can round
# apart (same forward, same first update to 1e-6; with the max taken out of the readout the
# parameters agree to 2e-6 after both updates). Measured: 0.16 % apart (36.49 on one device,
# 36.43 on 8).
EVAL_PARITY_RTOL = {"dta-gin": 5e-3}
GOLDEN = REPO / "tests" / "golden"
# Set to write missing or changed golden files instead of failing (then review the diff).
UPDATE_GOLDEN = os.environ.get("HOPPERJAX_UPDATE_GOLDEN") == "1"


def smoke_config(case: str, run_dir: Path, *overrides: str) -> hopperjax.Config:
    name, extra = VARIANTS.get(case, (case, ()))
    cls = workloads.get(name)
    assert cls.smoke_overrides, f"workload {name!r} declares no smoke_overrides"
    return hopperjax.load_config(
        None,
        [
            f"workload={name}",
            *cls.smoke_overrides,
            f"run_dir={run_dir}",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.checkpoint_every=2",
            "optim.warmup_steps=1",
            *extra,
            *overrides,
        ],
    )


def test_the_builtin_workloads_are_found_by_name():
    assert {"lm", "dta"} <= set(workloads.builtin_names())
    assert set(NAMES) <= set(workloads.names())


@pytest.mark.parametrize("name", CASES)
def test_trains_evaluates_resumes_exactly_and_restores_params(name, tmp_path):
    run = smoke_config(name, tmp_path / "run", "train.keep_checkpoints=2")
    straight = hopperjax.train(run, console=False)
    # Resume from the run's own step-2 checkpoint (its step-4 one taken away): steps 2 and 3 again,
    # from the restored state and data position, must be the straight run's. (Stopping at a step
    # and resuming, train.stop_after, is tests/test_train.py's; the checkpoint it stops on is the
    # one a periodic save writes.)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]
    shutil.rmtree(checkpoints / "4")
    second = hopperjax.train(run, console=False)
    assert second.start_step == 2

    def losses(history):
        return {r["step"]: r["loss"] for r in history if "loss" in r}

    assert sorted(losses(straight.history)) == [0, 1, 2, 3]
    assert sorted(losses(second.history)) == [2, 3]
    np.testing.assert_allclose(
        [losses(second.history)[s] for s in (2, 3)],
        [losses(straight.history)[s] for s in (2, 3)],
        rtol=1e-6,
    )
    for a, b in zip(
        jax.tree.leaves(jax.device_get(straight.state)),
        jax.tree.leaves(jax.device_get(second.state)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6)

    evals = [r for r in straight.history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isfinite(r["eval_loss"]) for r in evals)
    assert np.isfinite(losses(straight.history)[3])

    # Data parallelism changes nothing but float rounding: one device's first two losses (the
    # second after an update of all-reduced gradients) and its eval at step 2 are the 8 devices'.
    one = hopperjax.train(
        smoke_config(name, tmp_path / "one", "train.stop_after=2"),
        devices=jax.devices()[:1],
        console=False,
    )
    np.testing.assert_allclose(
        [losses(one.history)[s] for s in (0, 1)],
        [losses(straight.history)[s] for s in (0, 1)],
        rtol=1e-4,
    )
    (one_eval,) = [r["eval_loss"] for r in one.history if "eval_loss" in r]
    np.testing.assert_allclose(
        one_eval, evals[0]["eval_loss"], rtol=EVAL_PARITY_RTOL.get(name, 1e-4)
    )

    # Parameters (and model state) alone, from the model and eval_shape: no optimizer, no data.
    restored = hopperjax.restore_params(second.run_dir)
    workload = VARIANTS.get(name, (name,))[0]
    assert restored.step == 4 and restored.workload.config.workload == workload
    trained = {"params": second.state.params, **(second.state.model_state or {})}
    if second.state.fp8 is not None:
        trained.update(second.state.fp8)
    assert jax.tree.structure(restored.variables) == jax.tree.structure(trained)
    for a, b in zip(jax.tree.leaves(restored.variables), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", CASES)
def test_compiled_flops_match_the_models_own_count(name, tmp_path):
    report = inspect_config(smoke_config(name, tmp_path / "run"))
    assert report["model_flops_per_step"] > 0
    # No remat: the compiled step's GEMMs and convolutions do the model's work and no more.
    # (The DTA smoke config keeps the recipe's sequence lengths: its convolutions' input
    # gradients also multiply the zero padding at the sequence ends, which XLA computes; at 24 and
    # 64 tokens that is 4.7 % more than 3 x forward, at 85 and 1,200 tokens 0.23 %.)
    assert report["flops_per_step"] == pytest.approx(report["model_flops_per_step"], rel=0.01)
    # (XLA:CPU drops the op name of a few rewritten dots; inspect then calls a GEMM "unknown"
    # unless its output has the size of a weight.)
    assert {"forward", "weight_grad"} <= {g["role"] for g in report["gemms"]}


def _specs(name: str, tmp_path: Path) -> dict[str, list]:
    """Mesh axes of every parameter and model-state array on a data=2 fsdp=2 tensor=2 mesh."""
    config = smoke_config(name, tmp_path / "run", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    parts = hopperjax.build_components(config)
    state = parts.abstract_state
    out = {}
    for field in ("params", "model_state"):
        leaves, _ = jax.tree_util.tree_flatten_with_path(getattr(state, field))
        for path, leaf in leaves:
            key = "/".join([field, *(str(getattr(k, "key", k)) for k in path)])
            out[key] = [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec]
    assert parts.rules == merge_rules(parts.workload.axis_rules())
    return out


@pytest.mark.parametrize("name", CASES)
def test_partition_specs_match_golden(name, tmp_path):
    actual = _specs(name, tmp_path)
    path = GOLDEN / f"{name}_partition_specs.json"
    if UPDATE_GOLDEN:
        path.write_text(json.dumps(actual, indent=2, sort_keys=True) + "\n")
    assert path.is_file(), (
        f"{path} is missing: run HOPPERJAX_UPDATE_GOLDEN=1 pytest {__file__} and review it"
    )
    assert actual == json.loads(path.read_text()), f"{name}: layout differs from {path.name}"
