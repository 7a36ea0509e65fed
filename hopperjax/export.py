"""CLI: ``python -m hopperjax.export --run-dir R [--step N] [--quantize SCHEME] --out DIR``.

Writes the run's model (its newest verified checkpoint, or ``--step``; parameters only) as an
artifact that JAX alone can run (``hopperjax/infer/export.py``): the workload's preprocessing and
``predict`` as a serialized ``jax.export`` module with a symbolic batch size, lowered for
``--platforms`` (``cpu``, ``cuda``; comma-separated), its variables, ``metadata.json`` and
``load_artifact.py``. ``--quantize``: an INT8 scheme first (``weight``, ``w8a8``, ``w8a8_static``;
``int8`` means ``w8a8``), the static one calibrated on ``--calibration-batches`` training
batches (the run's data must be where its config says) to ``--calibration-percentile`` of the
input magnitudes (default 99.99). Errors: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopperjax.export", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="a hopperjax run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--out", required=True, help="the artifact directory to create")
    parser.add_argument("--quantize", help="weight | w8a8 | w8a8_static | int8 (= w8a8)")
    parser.add_argument("--platforms", default="cpu", help="cpu,cuda (default: cpu)")
    parser.add_argument("--calibration-batches", type=int, default=8)
    parser.add_argument(
        "--calibration-percentile", type=float, default=None,
        help="w8a8_static: this percentile of the input magnitudes (100: the largest)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from hopperjax.config import ConfigError
    from hopperjax.infer import restore_params
    from hopperjax.infer.evaluate import first_batches
    from hopperjax.infer.export import export_restored
    from hopperjax.infer.quantize import DEFAULT_PERCENTILE, quantize_restored

    scheme = {"int8": "w8a8"}.get(args.quantize, args.quantize)
    try:
        if args.calibration_batches < 1:
            raise ConfigError("--calibration-batches", "expected >= 1")
        restored = restore_params(args.run_dir, args.step)
        if scheme:
            calibration = None
            if scheme == "w8a8_static":
                from hopperjax.trainer.components import build_datasets

                datasets = build_datasets(restored.config, workload=restored.workload)
                calibration = first_batches(datasets.train, args.calibration_batches)
            percentile = args.calibration_percentile or DEFAULT_PERCENTILE
            restored = quantize_restored(restored, scheme, calibration, percentile=percentile)
        platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
        metadata = export_restored(restored, args.out, platforms=platforms, quantize=scheme,
                                   run_dir=args.run_dir)  # fmt: skip
    except ConfigError as e:
        print(f"hopperjax.export: {e}", file=sys.stderr)
        return 2
    print(
        f"hopperjax.export: {args.out}: the '{metadata['workload']}' predict of step "
        f"{metadata['step']} for {', '.join(metadata['platforms'])}, INT8 "
        f"{metadata['quantize']}, {metadata['parameter_bytes']:,} parameter bytes; run it with "
        f"load_artifact.load('{args.out}')(batch)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
