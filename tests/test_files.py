"""Whole-or-absent files: concurrent writers of one path, and the temporary files a killed writer
leaves, which a conversion clears (its own only)."""

from __future__ import annotations

import json

from hopperjax import files
from hopperjax.data import record_shards


def test_two_writers_of_one_path_each_write_their_own_temporary_file(tmp_path):
    """The race of two processes keeping one cache file, played in order: writer A has written
    its temporary file when writer B writes and renames; A's rename still moves A's whole text
    (with one temporary name for both, B truncated and rewrote A's file under A, and A's rename
    made a half-written file visible)."""
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
    assert files.temp_target("train.tmp") is None  # not hidden: a user's file
    assert files.temp_target(".train.json") is None


def test_a_conversion_clears_a_killed_writers_temporary_files_of_its_own_splits(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    stale = [
        ".train-00000-of-00001.array_record.0123456789ab.tmp",  # killed mid-shard
        "..train-00000.part.fedcba987654.tmp",  # killed mid-part
        ".train-00000.part",  # killed after a part, before the set's renames
        ".val-00000-of-00001.array_record.tmp",  # an older writer's name
    ]
    theirs = ".other-00000-of-00001.array_record.0123456789ab.tmp"  # another tool's split
    for name in [*stale, theirs]:
        (out / name).write_bytes(b"half")
    meta = record_shards.write_shards(
        out, {"train": [[b"a", b"b"]], "val": [[b"c"]]}, meta={"format": "test"}
    )
    assert meta["splits"]["train"]["records"] == 2
    left = sorted(p.name for p in out.iterdir())
    assert left == sorted(
        [
            theirs,
            "dataset.json",
            "train-00000-of-00001.array_record",
            "val-00000-of-00001.array_record",
        ]
    )
    assert json.loads((out / "dataset.json").read_text())["splits"]["val"]["records"] == 1
