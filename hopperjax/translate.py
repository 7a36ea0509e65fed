"""CLI: ``python -m hopperjax.translate --run-dir DIR [--input FILE] [TEXT ...]``.

Prints the translation of each sentence (the TEXT arguments, or one per line of ``--input``, or
of standard input) by a translation run's newest checkpoint (or ``--step``), with the run's own
tokenizer (``spm.model``): beam search with ``--beams`` hypotheses (1: greedy) and GNMT's length
penalty ``--length-penalty``. Only the parameters are restored; ``--average N`` uses the mean of
the N kept checkpoints up to that one (checkpoint averaging). Errors (no run, no checkpoint, too
few to average, a run that is not a translation run, an unreadable input): one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hopperjax.translate", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="a translation run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument(
        "--average", type=int, default=1, metavar="N",
        help="translate with the mean parameters of the N kept checkpoints up to --step",
    )  # fmt: skip
    parser.add_argument("--input", help="a text file, one sentence per line")
    parser.add_argument("--beams", type=int, default=4, help="beam size (1: greedy)")
    parser.add_argument("--length-penalty", type=float, default=0.6)
    parser.add_argument("--batch", type=int, default=32, help="sentences decoded together")
    parser.add_argument("text", nargs="*", help="sentences to translate")
    args = parser.parse_intermixed_args(argv)

    from hopperjax.config import ConfigError
    from hopperjax.data import parallel_text as pt
    from hopperjax.data.errors import DataError
    from hopperjax.infer import restore_params

    run_dir = Path(args.run_dir)
    try:
        if args.average < 1:  # before reading standard input
            raise ConfigError("--average", f"expected a positive number, got {args.average}")
        if args.beams < 1 or args.batch < 1:
            raise ConfigError("--beams", f"--beams and --batch must be >= 1, got {args.beams}, "
                              f"{args.batch}")  # fmt: skip
        if args.input:
            try:
                sentences = Path(args.input).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError("--input", f"cannot read {args.input}: {e}") from None
        else:
            sentences = args.text or sys.stdin.read().splitlines()
        restored = restore_params(run_dir, args.step, average=args.average)
        workload = restored.workload
        if not hasattr(workload, "translate"):
            raise ConfigError(
                "--run-dir", f"{run_dir} is a '{restored.config.workload}' run, not translation"
            )
        try:
            tokenizer = pt.Tokenizer.load(run_dir / "spm.model")
        except DataError as e:
            raise ConfigError("--run-dir", str(e), name_key=False) from None
    except (ConfigError, FileNotFoundError) as e:
        print(f"hopperjax.translate: {e}", file=sys.stderr)
        return 2
    for line in workload.translate(
        restored.model, restored.variables, tokenizer, sentences, batch=args.batch,
        beams=args.beams, length_penalty=args.length_penalty,
    ):  # fmt: skip
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
