"""Time the three GEMMs of a fully-connected layer per dtype, aligned vs unaligned shapes.

For a layer with batch N, K inputs and M outputs, training runs three GEMMs of 2*M*N*K FLOPs each:
forward y[N,M] = x[N,K] @ W[K,M], activation gradient dx[N,K] = dy[N,M] @ W^T and weight gradient
dW[K,M] = x^T @ dy. Tensor Cores want every dim a multiple of 8 elements for 16-bit types and of 16
for fp8 (16 bytes); the `--unaligned` variants (K-1, M-1) show what a ragged dim costs.

    python tools/gemm_bench.py --quick
    python tools/gemm_bench.py --batches 256,1024,4096 --in 8192 --out 8192 --dtypes bf16,fp8

Writes runs/gemm_bench/gemm_bench.csv (and .png when matplotlib imports); prints a table or --json.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from hopperjax.observe import flops


@dataclasses.dataclass(frozen=True)
class DtypeSpec:
    fwd: jnp.dtype  # forward operands x, W
    grad: jnp.dtype  # the incoming gradient dy
    out: jnp.dtype | None  # preferred_element_type; None: the inputs' dtype
    precision: lax.Precision
    align: int  # Tensor Core granule in elements (16 bytes)


DTYPES: dict[str, DtypeSpec] = {
    # HIGHEST keeps fp32 true fp32 on GPUs, where DEFAULT would allow TF32 ("tf32" below).
    "fp32": DtypeSpec(jnp.float32, jnp.float32, None, lax.Precision.HIGHEST, 4),
    "tf32": DtypeSpec(jnp.float32, jnp.float32, None, lax.Precision.DEFAULT, 4),
    "bf16": DtypeSpec(jnp.bfloat16, jnp.bfloat16, None, lax.Precision.DEFAULT, 8),
    # The usual fp8 recipe: e4m3 (more mantissa) forward, e5m2 (more range) for gradients.
    "fp8": DtypeSpec(jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32, lax.Precision.DEFAULT, 16),
}
DEFAULT_DTYPES = ("fp32", "bf16", "fp8")


def _gemm(name: str, contract, doc: str):
    """A jitted GEMM, named for profiles, that contracts dims `contract` of its operands."""

    def gemm(a, b, *, out=None, precision=None):
        dims = (contract, ((), ()))
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)

    gemm.__name__, gemm.__qualname__, gemm.__doc__ = name, name, doc
    return jax.jit(gemm, static_argnames=("out", "precision"))


forward = _gemm("forward", ((1,), (0,)), "x: [N, K], w: [K, M] -> y: [N, M].")
act_grad = _gemm("act_grad", ((1,), (1,)), "dy: [N, M], w: [K, M] -> dx: [N, K] (dy @ w.T).")
weight_grad = _gemm("weight_grad", ((0,), (0,)), "x: [N, K], dy: [N, M] -> dw: [K, M] (x.T @ dy).")

# gemm name -> (jitted function, its operands' names)
GEMMS = {
    "forward": (forward, ("x", "w")),
    "act_grad": (act_grad, ("dy", "w")),
    "weight_grad": (weight_grad, ("x", "dy")),
}


def gemm_flops(n: int, k: int, m: int) -> int:
    """FLOPs of any of the three GEMMs: one multiply and one add per (n, k, m) triple."""
    return 2 * m * n * k


def is_aligned(n: int, k: int, m: int, dtype: str) -> bool:
    """Whether every dim is a multiple of the dtype's Tensor Core granule (4/8/16 elements)."""
    align = DTYPES[dtype].align
    return all(d % align == 0 for d in (n, k, m))


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s for a jax device_kind such as "NVIDIA H100 80GB HBM3"; None if unknown.

    One table for the whole project: ``hopperjax.observe.flops.PEAK_TFLOPS``.
    """
    kind = flops.device_peak_kind(device_kind)
    return None if kind is None else flops.PEAK_TFLOPS[kind].get(dtype)


@dataclasses.dataclass(frozen=True)
class Sweep:
    batches: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]  # (K, M) pairs
    dtypes: tuple[str, ...]
    repeats: int
    warmup: int


def default_sweep(backend: str, *, quick: bool) -> Sweep:
    """Seconds on 2 CPU cores for --quick and on CPU; H100-class sizes on a GPU."""
    if quick:
        return Sweep((8, 16), ((64, 64), (63, 63)), DEFAULT_DTYPES, repeats=3, warmup=1)
    if backend == "cpu":
        return Sweep((8, 16, 32, 64, 128), ((256, 256), (255, 255)), DEFAULT_DTYPES, 5, 2)
    batches = tuple(2**p for p in range(8, 15))  # 256 .. 16384
    return Sweep(batches, ((8192, 8192), (8191, 8191)), DEFAULT_DTYPES, repeats=20, warmup=5)


@dataclasses.dataclass(frozen=True)
class Row:
    device_kind: str
    dtype: str
    gemm: str
    n: int
    k: int
    m: int
    aligned: bool
    flops: int
    median_s: float | None = None
    min_s: float | None = None
    tflops: float | None = None
    pct_peak: float | None = None
    skipped: str = ""  # why this case did not run (e.g. the backend lacks the dtype)


def make_operands(gemm: str, dtype: str, n: int, k: int, m: int) -> list[jax.Array]:
    """The GEMM's two operands among x: [N, K], w: [K, M] (forward dtype), dy: [N, M] (grad)."""
    spec = DTYPES[dtype]
    table = {"x": ((n, k), spec.fwd), "w": ((k, m), spec.fwd), "dy": ((n, m), spec.grad)}
    keys = jax.random.split(jax.random.key(0), 2)
    pairs = zip(keys, (table[name] for name in GEMMS[gemm][1]), strict=True)
    return [jax.random.normal(key, shape).astype(dt) for key, (shape, dt) in pairs]


def time_calls(fn, args, *, warmup: int, repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of an already compiled fn, each ended by block_until_ready.

    Each call includes its dispatch, which dominates tiny GEMMs on a GPU (a few microseconds).
    """
    for _ in range(warmup):
        fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def bench_gemm(
    gemm: str, dtype: str, n: int, k: int, m: int, *, device_kind: str, warmup: int, repeats: int
) -> Row:
    """One Row; a dtype or shape the backend cannot compile or run gives a skipped Row."""
    base = Row(device_kind, dtype, gemm, n, k, m, is_aligned(n, k, m, dtype), gemm_flops(n, k, m))
    spec = DTYPES[dtype]
    try:
        args = make_operands(gemm, dtype, n, k, m)
        # Compiling explicitly keeps compile time out of the timings, warmup=0 included.
        compiled = GEMMS[gemm][0].lower(*args, out=spec.out, precision=spec.precision).compile()
        times = time_calls(compiled, args, warmup=warmup, repeats=repeats)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        return dataclasses.replace(base, skipped=f"{type(err).__name__}: {err}".splitlines()[0])
    median = statistics.median(times)
    tflops = base.flops / median / 1e12
    peak = peak_tflops(device_kind, dtype)
    pct = None if peak is None else 100 * tflops / peak
    return dataclasses.replace(base, median_s=median, min_s=min(times), tflops=tflops, pct_peak=pct)


def run_sweep(sweep: Sweep, on_row=None) -> list[Row]:
    """Every (dtype, (K, M), N, gemm) of the sweep, in that nesting order; ``on_row(row)`` is
    called as each one finishes (the CLI prints it, so a run cut short still shows its rows)."""
    kind = jax.devices()[0].device_kind
    rows = []
    for d in sweep.dtypes:
        for k, m in sweep.layers:
            for n in sweep.batches:
                for g in GEMMS:
                    row = bench_gemm(
                        g, d, n, k, m, device_kind=kind, warmup=sweep.warmup, repeats=sweep.repeats
                    )
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return rows


def progress_line(row: Row) -> str:
    """One finished case, for stderr while the sweep runs."""
    shape = f"{row.dtype} {row.gemm} N={row.n} K={row.k} M={row.m}"
    if row.skipped:
        return f"{shape}: skipped ({row.skipped})"
    return f"{shape}: {row.median_s * 1e3:.3f} ms, {row.tflops:.1f} TFLOP/s"


def write_csv(rows: list[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[f.name for f in dataclasses.fields(Row)])
        writer.writeheader()
        writer.writerows(dataclasses.asdict(r) for r in rows)


def write_plot(rows: list[Row], path: Path) -> bool:
    """TFLOP/s vs N, one panel per GEMM, one line per dtype x (K, M); dashed = unaligned K or M.

    Lines are keyed by the layer's (K, M) rather than the row's `aligned` flag so that a line does
    not jump when only N is ragged (N=8 is unaligned for fp8). Returns False without matplotlib.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        return False
    done = [r for r in rows if r.tflops]
    fig = Figure(figsize=(5 * len(GEMMS), 4.5), layout="constrained")
    fig.suptitle(f"{rows[0].device_kind}: solid = K, M aligned for the dtype; dashed = not")
    axes = fig.subplots(1, len(GEMMS), sharey=True)
    for ax, gemm in zip(axes, GEMMS, strict=True):
        for dtype, k, m in sorted({(r.dtype, r.k, r.m) for r in done if r.gemm == gemm}):
            pts = sorted(
                (r.n, r.tflops) for r in done if (r.gemm, r.dtype, r.k, r.m) == (gemm, dtype, k, m)
            )
            style = "-" if k % DTYPES[dtype].align == m % DTYPES[dtype].align == 0 else "--"
            color = f"C{list(DTYPES).index(dtype)}"  # a dtype's two lines share a color
            ax.plot(
                *zip(*pts, strict=True),
                style,
                marker="o",
                color=color,
                label=f"{dtype} K={k} M={m}",
            )
        ax.set_xscale("log", base=2)
        ax.set(title=gemm, xlabel="batch N", ylabel="TFLOP/s", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def format_table(rows: list[Row]) -> str:
    """One line per row; `al` is the aligned flag, `-` an unknown peak."""
    lines = [
        f"{'dtype':5} {'gemm':11} {'N':>6} {'K':>6} {'M':>6} al {'median_ms':>10} {'min_ms':>9} "
        f"{'TFLOP/s':>9} {'%peak':>6}"
    ]
    for r in rows:
        line = f"{r.dtype:5} {r.gemm:11} {r.n:>6} {r.k:>6} {r.m:>6} {'yn'[not r.aligned]}  "
        if r.skipped:
            lines.append(line + f"skipped: {r.skipped[:70]}")
        else:
            pct = "-" if r.pct_peak is None else f"{r.pct_peak:.1f}"
            lines.append(
                line + f"{r.median_s * 1e3:>10.4f} {r.min_s * 1e3:>9.4f} {r.tflops:>9.4g} {pct:>6}"
            )
    return "\n".join(lines)


def _at_least(low: int):
    def integer(text: str) -> int:  # argparse names a ValueError "invalid integer value"
        if (value := int(text)) < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return integer


def _dtype(name: str) -> str:
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return name


def _csv(item):
    def comma_separated(text: str) -> tuple:
        return tuple(item(v.strip()) for v in text.split(",") if v.strip())

    return comma_separated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--quick", action="store_true", help="the smallest sweep (seconds on a CPU)")
    add("--batches", type=_csv(_at_least(1)), help="batch sizes N, e.g. 256,1024,4096")
    add("--in", dest="k", type=_at_least(1), help="layer inputs K")
    add("--out", dest="m", type=_at_least(1), help="layer outputs M")
    add(
        "--unaligned",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the (K-1, M-1) layer (default: on)",
    )
    add("--dtypes", type=_csv(_dtype), help=f"comma-separated, from {', '.join(DTYPES)}")
    add("--repeats", type=_at_least(1), help="timed calls per GEMM (median and min reported)")
    add("--warmup", type=_at_least(0), help="untimed calls before timing (after compiling)")
    add("--out-dir", type=Path, default=Path("runs/gemm_bench"), help="for the CSV and PNG")
    add("--json", action="store_true", help="print the rows as JSON instead of a table")
    return p


def resolve_sweep(args: argparse.Namespace, backend: str) -> Sweep:
    """The default sweep for the backend with the command-line values put over it."""
    base = default_sweep(backend, quick=args.quick)
    k = args.k if args.k is not None else base.layers[0][0]
    m = args.m if args.m is not None else base.layers[0][1]
    unaligned = args.unaligned and min(k, m) > 1
    return Sweep(
        batches=args.batches or base.batches,
        layers=((k, m), (k - 1, m - 1)) if unaligned else ((k, m),),
        dtypes=args.dtypes or base.dtypes,
        repeats=args.repeats if args.repeats is not None else base.repeats,
        warmup=args.warmup if args.warmup is not None else base.warmup,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = run_sweep(
        resolve_sweep(args, jax.default_backend()),
        on_row=lambda row: print(progress_line(row), file=sys.stderr, flush=True),
    )
    csv_path = args.out_dir / "gemm_bench.csv"
    write_csv(rows, csv_path)
    print(json.dumps([dataclasses.asdict(r) for r in rows]) if args.json else format_table(rows))
    # Status lines go to stderr so that --json output stays parseable.
    print(f"{rows[0].device_kind}: wrote {csv_path}", file=sys.stderr)
    png_path = csv_path.with_suffix(".png")
    if write_plot(rows, png_path):
        print(f"wrote {png_path}", file=sys.stderr)
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
