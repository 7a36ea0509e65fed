"""One INT8 matmul three ways: fp32, our W8A8 dot (``precision/int8.py``) and Google's AQT.

    python experiments/int8_matmul_compare.py [--m 512 --k 1024 --n 1024] [--rounds 30]

Times each jitted matmul in interleaved rounds (medians) and prints the error of each against
fp32 (largest difference / largest output). AQT (``pip install aqtp``; not a hopperjax
dependency) runs twice: quantizing the weights every call, and serving frozen int8 weights
(its CONVERT pass, then SERVE mode); without it, only fp32 and ours are timed.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hopperjax.precision import int8 as int8_ops


def _aqt(x: jax.Array, w: jax.Array) -> dict:
    """AQT's dynamic and frozen-weight functions and arguments (empty if AQT is absent)."""
    try:
        import flax.linen as nn
        from aqt.jax.v2 import config as aqt_config
        from aqt.jax.v2 import utils as aqt_utils
        from aqt.jax.v2.flax import aqt_flax
    except ImportError:
        return {}
    cfg = aqt_config.config_v4(fwd_bits=8, dlhs_bits=None, drhs_bits=None)
    dims = (((1,), (0,)), ((), ()))
    frozen_mode = aqt_flax.FreezerMode.CALIBRATION_AND_VALUE

    class Matmul(nn.Module):
        mode: aqt_utils.QuantMode

        @nn.compact
        def __call__(self, x, w):
            freeze = (
                aqt_flax.FreezerMode.NONE if self.mode == aqt_utils.QuantMode.TRAIN else frozen_mode
            )
            dot = aqt_flax.AqtDotGeneral(cfg, prng_name=None, rhs_quant_mode=self.mode,
                                         rhs_freeze_mode=freeze)  # fmt: skip
            return dot(x, w, dims, None)

    dynamic = Matmul(aqt_utils.QuantMode.TRAIN)
    variables = dynamic.init(jax.random.key(0), x, w)
    convert = Matmul(aqt_utils.QuantMode.CONVERT)
    _, frozen = convert.apply(convert.init(jax.random.key(0), x, w), x, w, mutable=True)
    serve = Matmul(aqt_utils.QuantMode.SERVE)
    return {
        "aqt, weights quantized per call": (
            jax.jit(lambda x, w: dynamic.apply(variables, x, w)),
            (x, w),
        ),
        "aqt, frozen int8 weights": (jax.jit(lambda x, w, f: serve.apply(f, x, w)), (x, w, frozen)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.m, args.k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(args.k, args.n)) / np.sqrt(args.k), jnp.float32)
    q, scale = int8_ops.quantize_kernel(w, (0,))
    fns = {
        "fp32": (jax.jit(lambda x, w: x @ w), (x, w)),
        "ours, w8a8": (
            jax.jit(lambda x, q, s: int8_ops.int8_dot(x, q, s, 1, "w8a8", jnp.float32)),
            (x, q, scale),
        ),
        **_aqt(x, w),
    }
    ref = jax.block_until_ready(x @ w)
    errors = {}
    for name, (fn, fargs) in fns.items():
        out = jax.block_until_ready(fn(*fargs))
        errors[name] = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, (fn, fargs) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            times[name].append(time.perf_counter() - start)
    rows = {name: {"ms": 1e3 * float(np.median(t)), "error": errors[name]}
            for name, t in times.items()}  # fmt: skip
    print(json.dumps({"shape": [args.m, args.k, args.n], **rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
