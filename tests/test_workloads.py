"""The workload seam: the registry, and every optional hook of the contract working end to end,
seen through a workload defined outside hopperjax (``toy_workload.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_workload
from conftest import REPO

import hopperjax
from hopperjax import workloads
from hopperjax.config import ConfigError
from hopperjax.trainer.step import preprocess_key
from hopperjax.workloads.base import Workload, cross_entropy

STEPS, BATCH = 6, 16


def toy_config(tmp_path, *overrides):
    return hopperjax.load_config(
        None,
        [
            "workload=toy",
            f"run_dir={tmp_path / 'run'}",
            f"train.steps={STEPS}",
            f"train.batch_size={BATCH}",
            "train.log_every=1",
            f"train.eval_every={STEPS // 2}",
            f"train.checkpoint_every={STEPS // 2}",
            "optim.base_lr=1e-2",
            "optim.warmup_steps=0",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """One 6-step toy run on 8 devices, mesh data=4 tensor=2; its result and initial params."""
    tmp_path = tmp_path_factory.mktemp("toy")
    config = toy_config(tmp_path, "mesh.data=4", "mesh.tensor=2")
    initial = jax.device_get(hopperjax.build_components(config).init_state().params)
    return config, hopperjax.train(config, console=False), initial


def test_registered_workload_is_found_and_listed():
    assert workloads.get("toy") is toy_workload.ToyRegression
    assert "toy" in workloads.names() and "toy" not in workloads.builtin_names()


def test_register_refuses_a_class_that_does_not_implement_the_contract():
    class Half(Workload):
        ModelConfig = toy_workload.ToyModel
        DataConfig = toy_workload.ToyData

    with pytest.raises(TypeError, match=r"does not implement .*build_model"):
        workloads.register("half", Half)
    assert "half" not in workloads.names()


def test_unknown_workload_is_a_config_error_with_the_nearest_name():
    with pytest.raises(ConfigError) as info:
        hopperjax.load_config(None, ["workload=tyo"])
    assert info.value.key == "workload" and "did you mean 'toy'?" in str(info.value)


def test_mutable_model_state_is_trained_checkpointed_and_read_by_eval(toy_run, tmp_path):
    config, result, _ = toy_run
    counters = jax.device_get(result.state.model_state["counters"])
    # The train step updated the model's counters once per step; eval never did.
    assert counters["seen"] == STEPS * BATCH
    evals = [r for r in result.history if "eval_loss" in r]
    # Eval read the state through predict: after 3 steps the model had seen 3 batches.
    assert [(r["step"], r["eval_seen"]) for r in evals] == [
        (STEPS // 2, STEPS // 2 * BATCH),
        (STEPS, STEPS * BATCH),
    ]
    # The checkpoint holds it: a resumed run continues counting from there.
    more = hopperjax.train(config.replace(**{"train.steps": STEPS + 2}), console=False)
    assert jax.device_get(more.state.model_state["counters"]["seen"]) == (STEPS + 2) * BATCH


def test_microbatches_thread_the_model_state(tmp_path):
    result = hopperjax.train(toy_config(tmp_path, "train.microbatches=2"), console=False)
    assert jax.device_get(result.state.model_state["counters"]["seen"]) == STEPS * BATCH


def test_preprocess_runs_in_the_step_with_its_own_key_stream(toy_run):
    _, result, _ = toy_run
    state = result.state
    # The model recorded the draw of the last step, made from that step's preprocessing key.
    expected = jax.random.uniform(preprocess_key(state.rng, STEPS - 1))
    recorded = state.model_state["counters"]["draw"]
    np.testing.assert_allclose(jax.device_get(recorded), jax.device_get(expected), rtol=1e-6)
    # Its own stream: not the key dropout uses at that step.
    dropout_key = jax.random.fold_in(state.rng, STEPS - 1)
    assert float(jax.random.uniform(dropout_key)) != float(recorded)


def test_param_labels_give_per_group_optimizers(toy_run):
    _, result, initial = toy_run
    params = jax.device_get(result.state.params)
    # "offset" is frozen by its group's set_to_zero; everything else trained.
    np.testing.assert_array_equal(params["offset"], initial["offset"])
    for name in ("inp", "out"):
        assert not np.allclose(params[name]["kernel"], initial[name]["kernel"])
    assert not np.allclose(params["table"], initial["table"])


def test_axis_rules_place_the_workloads_own_logical_axes(toy_run):
    _, result, _ = toy_run
    table = result.state.params["table"]
    # "toy_rows" -> tensor (the workload's rule); its "mlp" dim stays whole (tensor is taken).
    assert tuple(table.sharding.spec) == ("tensor", None)
    assert table.addressable_shards[0].data.shape == (table.shape[0] // 2, table.shape[1])


def test_write_artifacts_puts_the_workloads_files_in_the_run_dir(toy_run):
    config, _, _ = toy_run
    assert json.loads((config.run_path / toy_workload.ARTIFACT).read_text()) == {
        "train": 448,
        "eval": 64,
    }


def test_a_users_package_adds_a_workload_from_the_command_line(tmp_path):
    """No edit of hopperjax: ``workload:`` names a module of the user's package."""
    package = tmp_path / "user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "regress.py").write_text(
        "from toy_workload import ToyRegression\n\nWORKLOAD = ToyRegression\n"
    )
    config = tmp_path / "user.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            workload: user_pkg.regress
            run_dir: {tmp_path / "run"}
            train: {{steps: 4, batch_size: 16, log_every: 2, eval_every: 4}}
            """)
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)]),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "hopperjax.train", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert "vectors/s" in proc.stdout
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "workload: user_pkg.regress" in saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_equals_optax_on_smoothed_one_hot_targets(dtype):
    """The seam's cross-entropy: unsmoothed, optax's integer-label loss exactly; smoothed, optax's
    loss on ``smooth_labels`` of the one-hot labels (values 1e-6 relative, gradients 1e-6); from
    bf16 logits too, whose gradient comes back in bf16. (The memory it saves: docs/translation.md's
    ``hopperjax.inspect`` figures.)"""
    keys = jax.random.split(jax.random.key(0), 2)
    logits = (3 * jax.random.normal(keys[0], (4, 7, 50))).astype(dtype)
    labels = jax.random.randint(keys[1], (4, 7), 0, 50)
    plain = optax.softmax_cross_entropy_with_integer_labels(logits.astype("float32"), labels)
    np.testing.assert_array_equal(cross_entropy(logits, labels), plain)
    for smoothing in (0.1, 0.3):

        def reference(z, s=smoothing):
            targets = optax.smooth_labels(jax.nn.one_hot(labels, z.shape[-1]), s)
            return optax.softmax_cross_entropy(z.astype("float32"), targets).sum()

        def ours(z, s=smoothing):
            return cross_entropy(z, labels, s).sum()

        expected, expected_grad = jax.value_and_grad(reference)(logits)
        value, grad = jax.value_and_grad(ours)(logits)
        assert grad.dtype == logits.dtype
        np.testing.assert_allclose(value, expected, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(grad, np.float32), np.asarray(expected_grad, np.float32), rtol=0, atol=1e-6
        )
        # Smoothing moves the loss: the uniform part is counted.
        assert abs(float(value) - float(plain.sum())) > 0.1
        assert cross_entropy(logits, labels, smoothing).dtype == jnp.float32
