"""The batching server: requests merged into padded buckets with each request's own rows back,
a bounded queue, one-line 400s for malformed requests, over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from infer_helpers import restored_from_init

from hopperjax.infer import artifact
from hopperjax.infer.export import export_restored
from hopperjax.infer.serve import Batcher, QueueFull, buckets_up_to

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def lm_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    restored, batches = restored_from_init("lm", root / "run")
    export_restored(restored, root / "artifact")
    return root / "artifact", batches[0]


def _rows(batch, start, n):
    return {k: v[start : start + n] for k, v in batch.items()}


def test_batcher_merges_requests_into_buckets_and_returns_each_its_rows(lm_artifact):
    directory, batch = lm_artifact
    model = artifact.load(directory)
    expected = np.asarray(model(batch))
    sizes = [1, 3, 2, 1, 4, 2]
    starts = np.cumsum([0, *sizes[:-1]])

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_wait_ms=200, max_queue=16)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit(_rows(batch, s, n))
                                      for s, n in zip(starts, sizes, strict=True)))  # fmt: skip
        metrics = batcher.metrics()
        await batcher.stop()
        return outs, metrics, list(batcher.batch_sizes)

    outs, metrics, padded = asyncio.run(scenario())
    for out, s, n in zip(outs, starts, sizes, strict=True):
        np.testing.assert_allclose(out, expected[s : s + n], rtol=1e-5, atol=1e-5)
    assert metrics["requests"] == 6 and metrics["examples"] == 13
    assert metrics["batches"] < 6  # merged
    assert all(size in buckets_up_to(8) for size in padded)
    assert buckets_up_to(8) == (1, 2, 4, 8) and buckets_up_to(6) == (1, 2, 4, 6)


def test_batcher_bounds_its_queue_and_runs_dependent_rows_alone(lm_artifact):
    directory, batch = lm_artifact
    model = artifact.load(directory)

    async def full():
        batcher = Batcher(model, max_batch=4, max_wait_ms=0, max_queue=1)
        batcher.queue = asyncio.Queue(maxsize=1)  # no worker: the queue fills
        first = asyncio.ensure_future(batcher.submit(_rows(batch, 0, 1)))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.submit(_rows(batch, 1, 1))
        with pytest.raises(ValueError, match="1 to 4 examples"):
            await batcher.submit(_rows(batch, 0, 5))
        first.cancel()
        return batcher.counts["rejected"]

    assert asyncio.run(full()) == 1
    model.metadata["independent_rows"] = False

    async def alone():
        batcher = Batcher(model, max_batch=8, max_wait_ms=200)
        batcher.start()
        await asyncio.gather(*(batcher.submit(_rows(batch, i, 1)) for i in range(3)))
        await batcher.stop()
        return batcher.counts["batches"]

    assert asyncio.run(alone()) == 3


def _serve_bench():
    """tools/serve_bench.py (its start_server starts the servers these tests talk to)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "tools" / "serve_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _post(url, body):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_server_batches_concurrent_requests_and_refuses_bad_ones(lm_artifact):
    directory, batch = lm_artifact
    expected = np.asarray(artifact.load(directory)(batch))
    server, base = _serve_bench().start_server(str(directory), 8, 50.0)
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            health = json.loads(r.read())
        assert health["workload"] == "lm" and health["max_batch"] == 8
        results = {}

        def ask(i):
            body = json.dumps({"inputs": {k: v.tolist() for k, v in _rows(batch, i, 1).items()}})
            results[i] = _post(f"{base}/predict", body.encode())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (status, body) in results.items():
            assert status == 200
            np.testing.assert_allclose(body["outputs"], expected[i : i + 1], rtol=1e-4, atol=1e-4)
        assert _post(f"{base}/predict", b"{not json")[0] == 400
        assert _post(f"{base}/predict", b'{"x": 1}')[0] == 400
        floats = {k: (v[:1] + 0.5).tolist() for k, v in batch.items()}
        status, body = _post(f"{base}/predict", json.dumps({"inputs": floats}).encode())
        assert status == 400 and "expected int32" in body["error"]
        status, body = _post(f"{base}/predict", json.dumps({"inputs": {}}).encode())
        assert status == 400 and "missing field" in body["error"]
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            metrics = json.loads(r.read())
        assert metrics["requests"] == 8 and metrics["batches"] < 8
        assert metrics["latency_ms_p99"] >= metrics["latency_ms_p50"] > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert subprocess.run(
        [sys.executable, "-m", "hopperjax.serve", "--artifact", str(directory / "nope")],
        capture_output=True, text=True,
    ).returncode == 2  # fmt: skip


def test_serve_bench_reports_throughput_and_latency_against_servers_it_starts(
    lm_artifact, tmp_path, capsys
):
    bench = _serve_bench()
    directory, _ = lm_artifact
    out = tmp_path / "rows.json"
    argv = ["--artifact", str(directory), "--max-batch", "1,4", "--concurrency", "1,4",
            "--requests", "12", "--seconds", "60", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["max_batch"], r["concurrency"]) for r in rows] == [(1, 1), (1, 4), (4, 1), (4, 4)]
    assert all(r["answered"] == 12 and r["errors"] == 0 and r["p99_ms"] >= r["p50_ms"] > 0
               for r in rows)  # fmt: skip
    assert rows[0]["requests_per_batch"] == 1.0  # one client, batch 1: nothing to merge
    assert "| requests/s |" in capsys.readouterr().out
    assert bench.main(["--artifact", str(tmp_path / "none")]) == 2


class _Doubler:
    """A stand-in artifact: doubles ``x``; its first call fails."""

    def __init__(self):
        self.inputs = {"x": {"shape": ["batch", 2], "dtype": "float32"}}
        self.metadata = {}
        self.calls = 0

    def check(self, batch):
        return {"x": np.asarray(batch["x"], np.float32)}

    def __call__(self, batch):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("device lost")
        return batch["x"] * 2


def test_batcher_takes_every_queued_request_and_survives_a_failed_batch():
    """40 requests queued at once with max batch 32 and no waiting run as 32 + 8 (not one by
    one); a batch whose model call fails answers its requests with the error and the worker
    goes on."""
    from hopperjax.infer.serve import _encode

    async def scenario():
        model = _Doubler()
        batcher = Batcher(model, max_batch=32, max_wait_ms=0, max_queue=64)
        batcher.start()
        with pytest.raises(RuntimeError, match="device lost"):
            await batcher.submit({"x": [[1.0, 2.0]]})
        outs = await asyncio.gather(*(batcher.submit({"x": [[i, -i]]}) for i in range(40)))
        await batcher.stop()
        return outs, list(batcher.batch_sizes)

    outs, sizes = asyncio.run(scenario())
    assert [o.tolist() for o in outs] == [[[2.0 * i, -2.0 * i]] for i in range(40)]
    assert sizes == [32, 8]
    assert json.loads(_encode({"y": np.array([1.0, np.nan, np.inf])})) == {
        "outputs": {"y": [1.0, None, None]}
    }
