"""Drug-target affinity data -> ArrayRecord shards, one record per pair; optionally benchmarked.

    python tools/convert_dta.py --source PATH --out DIR [--shards 8] [--drug-max-len 85]
        [--protein-max-len 1200] [--pkd | --no-pkd] [--unknown error|skip|unk]
        [--bad-records error|skip] [--bench]
    python tools/convert_dta.py --synthetic-pairs N --synthetic-drugs D --synthetic-proteins P
        --out DIR [...]

PATH is a DeepDTA directory or a .csv/.tsv file (``hopperjax/data/molecules.py``). ``--pkd``
defaults to the loader's default: on for DeepDTA (Kd in nM), off for CSV. Prints one summary line;
``--bench`` then reads the shards through grain (shuffle, decode, batch) with 0, 1 and 2 worker
processes and prints one JSON line per worker count. Errors: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grain

from hopperjax.config import DataConfig
from hopperjax.data import dta_shards, make_iterator, molecules


def load(args: argparse.Namespace) -> molecules.DtaTable:
    if args.synthetic_pairs:
        return molecules.synthetic_dta(
            num_drugs=args.synthetic_drugs,
            num_proteins=args.synthetic_proteins,
            num_pairs=args.synthetic_pairs,
            seed=args.seed,
        )
    pkd = {} if args.pkd is None else {"pkd": args.pkd}
    if Path(args.source).is_dir():
        return molecules.load_deepdta(args.source, bad_records=args.bad_records, **pkd)
    return molecules.load_dta_csv(args.source, bad_records=args.bad_records, **pkd)


def bench(paths: list[str], *, workers: int, batch_size: int, batches: int) -> dict:
    """Pairs per second through source -> shuffle -> decode -> batch, after the first batch."""
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths)).shuffle(seed=0)
    ds = ds.map(dta_shards.decode_pair).batch(batch_size, drop_remainder=True).repeat(None)
    it = make_iterator(ds, DataConfig(workers=workers))
    next(it)  # worker start-up is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    return {
        "workers": workers,
        "batch_size": batch_size,
        "examples_per_s": batches * batch_size / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/convert_dta.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", help="DeepDTA directory, or .csv / .tsv file")
    parser.add_argument("--out", required=True, help="directory for the shards")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--drug-max-len", type=int, default=85)
    parser.add_argument("--protein-max-len", type=int, default=1200)
    parser.add_argument("--pkd", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--unknown", choices=("error", "skip", "unk"), default="error")
    parser.add_argument("--bad-records", choices=("error", "skip"), default="error")
    parser.add_argument("--synthetic-pairs", type=int, default=0)
    parser.add_argument("--synthetic-drugs", type=int, default=1000)
    parser.add_argument("--synthetic-proteins", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic set")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--bench-batch", type=int, default=256)
    parser.add_argument("--bench-batches", type=int, default=100)
    args = parser.parse_args(argv)
    if bool(args.source) == bool(args.synthetic_pairs):
        parser.error("give exactly one of --source and --synthetic-pairs")

    start = time.perf_counter()
    try:
        table = load(args)
        drug_tok = molecules.Tokenizer(molecules.SMILES_CHARSET, args.drug_max_len, args.unknown)
        protein_tok = molecules.Tokenizer(
            molecules.PROTEIN_CHARSET, args.protein_max_len, args.unknown
        )
        shards = dta_shards.write_shards(
            table, drug_tok, protein_tok, args.out, num_shards=args.shards
        )
    except (molecules.DataError, ValueError, OSError) as e:
        print(f"convert_dta: {e}", file=sys.stderr)
        return 2
    paths = shards.paths
    size = sum(Path(p).stat().st_size for p in paths)
    splits = "DeepDTA folds kept" if shards.splits else "no folds"
    print(
        f"wrote {shards.pairs} pairs ({shards.skipped} skipped; {splits}) of {table.source} to "
        f"{len(paths)} shards in {args.out}: {size} bytes, {time.perf_counter() - start:.2f} s; "
        f"train on them with python -m hopperjax.train --config configs/dta_davis.yaml "
        f"data.source=shards data.path={args.out} data.group_by=none (shards stream pairs: "
        f"grouping by protein needs the pair table in memory)"
    )
    if args.bench:
        for workers in (0, 1, 2):
            result = bench(
                paths, workers=workers, batch_size=args.bench_batch, batches=args.bench_batches
            )
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
