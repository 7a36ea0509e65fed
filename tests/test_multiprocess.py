"""Two JAX processes on loopback (gloo collectives, 4 CPU devices each) train as one job."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY
from testenv import xla_flags

import hopperjax
from hopperjax.checkpoint import CheckpointError
from hopperjax.observe import read_metrics

RESTART = "this process stopped too; restart every process to resume from the newest checkpoint"


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: between this check and the coordinator's
    bind, no outgoing connection can be handed the port (only another explicit bind could)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _start_two_processes(run_dir, overrides, *, cli=False) -> list[tuple[subprocess.Popen, Path]]:
    """Both processes, each writing to its own files (pipes read one after the other could stall
    a chatty second process). ``cli``: the real CLI (supervised), else the library worker."""
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env["XLA_FLAGS"] = xla_flags(4)
    # A compilation cache of this test's own, apart from the test run's: process 0 writes what
    # the job compiles, and the job started again on the run_dir reads it back.
    env["JAX_COMPILATION_CACHE_DIR"] = str(Path(run_dir).parent / "jit-cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    started = []
    for i in range(2):
        logs = Path(f"{run_dir}-process{i}")
        if cli:
            job = [
                f"run_dir={run_dir}",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                "distributed.num_processes=2",
                f"distributed.process_id={i}",
                "distributed.initialization_timeout_s=60",
            ]
            config = str(REPO / "configs" / "quickstart.yaml")
            command = [
                sys.executable,
                "-m",
                "hopperjax.train",
                "--config",
                config,
                *overrides,
                *job,
            ]
        else:
            worker = [sys.executable, str(REPO / "tests" / "two_process_worker.py"), str(i)]
            command = [*worker, str(port), str(run_dir), *overrides]
        proc = subprocess.Popen(
            command,
            stdout=logs.with_suffix(".out").open("w"),
            stderr=logs.with_suffix(".err").open("w"),
            text=True,
            env=env,
            cwd=REPO,
        )
        started.append((proc, logs))
    return started


def _run_two_processes(run_dir, overrides):
    started = _start_two_processes(run_dir, overrides)
    outputs = []
    try:
        deadline = time.monotonic() + 150
        for proc, logs in started:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            err = logs.with_suffix(".err").read_text()
            assert proc.returncode == 0, err[-3000:]
            out = logs.with_suffix(".out").read_text()
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        pytest.fail("a process hung; both were killed")
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
    return outputs


def test_two_processes_train_checkpoint_resume_and_match_one_process(tmp_path, tiny_config):
    """Mesh data=4 x tensor=2 over 2 processes x 4 devices, data split across the processes; the
    job stops at step 4, resumes to 6, and its losses are those of one uninterrupted process on 8
    devices: which also proves the processes read disjoint halves of each global batch (reading
    the same half, or the whole batch each, gives other losses). ``data.sampling=random`` makes
    the global batches independent of the process count (window i is the same window for any
    count), so the one-process run sees the same examples. The data-axis reduction is the int8
    compressed one: its all-to-all and all-gather cross the processes (gloo) and move the
    encoded bytes exactly, and its error-feedback residuals, sharded over both processes, are
    checkpointed and resumed. (XLA's plain all-reduce across processes trains in the SIGTERM
    test below.) Resuming the job's checkpoint with one process is refused in one line."""
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "train.eval_every=4",
        "train.checkpoint_every=2",
        "mesh.data=4",
        "mesh.tensor=2",
        "model.n_heads=2",
        "data.sampling=random",
        "comm.gradient_compression=int8",
    ]
    outputs = _run_two_processes(run_dir, [*overrides, "mesh.dcn_data=2", "train.stop_after=4"])
    assert [o["process"] for o in outputs] == [0, 1]
    assert all(o["devices"] == 8 and o["local_devices"] == 4 for o in outputs)
    assert outputs[0]["losses"] == outputs[1]["losses"]
    assert sorted(outputs[0]["losses"]) == ["0", "1", "2", "3"]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]
    data_states = sorted(p.name for p in (checkpoints / "4" / "data").glob("*.json"))
    assert data_states == ["process_0-of-2.json", "process_1-of-2.json"]
    # Only process 0 writes the logs: 4 train records, one eval at step 4.
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4 + 1

    # Both processes resume from step 4 with their own iterator positions, and still agree.
    resumed = _run_two_processes(run_dir, [*overrides, "mesh.dcn_data=2", "train.stop_after=6"])
    assert resumed[0]["losses"] == resumed[1]["losses"]
    assert sorted(resumed[0]["losses"]) == ["4", "5"]

    with pytest.raises(
        CheckpointError, match=re.escape("written by 2 process(es) and this run has 1")
    ):
        hopperjax.train(tiny_config(*overrides, f"run_dir={run_dir}"), console=False)

    reference = hopperjax.train(
        tiny_config(*overrides, f"run_dir={tmp_path / 'one'}", "train.stop_after=6"), console=False
    )
    expected = [r["loss"] for r in reference.history if "loss" in r]
    got = [{**outputs[0]["losses"], **resumed[0]["losses"]}[str(step)] for step in range(6)]
    # Cross-process sums (gloo) may add in another order than one process's: float32 rounding,
    # which the int8 encoding of the next step's gradients can carry a little further.
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    # The comparison has teeth: the six losses spread over far more than its tolerance (a model
    # that learned nothing, whose losses any batches would match, fails here). Not "six distinct
    # losses to N decimals": the corpus is the package's own source, and two neighbouring losses
    # of one commit fell together to 3 decimals, 5.28260 / 5.28268.
    assert np.ptp(expected) > 20 * 1e-4 * max(expected)


def _wait_for_records(run_dir, count, started, deadline):
    while len(read_metrics(run_dir / "metrics.jsonl")) < count:
        for proc, logs in started:
            assert proc.poll() is None, logs.with_suffix(".err").read_text()[-2000:]
        assert time.monotonic() < deadline, f"fewer than {count} records after the deadline"
        time.sleep(0.2)


def _stop_all(started):
    for proc, _ in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_to_one_process_stops_both_at_one_step_and_a_lost_peer_is_one_line(tmp_path):
    """The CLI of a preempted multi-process job, end to end: SIGTERM reaches one process's
    supervisor only; both processes agree on the stop step, checkpoint it and exit 0. The job
    resumes there; then one process is SIGKILLed (supervisor and its child): the survivor exits 3
    within the heartbeat timeout, with one line on what was lost instead of JAX's native abort and
    stack dump."""
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "train.steps=100000",
        "train.log_every=2",
        "train.eval_every=100000",
        "train.checkpoint_every=100000",
        "mesh.data=8",
        "distributed.heartbeat_timeout_s=5",
    ]
    started = _start_two_processes(run_dir, overrides, cli=True)
    try:
        _wait_for_records(run_dir, 2, started, time.monotonic() + 150)
        started[1][0].send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc, _ in started]
    finally:
        _stop_all(started)
    errs = [logs.with_suffix(".err").read_text() for _, logs in started]
    assert codes == [0, 0], errs
    stopped = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(stopped) == 1, stopped
    stop_step = int(stopped[0])
    data = sorted(p.name for p in (run_dir / "checkpoints" / stopped[0] / "data").glob("*.json"))
    assert data == ["process_0-of-2.json", "process_1-of-2.json"]
    # Process 0 writes the console; the signal went to process 1, so process 0 names a peer's.
    out0 = started[0][1].with_suffix(".out").read_text()
    assert f"a peer's signal: checkpointed step {stop_step} and stopped" in out0, out0[-1000:]

    resumed = _start_two_processes(run_dir, overrides, cli=True)
    (survivor, logs), (lost, _) = resumed
    try:
        records = len(read_metrics(run_dir / "metrics.jsonl"))
        _wait_for_records(run_dir, records + 2, resumed, time.monotonic() + 150)
        lost.kill()  # the supervisor; its training child dies with it (parent-death signal)
        killed = time.monotonic()
        code = survivor.wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        _stop_all(resumed)
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps)) and steps[0] == 1, steps  # resumed, not restarted
    assert any(s > stop_step for s in steps)
    err = logs.with_suffix(".err").read_text()
    assert code == 3 and waited < 5 + 20, (code, waited, err[-2000:])
    # On CPU hosts a gloo collective usually notices first (it cannot name the process); else
    # JAX's heartbeat check does, naming it.
    last = err.strip().splitlines()[-1]
    assert last.endswith(RESTART) and last.startswith(
        (
            "hopperjax: lost process 1 of the job (no heartbeat for "
            "distributed.heartbeat_timeout_s=5 s)",
            "hopperjax: a collective with the other processes failed (gloo: ",
        )
    ), err[-2000:]
    assert "Check failure stack trace" not in err and "terminate called" not in err, err[-2000:]
