"""Faults a run directory must survive: nothing non-finite is checkpointed, damaged checkpoints
are found and passed over, failed saves are one line, a finished run is left alone, one process
per run directory, Ctrl-C checkpoints. (The long battery, with random kills, is
``tools/fault_battery.py``.)"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO, TINY

import hopperjax
from hopperjax import checkpoint as checkpoint_lib
from hopperjax import files
from hopperjax.checkpoint import MANIFEST, CheckpointError
from hopperjax.config import ConfigError
from hopperjax.observe import read_metrics
from hopperjax.observe.metrics import MetricsFileError

# One step count for the whole file: every train() below compiles the same step.
STEPS = ["train.steps=8", "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=100"]


def _config(tiny_config, *overrides):
    return tiny_config(*STEPS, *overrides)


def _with_lr(config, lr: float):
    """A config with a learning rate the loader would refuse (as a diverging run would get)."""
    return dataclasses.replace(config, optim=dataclasses.replace(config.optim, base_lr=lr))


def _steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _finite(run_dir: Path, step: int, abstract_state) -> bool:
    checkpointer = checkpoint_lib.Checkpointer(run_dir / "checkpoints", every=1, keep=10)
    try:
        state, _ = checkpointer.restore(step, abstract_state)
    finally:
        checkpointer.close()
    return all(
        np.isfinite(np.asarray(x)).all()
        for x in jax.tree.leaves(state)
        if np.issubdtype(np.asarray(x).dtype, np.inexact)
    )


def _losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result.history if "loss" in r}


@pytest.fixture(scope="module")
def stopped_template(tmp_path_factory) -> Path:
    """A run stopped at step 4 (checkpoints 2 and 4), trained once and copied by each test."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    config = hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml",
        [*TINY, *STEPS, "train.stop_after=4", f"run_dir={run_dir}"],
    )
    hopperjax.train(config, console=False)
    return run_dir


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> dict[int, float]:
    """The losses of the same run, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    config = hopperjax.load_config(
        REPO / "configs" / "quickstart.yaml", [*TINY, *STEPS, f"run_dir={run_dir}"]
    )
    return _losses(hopperjax.train(config, console=False))


def _stopped(tiny_config, template: Path):
    """This test's copy of the stopped run; its config (run_dir: the copy)."""
    config = _config(tiny_config, "train.stop_after=4")
    shutil.copytree(template, config.run_path)
    return config


def test_a_non_finite_state_is_never_checkpointed_and_the_error_names_the_last_good_one(
    tiny_config, stopped_template
):
    config = _stopped(tiny_config, stopped_template)
    run_dir = config.run_path
    # Saves every 2 steps, NaN checks of the loss only every 50: the state check at save time
    # is what stops it.
    bad = _with_lr(_config(tiny_config, "train.log_every=50"), float("nan"))
    with pytest.raises(FloatingPointError, match="the last good checkpoint is step 4") as info:
        hopperjax.train(bad, console=False)
    assert "step 6 holds NaN or Inf and was not checkpointed" in str(info.value)
    assert _steps(run_dir) == [2, 4]
    parts = hopperjax.build_components(config)
    assert _finite(run_dir, 4, parts.abstract_state)
    # The run is recoverable: a good learning rate goes on from step 4.
    resumed = hopperjax.train(_config(tiny_config), console=False)
    assert sorted(_losses(resumed)) == [4, 5, 6, 7] and int(resumed.state.step) == 8


def test_fp16_whose_every_update_is_skipped_stops_with_one_line(tiny_config):
    # No save before the end and a loss that is NaN from the first update on: the loss scale
    # halves every step until it is below 1.
    config = _with_lr(
        tiny_config(
            "precision=fp16",
            "train.steps=20",
            "train.log_every=20",
            "train.checkpoint_every=100",
            "train.eval_every=100",
        ),
        float("nan"),
    )
    with pytest.raises(FloatingPointError, match=r"the loss scale fell to .* by step 19") as info:
        hopperjax.train(config, console=False)
    assert "\n" not in str(info.value) and "there is no checkpoint yet" in str(info.value)


def _flip_bits(path: Path, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[(len(data) // 2 + 97 * i) % len(data)] ^= 1
    path.write_bytes(bytes(data))


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


DAMAGE = {
    "bit flips in the largest array file": lambda d: _flip_bits(_largest_file(d)),
    "truncated array file": lambda d: _largest_file(d).write_bytes(
        _largest_file(d).read_bytes()[:10]
    ),
    "orbax metadata deleted": lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
    "iterator state garbled": lambda d: next((d / "data").glob("*.json")).write_text("{garbled"),
    "manifest deleted (save never finished)": lambda d: (d / MANIFEST).unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_resumes(
    tiny_config, stopped_template, straight_losses, damage, capfd
):
    run_dir = _stopped(tiny_config, stopped_template).run_path
    DAMAGE[damage](run_dir / "checkpoints" / "4")
    resumed = hopperjax.train(_config(tiny_config), console=False)
    err = capfd.readouterr().err
    assert "checkpoint step 4 is damaged" in err and "resuming from step 2" in err
    assert (run_dir / "checkpoints.damaged" / "4").is_dir()
    # Back at step 2, the run continues exactly as the uninterrupted one.
    assert sorted(_losses(resumed)) == [2, 3, 4, 5, 6, 7]
    expected = straight_losses
    np.testing.assert_allclose(
        [_losses(resumed)[s] for s in range(2, 8)], [expected[s] for s in range(2, 8)], rtol=1e-6
    )


def test_no_checkpoint_that_verifies_is_one_line_and_moves_nothing(tiny_config, stopped_template):
    config = _stopped(tiny_config, stopped_template)
    run_dir = config.run_path
    for step in (2, 4):
        _flip_bits(_largest_file(run_dir / "checkpoints" / str(step)))
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies") as info:
        hopperjax.train(_config(tiny_config), console=False)
    assert "step 4:" in str(info.value) and "step 2:" in str(info.value)
    assert "\n" not in str(info.value)
    assert _steps(run_dir) == [2, 4] and not (run_dir / "checkpoints.damaged").exists()


def test_restore_params_passes_over_a_damaged_checkpoint(tiny_config, stopped_template, capfd):
    config = _stopped(tiny_config, stopped_template)
    _flip_bits(_largest_file(config.run_path / "checkpoints" / "4"))
    restored = hopperjax.restore_params(config.run_path)
    assert restored.step == 2
    assert "skipped checkpoint step 4" in capfd.readouterr().err


def test_restore_params_averages_checkpoints_and_refuses_what_it_cannot(
    tiny_config, stopped_template
):
    config = _stopped(tiny_config, stopped_template)
    two, four = (hopperjax.restore_params(config.run_path, s) for s in (2, 4))
    averaged = hopperjax.restore_params(config.run_path, average=2)
    assert (averaged.step, averaged.averaged, four.averaged) == (4, (2, 4), (4,))
    for a, x, y in zip(*(jax.tree.leaves(r.params) for r in (averaged, two, four)), strict=True):
        np.testing.assert_allclose(a, (np.asarray(x) + np.asarray(y)) / 2, rtol=1e-6, atol=1e-7)
    assert not np.allclose(*(jax.tree.leaves(r.params)[0] for r in (two, four)))
    with pytest.raises(ConfigError, match=r"--average: 2 checkpoints asked for, .* keeps 1"):
        hopperjax.restore_params(config.run_path, 2, average=2)
    with pytest.raises(ConfigError, match="--average: expected a positive"):
        hopperjax.restore_params(config.run_path, average=0)
    _flip_bits(_largest_file(config.run_path / "checkpoints" / "2"))
    with pytest.raises(ConfigError, match=r"--average: checkpoint step 2 of .*") as info:
        hopperjax.restore_params(config.run_path, average=2)
    assert "\n" not in str(info.value)


def test_a_full_disk_is_refused_before_writing_with_one_line(tiny_config, monkeypatch):
    config = _config(tiny_config, "train.stop_after=2")
    hopperjax.train(config, console=False)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", lambda _: usage(1 << 30, 0, 1000))
    with pytest.raises(CheckpointError) as info:
        hopperjax.train(_config(tiny_config), console=False)
    message = str(info.value)
    assert message.startswith(f"cannot write checkpoint step 4 to {config.run_path}")
    assert "MiB are free" in message and "\n" not in message
    assert _steps(config.run_path) == [2]
    assert not list((config.run_path / "checkpoints").glob("*tmp*"))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    return done.returncode == 0


def test_a_save_that_fails_in_the_background_is_one_line(tiny_config, tmp_path, monkeypatch):
    """A real ENOSPC on a small tmpfs (when this host lets us mount one); the up-front space
    check is told there is plenty, so the background write is what fails."""
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, "180k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage", lambda _: usage(1, 0, 1 << 40))
        with pytest.raises(CheckpointError, match="No space left on device") as info:
            hopperjax.train(_config(tiny_config, f"run_dir={mount / 'run'}"), console=False)
        assert "\n" not in str(info.value)
        assert not list((mount / "run" / "checkpoints").glob("*tmp*"))
        for step in _steps(mount / "run"):  # what was saved before the disk filled verifies
            assert checkpoint_lib.verify(mount / "run" / "checkpoints" / str(step)) is None
    finally:
        subprocess.run(["umount", str(mount)])


def test_a_torn_last_metrics_line_is_dropped_and_an_edited_one_is_named(
    tiny_config, stopped_template, capfd
):
    config = _stopped(tiny_config, stopped_template)
    metrics = config.run_path / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 4, "loss": 1.2')  # a crash mid-append
    resumed = hopperjax.train(_config(tiny_config), console=False)
    assert int(resumed.state.step) == 8
    assert "was cut off mid-record (dropped)" in capfd.readouterr().err
    assert [r["step"] for r in read_metrics(metrics) if "loss" in r] == list(range(8))

    lines = metrics.read_text().splitlines()
    lines[1] = "not json"
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(MetricsFileError, match=f"{metrics} line 2 is not a JSON record"):
        read_metrics(metrics)


def test_a_finished_run_is_left_alone(tiny_config):
    config = _config(tiny_config)
    first = hopperjax.train(config, console=False)
    saved = (config.run_path / "config.yaml").read_text()
    metrics = (config.run_path / "metrics.jsonl").read_text()
    again = hopperjax.train(_config(tiny_config, "optim.base_lr=0.5"), console=False)
    assert again.history == first.history and again.compile_s == 0.0
    assert (config.run_path / "config.yaml").read_text() == saved
    assert (config.run_path / "metrics.jsonl").read_text() == metrics
    stopped = _config(tiny_config, "train.stop_after=8", "train.steps=12")
    # stop_after reached: says so rather than training on
    assert hopperjax.train(stopped, console=False).history == first.history


def test_a_second_process_on_the_run_dir_is_refused_naming_the_holder(tiny_config):
    config = _config(tiny_config)
    with files.exclusive(config.run_path), pytest.raises(ConfigError) as info:
        hopperjax.train(config, console=False)
    assert info.value.key == "run_dir"
    assert f"in use by process {os.getpid()}" in str(info.value)
    # Released: the run goes ahead.
    assert int(hopperjax.train(config, console=False).state.step) == 8


def test_a_run_dir_that_cannot_be_written_is_one_line(tiny_config, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write to") as info:
        hopperjax.train(_config(tiny_config, f"run_dir={blocker / 'run'}"), console=False)
    assert info.value.key == "run_dir"


def _start_cli(run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hopperjax.train", "--config", "configs/quickstart.yaml"]
    cmd += [*TINY, "train.steps=100000", "train.checkpoint_every=100000", f"run_dir={run_dir}"]
    # Output to files, not pipes: a chatty child can never block on a full pipe.
    out = (run_dir.parent / "out.txt").open("w")
    err = (run_dir.parent / "err.txt").open("w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True)


def _wait_for_records(run_dir: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while len(read_metrics(run_dir / "metrics.jsonl")) < count:
        assert proc.poll() is None, (run_dir.parent / "err.txt").read_text()
        assert time.monotonic() < deadline, "no records after 180 s"
        time.sleep(0.2)


def test_ctrl_c_checkpoints_and_stops_and_a_second_one_aborts(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start_cli(run_dir)
    _wait_for_records(run_dir, 3, proc)  # the loop (and its handler) is running
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, (tmp_path / "err.txt").read_text()
    out = (tmp_path / "out.txt").read_text()
    assert "SIGINT: checkpointed step" in out
    last = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r)
    assert _steps(run_dir) == [last + 1]
    manifest = json.loads((run_dir / "checkpoints" / str(last + 1) / MANIFEST).read_text())
    assert manifest["files"]

    # Twice: the first asks for a checkpoint, the second aborts at once, in one line.
    proc = _start_cli(run_dir)
    _wait_for_records(run_dir, len(read_metrics(run_dir / "metrics.jsonl")) + 2, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    out = (tmp_path / "out.txt").read_text()
    assert code in (0, 130), (tmp_path / "err.txt").read_text()
    if code == 130:
        assert "aborted" in out
    assert "Traceback" not in (tmp_path / "err.txt").read_text()


def test_an_iterator_position_past_the_data_consumed_is_refused(tiny_config, stopped_template):
    config = _stopped(tiny_config, stopped_template)
    step_dir = config.run_path / "checkpoints" / "4"
    (state_file,) = (step_dir / "data").glob("*.json")
    assert json.loads(state_file.read_text()) == {"next_index": 4}
    state_file.write_text(json.dumps({"next_index": 10**9}))
    checkpoint_lib.write_manifest(step_dir)  # edited by hand, manifest and all
    with pytest.raises(CheckpointError, match="the data iterator is at batch 1000000000"):
        hopperjax.train(_config(tiny_config), console=False)


def test_only_the_newest_keep_checkpoints_are_kept_and_all_verify(tiny_config):
    config = _config(tiny_config, "train.keep_checkpoints=2")
    hopperjax.train(config, console=False)
    assert _steps(config.run_path) == [6, 8]
    for step in (6, 8):
        assert checkpoint_lib.verify(config.run_path / "checkpoints" / str(step)) is None


def test_a_changed_optimizer_is_refused_by_name_on_resume(tiny_config, stopped_template):
    _stopped(tiny_config, stopped_template)
    with pytest.raises(ConfigError, match="changed from 'adamw' to 'sgd'") as info:
        hopperjax.train(_config(tiny_config, "optim.name=sgd"), console=False)
    assert info.value.key == "optim.name"


def test_a_committed_save_is_hashed_before_the_next_save_starts(tmp_path):
    """The manifest is written in orbax's finalizing thread, right after the commit: a SIGKILL
    that lands while the next (slow) save runs can cost at most that newest checkpoint, never an
    older one too (the battery found two unhashed checkpoints, hence no resumable one)."""
    checkpointer = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", every=1, keep=5)
    state = {"w": jax.numpy.arange(1024.0)}
    try:
        checkpointer.save(1, state, {"next_index": 1})
        # orbax's own wait, not ours: our bookkeeping (poll, _finish) does not run.
        checkpointer._manager.wait_until_finished()
        assert checkpoint_lib.verify(tmp_path / "checkpoints" / "1") is None
    finally:
        checkpointer.close()
    # Then the files orbax rewrote at the commit are added to it.
    listed = json.loads((tmp_path / "checkpoints" / "1" / MANIFEST).read_text())["files"]
    assert "_CHECKPOINT_METADATA" in listed and "state/_METADATA" in listed
    assert checkpoint_lib.verify(tmp_path / "checkpoints" / "1") is None


def test_a_signal_before_the_first_step_still_checkpoints_and_stops(tmp_path):
    """SIGTERM while the run restores and compiles (config.yaml is written first, the metrics
    file after the compile): the handler is already installed, so the run takes one step,
    checkpoints it and exits 0, rather than dying of the signal."""
    run_dir = tmp_path / "run"
    proc = _start_cli(run_dir)
    deadline = time.monotonic() + 180
    while not (run_dir / "config.yaml").is_file():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    before_first_step = not (run_dir / "metrics.jsonl").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, (tmp_path / "err.txt").read_text()
    assert "SIGTERM: checkpointed step" in (tmp_path / "out.txt").read_text()
    steps = _steps(run_dir)
    assert len(steps) == 1 and (steps == [1] or not before_first_step), steps
