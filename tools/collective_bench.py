"""Time the collectives a training step uses, over a size sweep, as nccl-tests reports them.

    python tools/collective_bench.py                       # every device, 1 KiB .. 1 GiB
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/collective_bench.py \\
        --max-size 64MiB                                   # the plumbing, on CPU fake devices

Several devices: all-reduce, all-gather, reduce-scatter, all-to-all and ppermute (each device
sends its buffer to the next, a ring shift) over one axis of every device, under ``shard_map``.
``size`` is nccl-tests' size: the buffer each device holds for all-reduce and all-to-all, the
gathered result for all-gather, the input for reduce-scatter, the sent buffer for ppermute.
Each size is compiled, run ``--warmup`` times, then timed ``--repeats`` times (median).
algbw = size / time; busbw = algbw x nccl-tests' factor (all-reduce 2 (n-1)/n; all-gather,
reduce-scatter, all-to-all (n-1)/n; ppermute 1): what each device's links carried per second,
comparable with the link's bandwidth whatever n.

One device: there is nothing to exchange, so it measures what bounds a device's data movement
instead: device-memory copy (read + write: busbw counts both), host -> device and device -> host
(to and from pinned host memory where the backend offers it, else pageable NumPy arrays).

The largest size is bounded by ``--max-size`` and by device memory (three buffers of the size
must fit in a quarter of it). Writes ``runs/collective_bench/collective_bench.csv``, a PNG of
busbw against size (when matplotlib imports), and prints a table (or ``--json``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "devices"
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ppermute")
ONE_DEVICE_OPS = ("device-copy", "host-to-device", "device-to-host")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``64MiB``, ``1g``, ``4096`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1KiB, 64MiB, 1GiB)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` over ``n`` devices."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if op == "device-copy":
        return 2.0  # read and write
    return 1.0


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    devices: int
    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    device_kind: str


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _time(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective(op: str, mesh: Mesh, size: int) -> tuple[Callable[[], object], int]:
    """A compiled collective over ``mesh`` moving nccl-tests' ``size`` bytes, and that size as
    realized (rounded to whole fp32 elements per device)."""
    n = mesh.size
    # Elements per device of the input buffer.
    per_device = {"all-gather": size // 4 // n, "reduce-scatter": size // 4}.get(op, size // 4)
    per_device = max(n, per_device // n * n)  # divisible by n for the scatters and all-to-all
    bodies = {
        "all-reduce": lambda x: jax.lax.psum(x, AXIS),
        "all-gather": lambda x: jax.lax.all_gather(x, AXIS, tiled=True),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, AXIS, tiled=True),
        "all-to-all": lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True),
        "ppermute": lambda x: jax.lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)]),
    }
    spec = PartitionSpec(AXIS)
    out_spec = PartitionSpec(AXIS)
    fn = jax.jit(
        jax.shard_map(bodies[op], mesh=mesh, in_specs=spec, out_specs=out_spec, check_vma=False)
    )
    x = jax.device_put(jnp.ones((per_device * n,), jnp.float32), NamedSharding(mesh, spec))
    compiled = fn.lower(x).compile()
    # Once, untimed: the collective computed what it should (a sum over n of ones is n).
    out = np.asarray(compiled(x))
    expected = {"all-reduce": n, "reduce-scatter": n}.get(op, 1)
    if not np.all(out == expected):
        raise RuntimeError(f"{op}: wrong result ({out.ravel()[:4]}... for {expected})")
    realized = per_device * 4 * (n if op == "all-gather" else 1)
    return (lambda: compiled(x)), realized


def _one_device(op: str, device: jax.Device, size: int) -> tuple[Callable[[], object], int]:
    count = max(1, size // 4)
    if op == "device-copy":
        x = jax.device_put(jnp.ones((count,), jnp.float32), device)
        copy = jax.jit(lambda a: a + 0.0).lower(x).compile()  # one read, one write
        return (lambda: copy(x)), count * 4
    host = np.ones((count,), np.float32)
    sharding = jax.sharding.SingleDeviceSharding(device)
    if op == "host-to-device":
        pinned = pinned_host(device)
        if pinned is not None:
            source = jax.device_put(host, pinned)
            return (lambda: jax.device_put(source, sharding)), count * 4
        return (lambda: jax.device_put(host, sharding)), count * 4
    x = jax.device_put(host, sharding)
    pinned = pinned_host(device)
    if pinned is not None:  # a new host buffer each call
        return (lambda: jax.device_put(x, pinned)), count * 4
    # np.asarray caches one array's host copy, so each call converts a fresh device copy: the
    # time then includes one device copy (small beside the transfer on a GPU).
    return (lambda: np.asarray(x + 0.0)), count * 4


def pinned_host(device: jax.Device) -> jax.sharding.Sharding | None:
    """A sharding in the device's pinned host memory, or None where the backend has none."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, jax.errors.JaxRuntimeError):
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def memory_cap(device: jax.Device) -> int | None:
    """A quarter of the device's memory (three buffers of the largest size must fit)."""
    stats = getattr(device, "memory_stats", lambda: None)()
    limit = (stats or {}).get("bytes_limit")
    return limit // 12 if limit else None


def sizes(min_size: int, max_size: int, factor: int) -> list[int]:
    out, size = [], min_size
    while size <= max_size:
        out.append(size)
        size *= factor
    return out


def run_sweep(
    ops: list[str],
    sweep: list[int],
    *,
    devices: list[jax.Device],
    warmup: int,
    repeats: int,
    on_row: Callable[[Row], None] = lambda row: None,
) -> list[Row]:
    rows = []
    n = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    kind = devices[0].device_kind
    for op in ops:
        for size in sweep:
            if n > 1:
                fn, realized = _collective(op, mesh, size)
            else:
                fn, realized = _one_device(op, devices[0], size)
            seconds = _time(fn, warmup, repeats)
            algbw = realized / seconds / 1e9
            row = Row(op, n, realized, seconds * 1e6, algbw, algbw * bus_factor(op, n), kind)
            rows.append(row)
            on_row(row)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'op':<16}{'devices':>8}{'size':>12}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r.op:<16}{r.devices:>8}{_fmt(r.size_bytes):>12}{r.time_us:>12.1f}"
            f"{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}"
        )
    return "\n".join(lines)


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([field.name for field in dataclasses.fields(Row)])
        for r in rows:
            writer.writerow(dataclasses.astuple(r))
    tmp.replace(path)


def write_plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        ax.plot([r.size_bytes for r in mine], [r.busbw_gbps for r in mine], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{rows[0].device_kind}, {rows[0].devices} device(s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/collective_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default_ops = f"default {','.join(OPS)}; one device: {','.join(ONE_DEVICE_OPS)}"
    parser.add_argument("--ops", help=f"comma-separated ({default_ops})")
    parser.add_argument("--min-size", type=parse_size, default=parse_size("1KiB"))
    parser.add_argument("--max-size", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--devices", type=int, help="the first N devices (default all)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/collective_bench"))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    allowed = OPS if len(devices) > 1 else ONE_DEVICE_OPS
    ops = args.ops.split(",") if args.ops else list(allowed)
    for op in ops:
        if op not in allowed:
            parser.error(
                f"--ops: {op!r} needs {'one device' if op in ONE_DEVICE_OPS else 'several'}; "
                f"with {len(devices)} device(s) choose from {', '.join(allowed)}"
            )
    if args.factor < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("--factor >= 2, --repeats >= 1, --warmup >= 0")
    cap = memory_cap(devices[0])
    max_size = min(args.max_size, cap) if cap else args.max_size
    sweep = sizes(args.min_size, max_size, args.factor)
    if not sweep:
        parser.error(f"--min-size {_fmt(args.min_size)} is above the largest size {_fmt(max_size)}")
    rows = run_sweep(
        ops,
        sweep,
        devices=devices,
        warmup=args.warmup,
        repeats=args.repeats,
        on_row=lambda r: print(
            f"{r.op} {_fmt(r.size_bytes)}: {r.busbw_gbps:.3f} GB/s", file=sys.stderr, flush=True
        ),
    )
    csv_path = args.out_dir / "collective_bench.csv"
    write_csv(rows, csv_path)
    print(json.dumps([dataclasses.asdict(r) for r in rows]) if args.json else format_table(rows))
    for op in dict.fromkeys(r.op for r in rows):
        best = max((r for r in rows if r.op == op), key=lambda r: r.busbw_gbps)
        print(
            f"best {op}: busbw {best.busbw_gbps:.2f} GB/s at {_fmt(best.size_bytes)}",
            file=sys.stderr,
        )
    print(f"{rows[0].device_kind}: wrote {csv_path}", file=sys.stderr)
    png = csv_path.with_suffix(".png")
    if write_plot(rows, png):
        print(f"wrote {png}", file=sys.stderr)
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
