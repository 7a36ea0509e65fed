"""Time a 3x3 convolution's forward pass and its two gradients, per layer shape, on this backend.

A convolution layer trains with three convolutions of 2 x M x N x K FLOPs each (M = batch x
height x width, N = output channels, K = 9 x input channels): the forward pass, the input gradient
and the weight gradient. Libraries differ most on the weight gradient, a reduction over the whole
batch; on CPU, ``--cpu-convolutions`` picks XLA:CPU's library (``hopperjax/xla_cpu.py``; it has to
be set before JAX starts, so this tool sets it first).

    python tools/conv_bench.py                                # ResNet-9's layers at batch 64
    python tools/conv_bench.py --cpu-convolutions ynnpack     # jaxlib's default, for comparison
    python tools/conv_bench.py --batch 32 --layers 32:64:128,8:256:512 --json

Each figure is the fastest of ``--reps`` timed calls after a warm-up call (NHWC, SAME padding,
stride 1, float32 unless ``--dtype``). Prints a table, or one JSON object per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hopperjax import xla_cpu

# The 3x3 layers of a CIFAR-size ResNet-9 (size, input channels, output channels).
DEFAULT_LAYERS = "32:3:64,32:64:128,16:128:128,16:128:256,8:256:512,4:512:512"


def _layers(text: str) -> list[tuple[int, int, int]]:
    try:
        layers = [tuple(int(v) for v in part.split(":")) for part in text.split(",")]
    except ValueError:
        layers = []
    if not layers or any(len(layer) != 3 or min(layer) < 1 for layer in layers):
        raise argparse.ArgumentTypeError(f"expected SIZE:IN:OUT[,SIZE:IN:OUT ...], got {text!r}")
    return layers  # type: ignore[return-value]


def _fastest(fn, *args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def bench_layer(size: int, cin: int, cout: int, batch: int, dtype: str, reps: int) -> dict:
    """Milliseconds and GFLOP/s of the forward pass and both gradients of one layer."""
    import jax

    def conv(x, w):  # x: [batch, size, size, cin], w: [3, 3, cin, cout]
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (batch, size, size, cin), dtype)
    w = (jax.random.normal(k2, (3, 3, cin, cout)) * 0.1).astype(dtype)
    dy = jax.random.normal(k3, (batch, size, size, cout), dtype)
    gflop = 2 * batch * size * size * 9 * cin * cout / 1e9
    steps = {
        "forward": (jax.jit(conv), (x, w)),
        "input_grad": (
            jax.jit(lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0]),
            (x, w, dy),
        ),
        "weight_grad": (
            jax.jit(lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0]),
            (x, w, dy),
        ),
    }
    row: dict = {"layer": f"{size}x{size} {cin}->{cout}", "batch": batch, "gflop": round(gflop, 3)}
    for name, (fn, args) in steps.items():
        seconds = _fastest(fn, *args, reps=reps)
        row[f"{name}_ms"] = round(seconds * 1e3, 2)
        row[f"{name}_gflops"] = round(gflop / seconds, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/conv_bench.py", description=__doc__)
    parser.add_argument("--layers", type=_layers, default=_layers(DEFAULT_LAYERS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--cpu-convolutions", choices=xla_cpu.MODES, default="eigen")
    parser.add_argument("--json", action="store_true", help="one JSON object per layer")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.reps < 1:
        parser.error("--batch and --reps must be positive")
    try:
        line = xla_cpu.apply(args.cpu_convolutions)
    except RuntimeError:  # called in a process whose JAX already runs (a test, a notebook)
        line = f"conv_bench: --cpu-convolutions {args.cpu_convolutions} not applied: JAX started"
    if line:
        print(line, file=sys.stderr)
    import jax

    device = jax.devices()[0]
    if not args.json:
        print(f"{device.platform} ({device.device_kind}), batch {args.batch}, {args.dtype}, "
              f"cpu_convolutions={args.cpu_convolutions}{' (not applied)' if line else ''}; "
              f"ms (GFLOP/s)")  # fmt: skip
        print(f"{'layer':>20} {'forward':>16} {'input grad':>16} {'weight grad':>16}")
    for size, cin, cout in args.layers:
        row = bench_layer(size, cin, cout, args.batch, args.dtype, args.reps)
        # What ran: a mode that could not be applied is recorded as such (the line above).
        row["cpu_convolutions"] = args.cpu_convolutions + (" (not applied)" if line else "")
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            cells = [
                f"{row[f'{n}_ms']:.1f} ({row[f'{n}_gflops']:.0f})"
                for n in ("forward", "input_grad", "weight_grad")
            ]
            print(f"{row['layer']:>20} " + " ".join(f"{c:>16}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
