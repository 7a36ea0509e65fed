"""tools/mig_launch.py on a CPU: MIG devices read from a recorded ``nvidia-smi -L``, one real
server per slice pinned by CUDA_VISIBLE_DEVICES, a crashed server restarted, the aggregate
table; MIG off falls back to one server."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO
from infer_helpers import restored_from_init

from hopperjax.infer.export import export_restored

pytest.importorskip("starlette")

RECORDED = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c89b0a2-1f2e-4c8e-9a51-0d5e2f7c1a11)
  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45eb3b2a2f5a)
  MIG 2g.20gb     Device  1: (UUID: MIG-0e7a2b1c-9d3f-5e6a-8b4c-1a2b3c4d5e6f)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-77aa0b11-2c3d-4e5f-8a9b-0c1d2e3f4a5b)
"""


def _tool():
    sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location("mig_launch", REPO / "tools" / "mig_launch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mig_launch"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_nvidia_smi_listing_gives_each_mig_device_with_its_gpu_and_profile():
    gpus, devices = _tool().parse_nvidia_smi(RECORDED)
    assert len(gpus) == 2
    assert [(d.gpu, d.profile, d.index, d.uuid[:12]) for d in devices] == [
        (0, "3g.40gb", 0, "MIG-c6d4f1ef"),
        (0, "2g.20gb", 1, "MIG-0e7a2b1c"),
    ]


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mig")
    restored, _ = restored_from_init("lm", root / "run")
    export_restored(restored, root / "artifact")
    return root / "artifact"


def test_one_supervised_server_per_slice_and_the_aggregate_table(
    artifact_dir, tmp_path, capsys, monkeypatch
):
    # Five servers start on one artifact: what the first compiles, the rest read from a
    # compilation cache of this test's own (which by default skips programs compiled in under a
    # second; kept apart from the test run's, whose readers would otherwise race the servers'
    # writes of those tiny programs).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jit-cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    mig = _tool()
    saved = tmp_path / "smi.txt"
    saved.write_text(RECORDED)
    out = tmp_path / "rows.json"
    argv = ["--artifact", str(artifact_dir), "--nvidia-smi-output", str(saved), "--requests",
            "10", "--concurrency", "2", "--max-batch", "2", "--base-port",
            str(mig.serve_bench._free_port()), "--json", str(out)]  # fmt: skip
    assert mig.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["device"][:12] for r in rows] == ["MIG-c6d4f1ef", "MIG-0e7a2b1c"]
    assert all(r["answered"] == 10 and r["alive"] and r["restarts"] == 0 for r in rows)
    text = capsys.readouterr().out
    assert "MIG on: 2 devices" in text and "**all 2**" in text

    # A server that dies is restarted on its port, with its slice's CUDA_VISIBLE_DEVICES.
    args = mig.argparse.Namespace(max_batch=2, max_wait_ms=1.0, restarts=1)
    port = mig.serve_bench._free_port()
    one = mig.Slice("slice", "MIG-x", str(artifact_dir), port, args)
    try:
        one.server.kill()
        one.server.wait()
        assert one.ensure() and one.restarts == 1
        assert mig.serve_bench._get(f"{one.base}/health")["workload"] == "lm"
        one.server.kill()
        one.server.wait()
        assert not one.ensure()  # out of restarts
    finally:
        one.stop()

    saved.write_text(RECORDED.splitlines()[0] + "\n")  # MIG off
    off = [*argv[:2], "--nvidia-smi-output", str(saved), "--requests", "4", "--concurrency", "1",
           "--base-port", str(mig.serve_bench._free_port())]  # fmt: skip
    assert mig.main(off) == 0
    assert "MIG off" in capsys.readouterr().out
    assert mig.main(["--artifact", str(tmp_path / "none")]) == 2
