"""Times ``layers.attention`` against ``jax.nn.dot_product_attention``, forward + backward.

    python tools/attention_bench.py [--shape 12,64,4,32] [--dtype float32] [--causal]
        [--repeats 400]

Both are compiled once and called on the same q, k, v ([batch, length, heads, head_dim]);
prints one JSON object with each one's median milliseconds per call. On CPU ``layers.attention``
takes its own path (``_attention_cpu``); elsewhere it is the same call and the two agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = [jax.random.normal(k, shape, jnp.dtype(args.dtype)) for k in keys]

    def forward_backward(attend):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))

    ours = forward_backward(lambda q, k, v: layers.attention(q, k, v, causal=args.causal))
    jax_call = forward_backward(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal)
    )
    report = {
        "backend": jax.default_backend(),
        "shape": shape,
        "dtype": args.dtype,
        "causal": args.causal,
        "layers_attention_ms": median_ms(ours, qkv, args.repeats),
        "jax_dot_product_attention_ms": median_ms(jax_call, qkv, args.repeats),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
