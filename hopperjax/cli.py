"""The training CLI (``DESCRIPTION``), also the ``hopperjax-train`` script. Its ``main`` lives
here, not in ``hopperjax/train.py``, the module ``python -m`` runs: importing a submodule named
``train`` would rebind the package's name ``hopperjax.train``, the library's function, to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import jax

from hopperjax import supervise, xla_cpu
from hopperjax.checkpoint import CheckpointError
from hopperjax.config import Config, ConfigError, dump_yaml, load_config
from hopperjax.data.errors import DataError
from hopperjax.observe.metrics import MetricsFileError

DESCRIPTION = """Trains a config: python -m hopperjax.train --config FILE [key=value ...].

Exit codes: 0 done; 1 the training diverged (NaN/Inf: one line naming the steps and the last good
checkpoint); 2 a bad input (config key, data file, run directory, checkpoint), one line;
3 a multi-process job lost a process or its coordinator (one line naming it; restart every process
to resume); 130 aborted by a second Ctrl-C (the first one checkpoints and stops).
"""


def _not_orbax_errors(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname)


def _quiet_closed_event_loop(unraisable: Any) -> None:
    if not (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
    ):
        sys.__unraisablehook__(unraisable)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hopperjax.train",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/quickstart.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. train.steps=200 mesh.data=8 precision=bf16",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (every key, defaults included) as YAML and exit",
    )
    return parser


def _prepare_process(config: Config) -> None:
    """What this process sets before any backend starts (XLA reads its flags once)."""
    for line in xla_cpu.prepare_process(config):  # comm.overlap, cpu_convolutions
        print(line, flush=True)
    # orbax logs a failed background save as several tracebacks, and its writer threads may then
    # call into a closed event loop; the loop reports the failure as one line.
    logging.getLogger("absl").addFilter(_not_orbax_errors)
    sys.unraisablehook = _quiet_closed_event_loop
    # Set here, visibly, rather than inside library code: per-step keys that shard like the data.
    jax.config.update("jax_threefry_partitionable", True)
    if config.distributed.enabled:
        # Cross-process collectives on CPU hosts go through gloo (GPUs use NCCL regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"hopperjax: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    dist = config.distributed
    if dist.enabled and dist.supervise and not supervise.is_supervised_child():
        own_args = sys.argv[1:] if argv is None else argv
        return supervise.run(
            [sys.executable, "-m", "hopperjax.train", *own_args],
            coordinator=str(dist.coordinator_address or "auto"),
            heartbeat_timeout_s=dist.heartbeat_timeout_s,
        )
    _prepare_process(config)

    # Imported after _prepare_process's jax.config updates.
    from hopperjax.parallel import initialize_distributed
    from hopperjax.trainer import train

    try:
        if config.distributed.enabled:
            initialize_distributed(config.distributed)
        train(config)
    except ConfigError as e:
        print(f"hopperjax: config error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, MetricsFileError) as e:
        print(f"hopperjax: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # a bad record met while training (data decoded when read)
        print(f"hopperjax: data error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"hopperjax: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hopperjax: aborted (Ctrl-C twice); the run resumes from its last checkpoint")
        # At once, as promised: no interpreter teardown while background threads (a save being
        # committed, its manifest being hashed) still run native code, which can crash it. A
        # committed checkpoint carries its manifest; an unfinished one is a temporary directory
        # the next run removes.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 0
