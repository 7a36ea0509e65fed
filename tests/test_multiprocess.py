"""Two JAX processes on loopback (gloo collectives, 4 CPU devices each) train as one job."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY

from hopperjax.observe import read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_processes(run_dir, overrides) -> list[tuple[subprocess.Popen, Path]]:
    """Both workers, each writing to its own files (pipes read one after the other could stall
    a chatty second process)."""
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    started = []
    for i in range(2):
        logs = Path(f"{run_dir}-process{i}")
        command = [sys.executable, str(REPO / "tests" / "two_process_worker.py"), str(i)]
        proc = subprocess.Popen(
            [*command, str(port), str(run_dir), *overrides],
            stdout=logs.with_suffix(".out").open("w"),
            stderr=logs.with_suffix(".err").open("w"),
            text=True,
            env=env,
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


def test_two_processes_train_checkpoint_resume_and_agree(tmp_path):
    """Mesh data=4 x tensor=2 over 2 processes x 4 devices, data split across the processes."""
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "train.eval_every=4",
        "train.checkpoint_every=2",
        "mesh.data=4",
        "mesh.tensor=2",
        "mesh.dcn_data=2",
        "model.n_heads=2",
    ]
    outputs = _run_two_processes(run_dir, [*overrides, "train.steps=6", "train.stop_after=4"])
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
    resumed = _run_two_processes(run_dir, [*overrides, "train.steps=6"])
    assert resumed[0]["losses"] == resumed[1]["losses"]
    assert sorted(resumed[0]["losses"]) == ["4", "5"]


def test_a_lost_peer_stops_the_survivor_within_the_heartbeat_timeout(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "train.steps=100000",
        "train.checkpoint_every=100000",
        "mesh.data=8",
        "distributed.heartbeat_timeout_s=5",
    ]
    started = _start_two_processes(run_dir, overrides)
    (survivor, logs), (lost, _) = started
    try:
        deadline = time.monotonic() + 150
        while len(read_metrics(run_dir / "metrics.jsonl")) < 3:
            assert survivor.poll() is None, logs.with_suffix(".err").read_text()[-2000:]
            assert time.monotonic() < deadline, "no records after 150 s"
            time.sleep(0.2)
        lost.kill()
        killed = time.monotonic()
        code = survivor.wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
    assert code != 0 and waited < 5 + 20, (code, waited)
    # JAX's coordination service names the lost process (in its own fatal log line).
    err = logs.with_suffix(".err").read_text()
    assert "stopped sending heartbeats" in err, err[-2000:]
