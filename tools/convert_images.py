"""Labelled images -> ArrayRecord shards of decoded uint8 pixels; optionally benchmarked.

    python tools/convert_images.py --source folder|cifar_binary|cifar_python --path PATH
        --out DIR [--image-size 32] [--splits train,test] [--shards 8] [--resize]
        [--bad-records error|skip] [--bench] [--bench-workers 0,1,2] [--bench-batches 40]
        [--batch-size 512]

Decodes every split once (``hopperjax/data/images.py``: Pillow in threads for a folder) and
writes it with ``hopperjax/data/image_shards.py``; train with ``data.source=shards
data.path=DIR``. Prints one summary line. ``--bench`` then times the host pipeline that feeds a
step, images per second through ``EpochBatches`` (shuffled batches of ``--batch-size``) with
each of ``--bench-workers`` worker process counts: from the shards (read pixels), and for a
folder source also from the files (decode each JPEG when read, as ``data.preload=false`` does)
and from memory (decoded at start, ``data.preload=true``). One JSON line per case. Errors: one
line on stderr, exit code 2.
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
from hopperjax.data import EpochBatches, image_shards, images, make_iterator
from hopperjax.data.errors import DataError


def read(args: argparse.Namespace, split: str, classes=None, *, preload: bool = True):
    if args.source == "folder":
        return images.read_folder(
            args.path, split, args.image_size, classes=classes, resize=args.resize,
            skip_bad=args.bad_records == "skip", preload=preload,
        )  # fmt: skip
    return images.read_cifar(args.path, split, binary=args.source == "cifar_binary")


def bench(source, *, workers: int, batch_size: int, batches: int) -> float:
    """Images per second through EpochBatches -> (workers), after the first batch."""
    ds = grain.MapDataset.source(EpochBatches(source, batch_size, batch_size))
    it = make_iterator(ds, DataConfig(workers=workers))
    next(it)  # worker start-up is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch_size / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=["folder", "cifar_binary", "cifar_python"],
                        required=True)  # fmt: skip
    parser.add_argument("--path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--splits", default="train,test")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--resize", action="store_true")
    parser.add_argument("--bad-records", choices=["error", "skip"], default="error")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--bench-workers", default="0,1,2")
    parser.add_argument("--bench-batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=512)
    args = parser.parse_args(argv)
    try:
        start = time.perf_counter()
        splits, classes = {}, None
        for split in args.splits.split(","):
            splits[split] = read(args, split, classes)
            classes = classes or splits[split].classes  # ids from the first split's folders
        decode_s = time.perf_counter() - start
        meta = image_shards.write_image_shards(
            splits, args.out, num_shards=args.shards, source=f"{args.source}:{args.path}"
        )
        counts = ", ".join(f"{k} {v['images']:,}" for k, v in meta["splits"].items())
        skipped = sum(v["skipped"] for v in meta["splits"].values())
        write_s = time.perf_counter() - start - decode_s
        print(f"{args.out}: {counts} images of {len(meta['classes'])} classes "
              f"{'x'.join(map(str, meta['image_shape']))}, {skipped} skipped; decoded in "
              f"{decode_s:.1f} s, written in {write_s:.1f} s")  # fmt: skip
        if args.bench:
            first = args.splits.split(",")[0]
            sources = {"shards": image_shards.read_image_shards(args.out, first)}
            if args.source == "folder":
                sources["files"] = read(args, first, preload=False)
            sources["memory"] = splits[first]
            for name, source in sources.items():
                for workers in map(int, args.bench_workers.split(",")):
                    rate = bench(source, workers=workers, batch_size=args.batch_size,
                                 batches=args.bench_batches)  # fmt: skip
                    print(json.dumps({"source": name, "workers": workers,
                                      "batch_size": args.batch_size,
                                      "images_per_s": round(rate)}), flush=True)  # fmt: skip
    except (DataError, ValueError, OSError) as e:
        print(f"convert_images: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
