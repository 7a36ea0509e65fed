"""Summarizes a jax.profiler trace: top ops, and the traced window as compute/communication/idle.

    python tools/profile_summary.py runs/quickstart/profile [--top 15] [--json]

Reads the newest ``*.trace.json.gz`` under the directory; exits 1 when there is none or it holds
no XLA op events. The analysis (and the heuristic for which events are ops) lives in
``hopperjax.observe.trace_summary``; ``summarize`` is importable from here too.
"""

from __future__ import annotations

import argparse
import json
import sys

from hopperjax.observe.trace_summary import ProfileSummaryError, format_summary, summarize_trace

summarize = summarize_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", help="a profile directory (searched recursively) or a file")
    parser.add_argument("--top", type=int, default=15, help="how many ops to list")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.trace_dir, top=args.top)
    except ProfileSummaryError as e:
        print(f"profile_summary: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
