"""Decoding time with and without the key-value cache, greedy and beam search.

    python experiments/decode_speed.py [--config configs/multi30k_t5.yaml] [--batch 32]
        [--beams 1,4] [key=value ...]

Builds the recipe's model with random weights (so no row ends early: every position of
``data.target_len`` is decoded), decodes ``--batch`` random source sentences of 10-19 tokens with
``Translation.translator`` cached and uncached, and prints the second call's seconds (the first
includes compiling). Reads no data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hopperjax
from hopperjax import workloads
from hopperjax.config import RematConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/multi30k_t5.yaml")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    config = hopperjax.load_config(args.config, args.overrides, validate_values=False)
    workload = workloads.get(config.workload)(config)
    model = workload.build_model(hopperjax.get_policy("fp32"), RematConfig())
    d = config.data
    zeros = jnp.zeros((2, d.source_len), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), *(zeros,) * 6)
    rng = np.random.default_rng(0)
    ids = np.zeros((args.batch, d.source_len), np.int32)
    for row in range(args.batch):
        n = rng.integers(10, 20)
        ids[row, :n] = rng.integers(3, config.model.vocab_size, n)
        ids[row, n] = 1  # end of sentence
    for beams in map(int, args.beams.split(",")):
        for cache in (True, False):
            run = workload.translator(model, batch=args.batch, beams=beams, cache=cache)
            jax.block_until_ready(run(variables, ids))
            start = time.perf_counter()
            jax.block_until_ready(run(variables, ids))
            print(f"beams {beams}, cache {cache}: {time.perf_counter() - start:.2f} s for "
                  f"{args.batch} sentences x {d.target_len} positions", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
