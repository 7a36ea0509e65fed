"""Parallel text as the Multi30k literature trains on it: lowercased, Moses-normalized, tokenized.

(Moses' XML escapes left out: the dataset's own tokenized files have ``&quot;``, ``&apos;`` and
``&amp;``; scoring escapes both sides alike, so the scores are unaffected.)

    python experiments/multi30k_literature_text.py --from data/multi30k --to data/multi30k_lctok
    python experiments/translation_benchmark.py --out OUT data.path=data/multi30k_lctok

Writes every ``SPLIT.LANG[.gz]`` file of ``--from`` to ``--to`` (gzipped) through the steps the
dataset's own ``tok/*.lc.norm.tok.*`` files were made with (``hopperjax.scoring.moses_tokenize``,
escapes left out), so a model can be trained on the text Wu et al. (2021) and the other text-only
baselines trained on. The benchmark's "Moses-tokenized lowercased" column then scores such a
model against their references exactly (its output is tokenized again, as all output is there):
tokenizing this text again for scoring gives what tokenizing the raw text gives, which the
script checks line by line for every file and reports
(on Multi30k: every German line the same; English "woman 's" is split again into "&apos; s", so
an English target would not score exactly their way). The detokenized, cased columns do not apply
to such a run. The output directory is built under a temporary name and renamed when complete.
Needs sacremoses.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hopperjax.data import parallel_text as pt
from hopperjax.data.errors import DataError, one_line
from hopperjax.scoring import moses_tokenize

# SPLIT.LANG or SPLIT.LANG.gz, LANG one of Multi30k's languages; anything else is not read (a
# split given only as a TSV of pairs included).
TEXT_FILE = re.compile(r"^(?P<split>[^.].*?)\.(?P<lang>en|de|fr|cs)(?:\.gz)?$")


def _lines(n: int) -> str:
    return f"{n:,} line" if n == 1 else f"{n:,} lines"


def convert(source: Path, target: Path) -> list[str]:
    """Writes the converted files of ``source`` into ``target`` (a new directory); one report
    line per file. Each split is read as parallel text (``parallel_text.read_pairs``: aligned line
    counts, UTF-8, one-line errors naming the file and line)."""
    langs: dict[str, set[str]] = {}
    for path in source.iterdir():
        match = TEXT_FILE.match(path.name) if path.is_file() else None
        if match:
            langs.setdefault(match["split"], set()).add(match["lang"])
    if not langs:
        raise DataError(f"{source}: no SPLIT.LANG or SPLIT.LANG.gz files")
    texts: dict[tuple[str, str], list[str]] = {}
    for split, present in sorted(langs.items()):
        first, *others = sorted(present)
        if not others:
            raise DataError(f"{source}: {split}.{first} has no other language to pair it with")
        for other in others:
            pairs = pt.read_pairs(source, split, first, other)
            texts[split, first], texts[split, other] = pairs.sources, pairs.targets
    report = []
    for (split, lang), lines in texts.items():
        converted = moses_tokenize(lines, lang, escape=False)
        again, raw = moses_tokenize(converted, lang), moses_tokenize(lines, lang)
        differ = sum(a != b for a, b in zip(again, raw, strict=True))
        name = f"{split}.{lang}.gz"
        with gzip.open(target / name, "wt", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in converted))
        tokens = sum(len(line.split()) for line in converted)
        verb = "differs" if differ == 1 else "differ"
        same = f"{_lines(differ)} {verb}" if differ else "the same as the raw text's"
        report.append(f"{name}: {_lines(len(lines))}, {tokens:,} tokens; scored again: {same}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True)
    parser.add_argument("--to", dest="target", required=True)
    args = parser.parse_args(argv)
    source, target = Path(args.source), Path(args.target)
    problem = None
    if importlib.util.find_spec("sacremoses") is None:
        problem = "needs sacremoses (pip install 'hopperjax[translate]')"
    elif not source.is_dir():
        problem = f"--from {source}: not a directory"
    elif target.exists():
        problem = f"--to {target}: already exists"
    elif not target.parent.is_dir():
        problem = f"--to {target}: its parent {target.parent} is not a directory"
    if problem:
        print(f"multi30k_literature_text: {problem}", file=sys.stderr)
        return 2
    try:
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        print(f"multi30k_literature_text: --to {target}: {one_line(e)}", file=sys.stderr)
        return 2
    try:
        report = convert(source, partial)
        partial.rename(target)
    except (DataError, OSError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        print(f"multi30k_literature_text: {one_line(e)}", file=sys.stderr)
        return 2
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
