"""``python -m hopperjax.data``: lay out the public datasets the recipes use.

  python -m hopperjax.data list [--to DIR]
  python -m hopperjax.data prepare NAME --from PATH [--to DIR] [--force] [--link]

``PATH``: what you downloaded from the URL ``list`` shows (the archive, the file, or a folder
holding it). ``DIR`` (default ``data``, in the current directory): where the configs look.
"""

from __future__ import annotations

import argparse
import sys

from hopperjax.data import datasets


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hopperjax.data",
        description="Check a downloaded public dataset and lay it out where the configs look.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="the datasets, where to get them, which are prepared")
    listing.add_argument("--to", default=datasets.DEFAULT_ROOT, help="the data root")
    prep = sub.add_parser("prepare", help="check a download and lay it out under --to/NAME")
    prep.add_argument("name", choices=list(datasets.DATASETS), metavar="NAME",
                      help="one of: " + ", ".join(datasets.DATASETS))  # fmt: skip
    prep.add_argument("--from", dest="source", required=True,
                      help="the downloaded archive or file, or a folder holding it")  # fmt: skip
    prep.add_argument("--to", default=datasets.DEFAULT_ROOT, help="the data root")
    prep.add_argument(
        "--force",
        action="store_true",
        help="replace a layout prepare made (never a folder it did not make)",
    )
    prep.add_argument("--link", action="store_true",
                      help="hard-link the files instead of copying them (large downloads); the "
                      "layout then shares them with the download")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        for dataset, ready in datasets.status(args.to):
            mark = "prepared" if ready else "missing "
            print(f"{mark}  {dataset.name:<16} {dataset.what}")
            print(f"          download: {dataset.download}")
            print(f"          checksum: {dataset.checksum}")
            configs = ", ".join(f"configs/{c}" for c in dataset.configs) or "(no config yet)"
            print(f"          data.path: {args.to}/{dataset.config_path}  used by {configs}")
        return 0
    print(f"preparing {args.name} from {args.source}")
    try:
        dest = datasets.prepare(args.name, args.source, args.to, force=args.force, link=args.link)
    except datasets.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.source}: {e.strerror or e}", file=sys.stderr)
        return 2
    dataset = datasets.get(args.name)
    print(f"ready: {dest} (data.path={args.to}/{dataset.config_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
