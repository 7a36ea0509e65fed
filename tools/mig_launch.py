"""Several models on MIG slices: one ``hopperjax.serve`` per MIG device, supervised, measured.

    python tools/mig_launch.py --artifact DIR [--artifact DIR2 ...] [--base-port 8100]
        [--max-batch 8] [--restarts 2] [--requests 200] [--concurrency 8] [--seconds 60]
        [--nvidia-smi-output FILE] [--json OUT]

Reads the MIG devices from ``nvidia-smi -L`` (or from ``--nvidia-smi-output``, a saved copy of
its output), starts one server per MIG device pinned with ``CUDA_VISIBLE_DEVICES=MIG-<uuid>``
on its own port (``--base-port`` + i), the artifacts assigned to the slices in turn, waits for
each to answer, then drives all of them at once (``tools/serve_bench.py``'s load: each slice
``--concurrency`` clients, ``--requests`` requests) and prints a table per slice with the total
throughput. A server that exits is restarted up to ``--restarts`` times, and said. With no MIG
device (MIG mode off), it says so and serves one model on the whole GPU instead. It never
changes the GPU's settings (MIG mode, instances): it only reads them. Servers stop at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_bench

GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[\w-]+)\)")
MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[\w-]+)\)")


@dataclasses.dataclass(frozen=True)
class MigDevice:
    gpu: int
    gpu_name: str
    profile: str  # e.g. 1g.10gb
    index: int
    uuid: str


def parse_nvidia_smi(text: str) -> tuple[list[str], list[MigDevice]]:
    """(the GPUs' lines, their MIG devices) from ``nvidia-smi -L`` output."""
    gpus, devices, current = [], [], None
    for line in text.splitlines():
        if m := GPU_LINE.match(line):
            current = (int(m.group(1)), m.group(2))
            gpus.append(line.strip())
        elif (m := MIG_LINE.match(line)) and current is not None:
            devices.append(MigDevice(current[0], current[1], m.group(1), int(m.group(2)),
                                     m.group(3)))  # fmt: skip
    return gpus, devices


def read_devices(saved: str | None) -> tuple[list[str], list[MigDevice]]:
    if saved:
        return parse_nvidia_smi(Path(saved).read_text())
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    return parse_nvidia_smi(out.stdout)


class Slice:
    """One server pinned to one device; ``ensure`` restarts it if it has exited."""

    def __init__(self, name: str, visible: str | None, artifact: str, port: int, args):
        self.name, self.visible, self.artifact, self.port = name, visible, artifact, port
        self.args = args
        self.restarts = 0
        self.server, self.base = self._start()

    def _start(self):
        env = dict(os.environ)
        if self.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible
        return serve_bench.start_server(self.artifact, self.args.max_batch, self.args.max_wait_ms,
                                        port=self.port, env=env)  # fmt: skip

    def ensure(self) -> bool:
        """True if the server runs (restarted if it had exited and restarts remain)."""
        if self.server.poll() is None:
            return True
        if self.restarts >= self.args.restarts:
            return False
        self.restarts += 1
        print(f"mig_launch: {self.name}: the server exited (code {self.server.returncode}); "
              f"restart {self.restarts}/{self.args.restarts}", flush=True)  # fmt: skip
        self.server, self.base = self._start()
        return True

    def stop(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", action="append", required=True)
    parser.add_argument("--base-port", type=int, default=8100)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--nvidia-smi-output", help="a saved `nvidia-smi -L` output to use")
    parser.add_argument("--json", help="write the per-slice rows here")
    args = parser.parse_args(argv)
    for directory in args.artifact:
        if not (Path(directory) / "metadata.json").is_file():
            print(f"mig_launch: --artifact {directory}: no metadata.json", file=sys.stderr)
            return 2
    try:
        gpus, devices = read_devices(args.nvidia_smi_output)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"mig_launch: cannot read the devices (nvidia-smi -L): {e}", file=sys.stderr)
        return 2
    for line in gpus:
        print(f"mig_launch: {line}")
    if devices:
        print(f"mig_launch: MIG on: {len(devices)} devices "
              f"({', '.join(sorted({d.profile for d in devices}))})")  # fmt: skip
        targets = [(f"GPU {d.gpu} MIG {d.profile} #{d.index}", d.uuid) for d in devices]
    else:
        print("mig_launch: MIG off (no MIG device listed): one server on the whole GPU")
        targets = [("whole GPU", None)]
    slices: list[Slice] = []
    try:
        for i, (name, visible) in enumerate(targets):
            artifact = args.artifact[i % len(args.artifact)]
            slices.append(Slice(name, visible, artifact, args.base_port + i, args))
            print(f"mig_launch: {name}: {artifact} on port {args.base_port + i}", flush=True)
        results: dict[str, dict] = {}

        def drive(s: Slice) -> None:
            body = serve_bench.request_body(s.base, args.rows)
            serve_bench.load(s.base, body, args.max_batch, 2 * args.max_batch, args.seconds)
            results[s.name] = serve_bench.load(s.base, body, args.concurrency, args.requests,
                                               args.seconds)  # fmt: skip

        threads = [threading.Thread(target=drive, args=(s,)) for s in slices]
        for t in threads:
            t.start()
        # Supervise while the load runs: a server that exits is restarted on its port.
        while any(t.is_alive() for t in threads):
            for s in slices:
                s.ensure()
            threads[0].join(timeout=0.5)
        for t in threads:
            t.join()
        alive = [s.ensure() for s in slices]
    finally:
        for s in slices:
            s.stop()
    rows = [
        {"slice": s.name, "device": s.visible or "all", "artifact": s.artifact, "port": s.port,
         "restarts": s.restarts, "alive": ok, **results.get(s.name, {})}
        for s, ok in zip(slices, alive, strict=True)
    ]  # fmt: skip
    lines = [
        "| slice | CUDA_VISIBLE_DEVICES | artifact | requests/s | p50 ms | p99 ms | restarts |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['slice']} | {r['device']} | {r['artifact']} | "
            f"{r.get('requests_per_s', 0):.1f} | {r.get('p50_ms') or 0:.1f} | "
            f"{r.get('p99_ms') or 0:.1f} | {r['restarts']} |"
        )
    total = sum(r.get("requests_per_s", 0) for r in rows)
    lines.append(f"| **all {len(rows)}** | | | **{total:.1f}** | | | |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(alive) else 1


if __name__ == "__main__":
    sys.exit(main())
