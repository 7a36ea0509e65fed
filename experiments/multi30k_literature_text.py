"""Parallel text as the Multi30k literature trains on it: lowercased, Moses-normalized, tokenized.

    python experiments/multi30k_literature_text.py --from data/multi30k --to data/multi30k_lctok
    python experiments/translation_benchmark.py --out OUT data.path=data/multi30k_lctok

Writes every ``SPLIT.LANG[.gz]`` file of ``--from`` to ``--to`` (gzipped) through the steps the
dataset's own ``tok/*.lc.norm.tok.*`` files were made with (``hopperjax.scoring.moses_tokenize``
without Moses' ``&quot;``-style escapes), so a model can be trained on the text Wu et al. (2021)
and the other text-only baselines trained on. The benchmark's "Moses-tokenized lowercased" column
then scores such a model exactly their way: tokenizing this text again for scoring gives what
tokenizing the raw text gives, which the script checks line by line for every file and reports
(on Multi30k: every German line the same; English "woman 's" is split again into "&apos; s", so
an English target would not score exactly their way). The detokenized, cased columns do not apply
to such a run. The output directory is built under a temporary name and renamed when complete.
Needs sacremoses.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hopperjax.data import parallel_text as pt
from hopperjax.data.errors import DataError
from hopperjax.scoring import moses_tokenize

# SPLIT.LANG or SPLIT.LANG.gz, LANG a language code (en, de, fr, cs).
TEXT_FILE = re.compile(r"^(?P<split>.+?)\.(?!(?:tsv|gz)\b)(?P<lang>[a-z]{2,3})(?:\.gz)?$")


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
        same = "the same as the raw text's" if not differ else f"{differ:,} lines differ"
        report.append(f"{name}: {len(lines):,} lines, {tokens:,} tokens; scored again: {same}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True)
    parser.add_argument("--to", dest="target", required=True)
    args = parser.parse_args(argv)
    source, target = Path(args.source), Path(args.target)
    if not source.is_dir():
        print(f"multi30k_literature_text: --from {source}: not a directory", file=sys.stderr)
        return 2
    if target.exists():
        print(f"multi30k_literature_text: --to {target}: already exists", file=sys.stderr)
        return 2
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        report = convert(source, partial)
    except DataError as e:
        shutil.rmtree(partial, ignore_errors=True)
        print(f"multi30k_literature_text: {e}", file=sys.stderr)
        return 2
    partial.rename(target)
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
