"""CLI: ``python -m hopperjax.train --config FILE [key=value ...]``.

Exit code 2 with a one-line message for a bad config (unknown key, wrong type, bad value).
"""

from __future__ import annotations

import argparse
import sys

import jax

from hopperjax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopperjax.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/quickstart.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. train.steps=200 mesh.data=8 precision=bf16",
    )
    args = parser.parse_args(argv)
    # Set here, visibly, rather than inside library code: per-step keys that shard like the data.
    jax.config.update("jax_threefry_partitionable", True)

    from hopperjax.parallel import initialize_distributed  # After the jax.config update above.
    from hopperjax.trainer import train

    try:
        config = load_config(args.config, args.overrides)
        if config.distributed.enabled:
            # Cross-process collectives on CPU hosts go through gloo (GPUs use NCCL regardless).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            initialize_distributed(config.distributed)
        train(config)
    except ConfigError as e:
        print(f"hopperjax: config error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"hopperjax: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
