"""End-to-end training: data-parallel parity, exact resume, LR scaling, NaN guard, preemption."""

import datetime
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.observe import read_metrics
from hopperjax.observe.trace_summary import summarize_trace


def train_losses(history):
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def test_eight_devices_match_one_device(tiny_config, tmp_path):
    one = hopperjax.train(
        tiny_config("mesh.data=1", f"run_dir={tmp_path / 'one'}"),
        devices=jax.devices()[:1],
        console=False,
    )
    eight = hopperjax.train(
        tiny_config("mesh.data=8", f"run_dir={tmp_path / 'eight'}"), console=False
    )
    a, b = train_losses(one.history), train_losses(eight.history)
    assert sorted(a) == sorted(b) == list(range(20))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-4)
    # Data parallel: every parameter is replicated on all 8 devices, the batch is split 8 ways.
    for leaf in jax.tree.leaves(eight.state.params):
        assert len(leaf.sharding.device_set) == 8 and leaf.sharding.is_fully_replicated


# Lookahead averaging at steps 4, 8, ...: the stop at step 10 falls between two, where the
# weights have moved on from the average, so the resumed run needs the checkpointed average.
AVERAGED = ("optim.ema_decay=0.5", "optim.ema_every=4")


def test_resume_is_exact(tiny_config, tmp_path):
    straight = hopperjax.train(tiny_config(*AVERAGED, f"run_dir={tmp_path / 'a'}"), console=False)
    # Profiling is off: no record says it was traced (default profile.start_step 10 is in range).
    assert not any(r.get("profiled") for r in straight.history)
    # Evals say when they ran (seconds of training since the first step: time to accuracy).
    elapsed = [r["elapsed_s"] for r in straight.history if "eval_loss" in r]
    assert len(elapsed) == 2 and 0 < elapsed[0] < elapsed[1]
    assert straight.data_s > 0 and straight.compile_s > 0
    resumed_dir = tmp_path / "b"
    first = hopperjax.train(
        tiny_config(*AVERAGED, "train.stop_after=10", f"run_dir={resumed_dir}"),
        console=False,
    )
    assert max(train_losses(first.history)) == 9
    # A crash after the checkpoint leaves records the resumed run will log again, and maybe a
    # half-written checkpoint directory; neither may leak into the resumed run.
    with (resumed_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 12, "loss": 99.0, "lr": 0.0}) + "\n")
    partial = resumed_dir / "checkpoints" / "15.orbax-checkpoint-tmp-1700000000000000"
    partial.mkdir()
    (partial / "garbage").write_text("half written")

    second = hopperjax.train(tiny_config(*AVERAGED, f"run_dir={resumed_dir}"), console=False)
    assert (straight.start_step, first.start_step, second.start_step) == (0, 0, 10)
    a, b = train_losses(straight.history), train_losses(second.history)
    assert sorted(b) == list(range(10, 20))
    np.testing.assert_allclose([b[s] for s in b], [a[s] for s in b], rtol=1e-6, atol=0)
    logged = [r for r in read_metrics(resumed_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logged] == list(range(20))
    np.testing.assert_allclose([r["loss"] for r in logged], [a[s] for s in range(20)], rtol=1e-6)
    for x, y in zip(
        jax.tree.leaves(straight.state.params), jax.tree.leaves(second.state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_rerun_of_a_finished_run_does_nothing(tiny_config, capsys):
    config = tiny_config()
    first = hopperjax.train(config, console="bar")  # as experiments run: a line at each end
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith(f"hopperjax: {first.run_dir}: training to step 20")
    assert re.match(rf"hopperjax: {first.run_dir}: step 20, loss \d\.\d{{4}} \| eval_loss ", out[1])
    saved = (first.run_dir / "config.yaml").read_text()
    assert f"run_dir: {first.run_dir}" in saved  # resolved, never null
    again = hopperjax.train(tiny_config("optim.base_lr=0.5"), console=True)
    assert "complete at step 20: nothing to do; raise train.steps" in capsys.readouterr().out
    # The logged history and the final state, and the record of what was run left as it was.
    assert again.history == first.history
    assert int(again.state.step) == 20 and again.start_step == 20
    for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(again.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (first.run_dir / "config.yaml").read_text() == saved


def test_resume_refuses_a_changed_model(tiny_config):
    hopperjax.train(tiny_config("train.stop_after=2"), console=False)
    with pytest.raises(ConfigError) as info:
        hopperjax.train(tiny_config("train.stop_after=4", "model.d_model=64"), console=False)
    assert info.value.key == "model.d_model"


def test_resume_refuses_a_change_of_the_optimizer_state_and_allows_a_harmless_one(tiny_config):
    """optim.clip_norm is no run-defining key, but dropping clipping drops its slot from the
    optimizer state, so the checkpoints no longer fit; more steps fit them and resume."""
    hopperjax.train(tiny_config("train.stop_after=2", "train.checkpoint_every=1"), console=False)
    with pytest.raises(ConfigError, match="does not fit the checkpoints") as info:
        hopperjax.train(tiny_config("train.stop_after=4", "optim.clip_norm=null"), console=False)
    assert info.value.key == "optim.clip_norm"
    assert "optim.clip_norm (1.0 -> None)" in str(info.value)
    resumed = hopperjax.train(tiny_config("train.stop_after=4"), console=False)
    assert sorted(train_losses(resumed.history)) == [2, 3]
    assert int(resumed.state.step) == 4


def test_linear_lr_scaling_is_what_the_step_uses(tiny_config):
    base_lr, warmup = 1e-3, 2
    result = hopperjax.train(
        tiny_config(
            "train.stop_after=4",
            "train.batch_size=32",
            "optim.base_batch_size=8",
            f"optim.base_lr={base_lr}",
            f"optim.warmup_steps={warmup}",
            "optim.lr_scaling=linear",
            "train.eval_every=100",
        ),
        console=False,
    )
    lrs = {r["step"]: r["lr"] for r in result.history if "lr" in r}
    peak = base_lr * 32 / 8
    assert lrs[warmup] == pytest.approx(peak, rel=1e-6)  # first step after warmup
    assert lrs[0] == pytest.approx(peak / (warmup + 1), rel=1e-6)


def test_eval_reports_loss_and_accuracy(tiny_config, corpus_file):
    # The tests' own corpus: whether the loss falls between two evaluations should not hang on
    # the default corpus, the package's source, which every commit changes.
    config = tiny_config("data.source=text", f"data.path={corpus_file}")
    result = hopperjax.train(config, console=False)
    evals = [r for r in result.history if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[-1]["eval_loss"] < math.log(256)
    assert 0.0 < evals[-1]["eval_accuracy"] < 1.0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


def test_nan_loss_names_the_steps(tiny_config):
    with pytest.raises(FloatingPointError, match=r"loss is nan in steps \d+-\d+"):
        hopperjax.train(
            tiny_config(
                "optim.base_lr=1e30",
                "optim.clip_norm=null",
                "optim.warmup_steps=0",
                "train.log_every=5",
            ),
            console=False,
        )


def _state_parts(config):
    """Mesh, model, optimizer and schedule of ``config``, the batch sharding and a token spec."""
    mesh = hopperjax.build_mesh(config.mesh)
    model = hopperjax.build_model(config)
    tx, schedule = hopperjax.build_optimizer(config.optim, total_steps=20, global_batch_size=16)
    batch_sharding = hopperjax.parallel.logical_sharding(mesh, ("batch", "length"))
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=batch_sharding)
    return mesh, model, tx, schedule, batch_sharding, tokens


def test_the_state_init_is_traced_once_and_placed_by_its_shardings(tiny_config, monkeypatch):
    config = tiny_config()
    mesh, model, tx, _, _, tokens = _state_parts(config)
    traced = []  # one trace serves the init's shardings (eval_shape) and its arrays (jit)
    init_boxed = hopperjax.trainer.state._init_boxed
    monkeypatch.setattr(
        hopperjax.trainer.state, "_init_boxed", lambda *a: traced.append(1) or init_boxed(*a)
    )
    state, shardings = hopperjax.create_train_state(model, tx, mesh, seed=0, example_inputs=tokens)
    assert len(traced) == 1
    placed = zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
    assert all(array.sharding == sharding for array, sharding in placed)
    parts = hopperjax.build_components(config)  # a run's path: the init kept on its components
    jax.block_until_ready(parts.init_state())
    assert len(traced) == 2
    with pytest.raises(ValueError, match="pass the state's whole sharding tree"):
        hopperjax.create_train_state(
            model, tx, mesh, seed=0, example_inputs=tokens, shardings=shardings.params
        )


def test_step_compiles_once_and_makes_no_hidden_transfers(tiny_config):
    config = tiny_config()
    mesh, model, tx, schedule, batch_sharding, tokens = _state_parts(config)
    state, shardings = hopperjax.create_train_state(model, tx, mesh, seed=0, example_inputs=tokens)
    train_step, _ = hopperjax.jit_steps(
        model=model,
        tx=tx,
        schedule=schedule,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        workload=hopperjax.workloads.from_config(config),
    )
    batch = {
        k: jax.device_put(jnp.ones((16, 32), jnp.int32), batch_sharding)
        for k in ("inputs", "targets")
    }
    with hopperjax.sharding_context(mesh), jax.transfer_guard("disallow"):
        for _ in range(3):
            state, metrics = train_step(state, batch)
    assert train_step._cache_size() == 1
    assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))


def test_sigterm_checkpoints_and_stops(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hopperjax.train",
        "--config",
        "configs/quickstart.yaml",
        *TINY,
        "train.steps=100000",
        "train.checkpoint_every=100000",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while len(read_metrics(metrics)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM" in out
    last = max(r["step"] for r in read_metrics(metrics) if "loss" in r)
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [last + 1]


def test_profile_window_and_throughput_fields(tiny_config):
    result = hopperjax.train(
        tiny_config(
            "train.stop_after=6",
            "profile.start_step=2",
            "profile.num_steps=2",
            "train.eval_every=100",
        ),
        console=False,
    )
    records = [r for r in result.history if "loss" in r]
    assert all(r["mfu"] > 0 and r["tflops_per_device"] > 0 for r in records)
    # 8 devices share the step's model FLOPs: tflops_per_device x 8 x step time = model FLOPs.
    r = records[-1]
    config = tiny_config()
    model_flops = (
        3 * 16 * 32 * (2 * (2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 32 * 256) + 4 * 2 * 32 * 32)
    )
    assert r["tflops_per_device"] * 1e12 * 8 * r["step_time_s"] == pytest.approx(model_flops)
    assert config.model.n_layers == 2
    assert [r["step"] for r in records if r.get("profiled")] == [2, 3]
    summary = summarize_trace(result.run_dir / "profile")
    assert summary["top_ops"] and summary["window_ms"] > 0


def test_logged_norms_skips_eta_and_console_line_say_what_they_name(
    tiny_config, corpus_file, capsys
):
    """An fp16 run whose first steps overflow (the scale starts far too high), checked against
    its own checkpoints: param_norm is the norm of the parameters a step leaves, update_norm the
    norm of what it changed, skipped_total counts the skipped steps, the scale halves on each,
    eta_s is the steps left times the step time, and each console line shows its record."""
    config = tiny_config(
        "precision=fp16",
        # 2^22: the first steps overflow, until the halved scale fits. Which steps overflow
        # depends on the data: the tests' own corpus, not the package's sources (which every
        # commit changes).
        "data.source=text",
        f"data.path={corpus_file}",
        "loss_scale.init_scale=4194304",
        "train.stop_after=8",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=8",
    )
    result = hopperjax.train(config, console=True)
    out = capsys.readouterr().out
    records = [r for r in result.history if "loss" in r]
    assert [r["step"] for r in records] == list(range(8))
    skipped = [r["skipped"] for r in records]
    # Steps 0-3 overflow and halve the scale to 2^18, where step 4's gradients fit (later steps
    # may overflow again: [1, 1, 1, 1, 0, 0, 0, 1] when written).
    assert skipped[:5] == [1.0, 1.0, 1.0, 1.0, 0.0], skipped
    assert [r["skipped_total"] for r in records] == list(np.cumsum(skipped))
    for before, after in itertools.pairwise(records):
        factor = 0.5 if before["skipped"] else 1.0
        assert after["loss_scale"] == before["loss_scale"] * factor

    run_dir = result.run_dir
    params = {s: hopperjax.restore_params(run_dir, s).params for s in range(1, 9)}

    def norm(tree):
        return float(
            np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(tree)))
        )

    for r in records:
        after = params[r["step"] + 1]
        assert r["param_norm"] == pytest.approx(norm(after), rel=1e-5)
        if r["step"] > 0:
            change = jax.tree.map(np.subtract, after, params[r["step"]])
            if r["skipped"]:
                assert norm(change) == 0.0
            else:
                assert r["update_norm"] == pytest.approx(norm(change), rel=1e-3)
        assert r["eta_s"] == pytest.approx((8 - (r["step"] + 1)) * r["step_time_s"])

    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == len(records)
    for line, r in zip(lines, records, strict=True):
        assert line.split(" | ") == [
            f"step  {r['step'] + 1:>6d}/20",
            f"loss {r['loss']:.4f}",
            f"lr {r['lr']:.2e}",
            f"{r['step_time_s'] * 1e3:.1f} ms/step",
            f"{r['tokens_per_s']:,.0f} tokens/s",
            f"MFU {r['mfu']:.1%}",
            f"eta {datetime.timedelta(seconds=round(r['eta_s']))}",
        ]
