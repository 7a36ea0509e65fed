"""Load generator for ``python -m hopperjax.serve``: throughput and latency against concurrency,
the server's batch size, and the artifact (float vs INT8), on loopback.

    python tools/serve_bench.py --artifact DIR [--artifact DIR2 ...] [--max-batch 1,8,32]
        [--concurrency 1,4,16] [--requests 200] [--seconds 30] [--rows 1] [--json OUT]

For each artifact and ``--max-batch``, starts a server on a free loopback port, then for each
concurrency level runs that many client threads, each sending requests of ``--rows`` examples
(zeros of the artifact's input signature) back to back, until ``--requests`` have been answered
or ``--seconds`` have passed (a bounded run either way). Reports requests/s, examples/s, p50 and
p99 latency as the clients saw them, and how many requests the server merged per batch
(``/metrics``). Prints a table (and writes the rows as JSON).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(
    artifact: str,
    max_batch: int,
    max_wait_ms: float,
    *,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """A server on ``port`` (default: a free one) with environment ``env`` (default: ours), once
    its /health answers (raises RuntimeError if it exits)."""
    port = port or _free_port()
    # A file, not a pipe: a chatty server never blocks on it (Popen keeps its own handle).
    log = Path(tempfile.mkdtemp(prefix="serve_bench_")) / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "hopperjax.serve", "--artifact", artifact, "--port",
             str(port), "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            _get(f"{base}/health", timeout=1)
            return server, base
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()}") from None
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the server did not answer /health within 120 s")


def request_body(base: str, rows: int) -> bytes:
    """Zeros of the served artifact's input signature, ``rows`` examples."""
    inputs = _get(f"{base}/health")["inputs"]
    batch = {
        name: np.zeros([rows if n == "batch" else n for n in spec["shape"]], spec["dtype"]).tolist()
        for name, spec in inputs.items()
    }
    return json.dumps({"inputs": batch}).encode()


def load(base: str, body: bytes, concurrency: int, requests: int, seconds: float) -> dict:
    """``concurrency`` clients sending ``body`` until ``requests`` answers or ``seconds``."""
    latencies: list[float] = []
    errors, sent = [0], [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < stop:
            with lock:
                if sent[0] >= requests:
                    return
                sent[0] += 1
            start = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            request = urllib.request.Request(f"{base}/predict", data=body, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                ok = True
            except (urllib.error.URLError, OSError):
                ok = False
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors[0] += 1

    before = _get(f"{base}/metrics")
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    after = _get(f"{base}/metrics")
    batches = after["batches"] - before["batches"]
    lat = np.array(latencies) * 1e3
    return {
        "answered": len(latencies),
        "errors": errors[0],
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "requests_per_batch": (after["requests"] - before["requests"]) / batches if batches else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", action="append", required=True)
    parser.add_argument("--max-batch", default="1,8,32")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rows", type=int, default=1, help="examples per request")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        max_batches = [int(x) for x in args.max_batch.split(",")]
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError as e:
        print(f"serve_bench: --max-batch / --concurrency: {e}", file=sys.stderr)
        return 2
    for directory in args.artifact:
        if not (Path(directory) / "metadata.json").is_file():
            print(f"serve_bench: --artifact {directory}: no metadata.json", file=sys.stderr)
            return 2
    rows = []
    for directory in args.artifact:
        quantize = json.loads((Path(directory) / "metadata.json").read_text())["quantize"]
        for max_batch in max_batches:
            server, base = start_server(directory, max_batch, args.max_wait_ms)
            try:
                body = request_body(base, args.rows)
                load(base, body, max_batch, 2 * max_batch, args.seconds)  # warm the clients up
                for concurrency in levels:
                    r = load(base, body, concurrency, args.requests, args.seconds)
                    setting = {"artifact": directory, "quantize": quantize,
                               "max_batch": max_batch, "concurrency": concurrency}  # fmt: skip
                    rows.append({**setting, **r})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                server.terminate()
                server.wait(timeout=30)
    lines = [
        "| artifact | INT8 | max batch | clients | requests/s | examples/s | p50 ms | p99 ms | "
        "requests per batch | answered |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"  # none answered

    for r in rows:
        lines.append(
            f"| {r['artifact']} | {r['quantize']} | {r['max_batch']} | {r['concurrency']} | "
            f"{r['requests_per_s']:.1f} | {r['requests_per_s'] * args.rows:.1f} | "
            f"{ms(r['p50_ms'])} | {ms(r['p99_ms'])} | {r['requests_per_batch']:.2f} | "
            f"{r['answered']} ({r['errors']} failed) |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
