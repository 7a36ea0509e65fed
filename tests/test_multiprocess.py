"""Two JAX processes on loopback (gloo collectives, 4 CPU devices each) train as one job."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO, TINY


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(run_dir, overrides):
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "two_process_worker.py"),
                str(i),
                str(port),
                str(run_dir),
                *overrides,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        pytest.fail("a process hung; both were killed")
    finally:
        for proc in procs:
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
