"""Whole-or-absent files: concurrent writers of one path, and the temporary files a killed writer
leaves, which a conversion clears (its own only)."""

from __future__ import annotations

import numpy as np
import pytest

from hopperjax import files
from hopperjax.data import image_shards, images, record_shards


def test_two_writers_of_one_path_each_write_their_own_temporary_file(tmp_path):
    """The race of two processes keeping one cache file, played in order: writer A has written
    its temporary file when writer B writes and renames; A's rename still moves A's whole text.
    With one temporary name for both, B rewrote A's file under A and renamed it away, so A
    failed (here, at its fsync); had A renamed while B was still writing, the final name would
    have shown half of B's text."""
    path = tmp_path / "cache.json"
    temps = []

    def writer_a(temp):
        temps.append(temp)
        temp.write_text("A" * 1000)
        files.atomic_write(path, lambda t: (temps.append(t), t.write_text("B" * 10)))
        assert path.read_text() == "B" * 10

    files.atomic_write(path, writer_a)
    assert path.read_text() == "A" * 1000  # the last rename wins, whole
    assert temps[0] != temps[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]
    assert [files.temp_target(t.name) for t in temps] == ["cache.json", "cache.json"]


def test_temp_target_reads_both_temporary_names_and_nothing_else():
    assert files.temp_target(".train-00000-of-00002.array_record.0123456789ab.tmp") == (
        "train-00000-of-00002.array_record"
    )
    assert files.temp_target(".train-00001.part.tmp") == "train-00001.part"  # an older writer's
    assert files.temp_target("..train-00001.part.fedcba987654.tmp") == ".train-00001.part"
    assert files.temp_target(".a.b.c.0123456789ab.tmp") == "a.b.c"
    # A final name ending in 12 hex digits of its own keeps them.
    assert files.temp_target(".x.0123456789ab.fedcba987654.tmp") == "x.0123456789ab"
    assert files.temp_target("train.tmp") is None  # not hidden: a user's file
    assert files.temp_target(".train.json") is None
    assert files.temp_target("..tmp") is None


def _record_shards(out):
    meta = record_shards.write_shards(
        out, {"train": [[b"a", b"b"]], "val": [[b"c"]]}, meta={"format": "test"}
    )
    return {name: split["records"] for name, split in meta["splits"].items()}


def _image_shards(out):
    pixels = np.zeros((3, 4, 4, 3), np.uint8)
    data = images.ImageSet(pixels, np.array([0, 1, 0], np.int32), ("a", "b"))
    meta = image_shards.write_image_shards(
        {"train": data.take(np.arange(2)), "val": data.take(np.arange(1))}, out, num_shards=1
    )
    return {name: split["images"] for name, split in meta["splits"].items()}


@pytest.mark.parametrize("convert", [_record_shards, _image_shards], ids=["records", "images"])
def test_a_conversion_clears_a_killed_writers_temporary_files_of_its_own_splits(tmp_path, convert):
    out = tmp_path / "shards"
    out.mkdir()
    stale = [
        ".train-00000-of-00001.array_record.0123456789ab.tmp",  # killed mid-shard
        ".val-00000-of-00001.array_record.tmp",  # an older writer's name
    ]
    if convert is _record_shards:  # it writes each split's parts first, then renames them all
        stale += [
            "..train-00000.part.fedcba987654.tmp",  # killed mid-part
            ".train-00000.part",  # killed after a part, before the set's renames
        ]
    theirs = ".other-00000-of-00001.array_record.0123456789ab.tmp"  # another tool's split
    for name in [*stale, theirs]:
        (out / name).write_bytes(b"half")
    assert convert(out) == {"train": 2, "val": 1}
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(
        [
            theirs,
            "dataset.json",
            "train-00000-of-00001.array_record",
            "val-00000-of-00001.array_record",
        ]
    )
