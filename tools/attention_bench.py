"""Times ``layers.attention`` per kernel (the ``attention`` key), forward + backward, and checks
each against XLA's softmax on the same inputs.

    python tools/attention_bench.py [--shape 12,64,4,32] [--dtype float32] [--causal]
        [--implementations auto,xla,cudnn] [--repeats 400]

Each implementation is compiled once and called on the same q, k, v ([batch, length, heads,
head_dim]); prints one JSON object: median milliseconds per call (``ms``), the largest output and
input-gradient difference from "xla" relative to its largest entry (``rel_err_vs_xla``), and why
an implementation could not run here (``skipped``: "cudnn" without a GPU, say). On CPU "auto" is
``layers._attention_cpu``; on a GPU it is cuDNN flash attention where cuDNN takes the shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hopperjax.config import ConfigError
from hopperjax.models import layers


def median_ms(fn, args, repeats: int) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="12,64,4,32", help="batch,length,heads,head_dim")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--implementations", default="auto,xla,cudnn")
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = [jax.random.normal(k, shape, jnp.dtype(args.dtype)) for k in keys]

    def forward_backward(implementation):
        def loss(q, k, v):
            out = layers.attention(q, k, v, causal=args.causal, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    report = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "shape": shape,
        "dtype": args.dtype,
        "causal": args.causal,
        "ms": {},
        "rel_err_vs_xla": {},
        "skipped": {},
    }
    reference = None
    names = [n.strip() for n in args.implementations.split(",") if n.strip()]
    for name in ["xla"] + [n for n in names if n != "xla"]:
        fn = forward_backward(name)
        try:
            (_, out), grads = jax.jit(fn)(*qkv)
        except ConfigError as err:
            report["skipped"][name] = str(err)
            continue
        except Exception as err:  # a kernel that fails to compile or run: report it, go on
            if name == "xla":
                raise
            report["skipped"][name] = f"{type(err).__name__}: {str(err)[:300]}"
            continue
        values = [np.asarray(x, np.float32) for x in (out, *grads)]
        if reference is None:
            reference = values
        else:
            report["rel_err_vs_xla"][name] = max(
                float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                for a, b in zip(values, reference, strict=True)
            )
        if name in names:
            report["ms"][name] = median_ms(fn, qkv, args.repeats)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
