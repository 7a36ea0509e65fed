"""Convert Criteo's click logs (TSV, any size) into ArrayRecord shards for training without parsing.

    python tools/convert_interactions.py --source FILE.tsv[.gz] --out DIR \
        --table-sizes N1,...,N26 [--chunk-rows 1048576] [--bad-records error|skip]

Streams the file ``--chunk-rows`` lines at a time (memory stays flat whatever its size), hashes
each category into its table's rows (``--table-sizes``: the recipe's ``model.table_sizes``), and
writes one shard per chunk, one fixed-size record per line, plus ``dataset.json`` (layout, the
table sizes, rows skipped). Train with ``data.source=criteo_shards data.path=DIR`` and the same
``model.table_sizes`` (a run with other sizes is refused: the ids would mean other rows). Errors
(a bad line, an unreadable file) are one line naming the file and line; exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hopperjax.data import interactions as ix
from hopperjax.data.errors import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/convert_interactions.py", description=__doc__)
    parser.add_argument("--source", required=True, help="a Criteo TSV file (.gz too)")
    parser.add_argument("--out", required=True, help="the shard directory to write")
    parser.add_argument("--table-sizes", required=True, help="26 comma-separated row counts")
    parser.add_argument("--chunk-rows", type=int, default=1 << 20, help="lines per shard")
    parser.add_argument("--bad-records", choices=("error", "skip"), default="error")
    args = parser.parse_intermixed_args(argv)
    try:
        sizes = tuple(int(x) for x in args.table_sizes.split(",") if x.strip())
    except ValueError:
        print(f"convert_interactions: --table-sizes: not integers: {args.table_sizes}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.chunk_rows < 1 or any(n < 1 for n in sizes):
        print(
            "convert_interactions: --chunk-rows and every table size must be >= 1", file=sys.stderr
        )
        return 2
    start = time.perf_counter()
    try:
        chunks = ix.iter_criteo(
            args.source, sizes, skip_bad=args.bad_records == "skip", chunk_rows=args.chunk_rows
        )
        meta = ix.write_interaction_shards(chunks, args.out, table_sizes=sizes, source=args.source)
    except DataError as e:
        print(f"convert_interactions: {e}", file=sys.stderr)
        return 2
    except (OSError, ImportError) as e:  # --out not writable, a full disk, no array_record
        print(f"convert_interactions: {args.out}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    split = meta["splits"]["all"]
    seconds = time.perf_counter() - start
    print(f"{split['records']:,} interactions ({split['skipped']} skipped) in {split['shards']} "
          f"shards, {seconds:.1f} s ({split['records'] / max(seconds, 1e-9):,.0f} lines/s): "
          f"{args.out}")  # fmt: skip
    print(f"next: python -m hopperjax.train --config configs/dlrm_criteo.yaml "
          f"data.source=criteo_shards "
          f"data.path={args.out} model.table_sizes={','.join(map(str, sizes))}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
