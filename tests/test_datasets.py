"""``python -m hopperjax.data prepare``: each dataset's layout from small stand-ins of what a user
downloads (checksums and counts patched to the stand-ins'), the refusals, and the configs that
point where it lays data out. Every test writes its own files; none reads shared data."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import pickle
import tarfile
import zipfile

import numpy as np
import pytest
import yaml
from conftest import REPO

import hopperjax
from hopperjax.config import ConfigError
from hopperjax.data import datasets, images, molecules, parallel_text
from hopperjax.data.__main__ import main
from hopperjax.data.errors import DataError


def _sha(data: bytes, algorithm: str = "sha256") -> str:
    return hashlib.new(algorithm, data).hexdigest()


def test_shakespeare_is_verified_and_laid_out_whole(tmp_path, monkeypatch, capsys):
    text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
    download = tmp_path / "downloads" / "shakespeare.txt"  # any name: the one file given
    download.parent.mkdir()
    download.write_bytes(text)
    root = tmp_path / "data"
    # The published checksum is the real file's: a different file is refused, nothing left.
    with pytest.raises(DataError, match=r"shakespeare.txt: sha256 [0-9a-f]{64} is not Tiny"):
        datasets.prepare("tinyshakespeare", download, root)
    assert not root.exists()
    monkeypatch.setattr(datasets, "SHAKESPEARE_SHA256", _sha(text))
    dest = datasets.prepare("tinyshakespeare", download, root)
    assert (dest / "input.txt").read_bytes() == text
    manifest = json.loads((dest / datasets.MANIFEST).read_text())
    assert manifest["sha256"] == {"input.txt": _sha(text)}
    assert "input.txt: 61 characters, 27 distinct (sha256 verified)" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["tinyshakespeare"]  # no temporary left
    # Copied: editing the download later cannot change the verified layout (--link shares it).
    assert not (dest / "input.txt").samefile(download)
    # Prepared once: again is refused (one line), --force lays it out again.
    with pytest.raises(DataError, match=r"tinyshakespeare: already prepared \(--force"):
        datasets.prepare("tinyshakespeare", download, root)
    datasets.prepare("tinyshakespeare", download, root, force=True, link=True)
    assert sorted(p.name for p in root.iterdir()) == ["tinyshakespeare"]
    assert (dest / "input.txt").samefile(download)
    assert json.loads((dest / datasets.MANIFEST).read_text())["linked"] is True
    # A source inside the layout --force would replace is refused.
    with pytest.raises(DataError, match=r"input.txt: inside \S+/tinyshakespeare, which --force"):
        datasets.prepare("tinyshakespeare", dest / "input.txt", root, force=True)
    # A folder prepare did not make is never touched, --force or not.
    mine = tmp_path / "mine"
    (mine / "tinyshakespeare").mkdir(parents=True)
    (mine / "tinyshakespeare" / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(DataError, match=r"tinyshakespeare: exists and was not made by prep"):
            datasets.prepare("tinyshakespeare", download, mine, force=force)
    assert (mine / "tinyshakespeare" / "notes.txt").read_text() == "keep me"


def _deepdta_folder(root, drugs=3, proteins=4):
    root.mkdir(parents=True)
    (root / "ligands_can.txt").write_text(json.dumps({str(i): "C" * (i + 1) for i in range(drugs)}))
    (root / "proteins.txt").write_text(
        json.dumps({f"P{i}": "MKV" * (i + 1) for i in range(proteins)})
    )
    with open(root / "Y", "wb") as f:
        pickle.dump(np.full((drugs, proteins), 100.0), f, protocol=2)
    (root / "folds").mkdir()
    pairs = list(range(drugs * proteins))
    (root / "folds" / "train_fold_setting1.txt").write_text(json.dumps([pairs[:4], pairs[4:8]]))
    (root / "folds" / "test_fold_setting1.txt").write_text(json.dumps(pairs[8:]))


def test_davis_from_the_deepdta_repository_zip_picks_its_folder(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "DeepDTA-master"
    _deepdta_folder(repo / "data" / "kiba", drugs=2, proteins=2)  # a decoy the name rules out
    _deepdta_folder(repo / "data" / "davis")
    archive = tmp_path / "DeepDTA-master.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in repo.rglob("*"):
            z.write(path, path.relative_to(tmp_path))
    # With the published digests, the stand-in's files are refused (the first checked named).
    with pytest.raises(
        DataError,
        match=r"zip:DeepDTA-master/data/davis/ligands_can.txt: sha256 .* is not davis's ligands",
    ):
        datasets.prepare("davis", archive, tmp_path / "data")
    monkeypatch.setattr(datasets, "DATASETS", {
        **datasets.DATASETS,
        "davis": datasets.dataclasses.replace(
            datasets.DATASETS["davis"], lay_out=datasets._deepdta("davis", True, (3, 4, 12), {})
        ),
    })  # fmt: skip
    dest = datasets.prepare("davis", archive, tmp_path / "data")
    assert "3 drugs, 4 proteins, 12 measured pairs; folds: 8 training pairs in 2 folds, 4 test" in (
        capsys.readouterr().out
    )
    table = molecules.load_deepdta(dest)
    assert len(table.drugs) == 3 and len(table.train_folds) == 2
    # Counts are checked: the decoy is not Davis.
    with pytest.raises(DataError, match=r"kiba: 2 drugs, 2 proteins, 4 pairs; DeepDTA's davis"):
        datasets.prepare("davis", repo / "data" / "kiba", tmp_path / "other")


def test_cifar_release_becomes_lossless_png_folders_the_recipe_reads(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    labels = np.array([3, 0, 9, 3, 1, 0], np.uint8)
    planes = pixels.transpose(0, 3, 1, 2).reshape(6, -1)
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    for i, name in enumerate([*images.CIFAR_TRAIN_FILES, images.CIFAR_TEST_FILE]):
        np.concatenate([labels[i : i + 1, None], planes[i : i + 1]], axis=1).tofile(
            folder / f"{name}.bin"
        )
    archive = tmp_path / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(folder, "cifar-10-batches-bin")
    with pytest.raises(DataError, match=r"cifar-10-binary.tar.gz: md5 .* is not cifar-10-bin"):
        datasets.prepare("cifar10", archive, tmp_path / "data")
    md5 = _sha(archive.read_bytes(), "md5")
    monkeypatch.setitem(datasets.ARCHIVE_CHECKSUMS, "cifar-10-binary.tar.gz", ("md5", md5))
    monkeypatch.setattr(datasets, "CIFAR_COUNTS", {"train": 5, "test": 1})
    dest = datasets.prepare("cifar10", archive, tmp_path / "data")
    train = images.read_folder(dest, "train", 32)
    # Folder order is by class, then file name; every image comes back bit for bit.
    order = sorted(range(5), key=lambda i: (images.CIFAR_CLASSES[labels[i]], i))
    np.testing.assert_array_equal(train.images, pixels[order])
    np.testing.assert_array_equal(train.labels, labels[order])
    assert sorted(train.classes) == list(train.classes)
    # The folders pass through prepare again as they are (a JPEG copy's layout).
    again = datasets.prepare("cifar10", dest, tmp_path / "again")
    assert len(list((again / "train").rglob("*.png"))) == 5


def test_multi30k_checks_every_file_and_its_line_counts(tmp_path, monkeypatch):
    raw = tmp_path / "dataset-master" / "data" / "task1" / "raw"
    raw.mkdir(parents=True)
    counts = {"train": 3, "val": 2, "test_2016_flickr": 1}
    for split, n in counts.items():
        for lang in ("en", "de"):
            (raw / f"{split}.{lang}.gz").write_bytes(gzip.compress(b"a line\n" * n, mtime=0))
    sha = {p.name: _sha(p.read_bytes()) for p in raw.iterdir()}
    monkeypatch.setattr(datasets, "MULTI30K_PAIRS", counts)
    monkeypatch.setattr(datasets, "MULTI30K_SHA256", {**datasets.MULTI30K_SHA256, **sha})
    dest = datasets.prepare("multi30k", tmp_path / "dataset-master", tmp_path / "data")
    assert sorted(p.name for p in dest.glob("*.gz")) == sorted(sha)
    pairs = parallel_text.read_pairs(dest, "val", "en", "de")
    assert len(pairs.sources) == 2
    (raw / "val.de.gz").write_bytes(gzip.compress(b"x\n", mtime=0))
    with pytest.raises(DataError, match=r"raw/val.de.gz: sha256 .* is not Multi30k's val.de.gz"):
        datasets.prepare("multi30k", raw, tmp_path / "data2")
    (raw / "val.de.gz").unlink()
    with pytest.raises(DataError, match=r"raw: no val.de.gz in it"):
        datasets.prepare("multi30k", raw, tmp_path / "data3")


def test_movielens_zip_and_criteo_format_and_unsafe_archives(tmp_path, monkeypatch):
    archive = tmp_path / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("ml-100k/u.data", "1\t2\t5\t881250949\n" * 3)
        for k in range(1, 6):
            z.writestr(f"ml-100k/u{k}.base", "1\t2\t5\t0\n")
            z.writestr(f"ml-100k/u{k}.test", "1\t2\t5\t0\n")
    with pytest.raises(DataError, match=r"ml-100k.zip: md5 .* is not ml-100k.zip's published"):
        datasets.prepare("ml-100k", archive, tmp_path / "data")
    md5 = _sha(archive.read_bytes(), "md5")
    monkeypatch.setitem(datasets.ARCHIVE_CHECKSUMS, "ml-100k.zip", ("md5", md5))
    with pytest.raises(DataError, match=r"u.data: 3 ratings; MovieLens-100k has 100,000"):
        datasets.prepare("ml-100k", archive, tmp_path / "data")
    assert not (tmp_path / "data").exists()  # nothing left, not even the root it made
    # A zip without the dataset's files: the message names the zip, not the scratch folder.
    empty = tmp_path / "ml-100k (1).zip"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("readme.txt", "nothing here")
    with pytest.raises(DataError, match=r"^\S+/ml-100k \(1\)\.zip: no u\.data in it"):
        datasets.prepare("ml-100k", empty, tmp_path / "empty")
    # Renamed, the official archive is still recognized by its digest, and the report says so.
    renamed = tmp_path / "download.zip"
    renamed.write_bytes(archive.read_bytes())
    monkeypatch.setattr(datasets, "DATASETS", {
        **datasets.DATASETS,
        "ml-100k": datasets.dataclasses.replace(
            datasets.DATASETS["ml-100k"], lay_out=lambda source, dest: ["laid out"]
        ),
    })  # fmt: skip
    lines = []
    datasets.prepare("ml-100k", renamed, tmp_path / "data", echo=lines.append)
    assert lines == ["  download.zip: md5 verified (the official ml-100k.zip)", "  laid out"]

    line = "\t".join(["1", *["3"] * 13, *["68fd1e64"] * 26]) + "\n"
    good = tmp_path / "criteo" / "train.txt"
    good.parent.mkdir()
    good.write_text(line * 3)
    dest = datasets.prepare("criteo", good.parent, tmp_path / "data")
    assert (dest / "train.txt").read_text() == line * 3
    good.write_text(line + "1\t2\n")
    with pytest.raises(DataError, match=r"^\S+/criteo/train.txt:2: 2 tab-separated fields; Crit"):
        datasets.prepare("criteo", good, tmp_path / "data", force=True)

    # Archive members that would land outside the scratch folder (deep enough to reach tmp_path
    # from it), absolute ones and links are refused before anything is extracted.
    escapes = [("../../../outside.txt", tarfile.REGTYPE), ("/tmp/outside.txt", tarfile.REGTYPE),
               ("link", tarfile.SYMTYPE)]  # fmt: skip
    for member, kind in escapes:
        evil = tmp_path / "evil.tar"
        with tarfile.open(evil, "w") as t:
            info = tarfile.TarInfo(member)
            info.type = kind
            info.linkname = "../../../outside.txt" if kind == tarfile.SYMTYPE else ""
            info.size = 0 if kind == tarfile.SYMTYPE else 2
            t.addfile(info, io.BytesIO(b"hi") if kind == tarfile.REGTYPE else None)
        with pytest.raises(
            DataError, match=rf"evil.tar: member '{member}' (points outside|is not)"
        ):
            datasets.prepare("tinyshakespeare", evil, tmp_path / "evil")
        assert not list(tmp_path.rglob("outside.txt")) and not (tmp_path / "evil").exists()
    # A damaged gzip is one line too.
    broken = tmp_path / "c2" / "train.txt.gz"
    broken.parent.mkdir()
    broken.write_bytes(gzip.compress(line.encode() * 50)[:-30])
    with pytest.raises(DataError, match=r"train.txt.gz: damaged or not gzip"):
        datasets.prepare("criteo", broken, tmp_path / "data2")


def test_cli_lists_prepares_and_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "missing   tinyshakespeare" in out and "data.path: data/davis  used by" in out
    assert main(["prepare", "davis", "--from", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --from nowhere: no such file or folder\n"
    (tmp_path / "input.txt").write_text("to be\n")
    monkeypatch.setattr(datasets, "SHAKESPEARE_SHA256", _sha(b"to be\n"))
    assert main(["prepare", "tinyshakespeare", "--from", "input.txt"]) == 0
    assert "ready: data/tinyshakespeare (data.path=data/tinyshakespeare/input.txt)" in (
        capsys.readouterr().out
    )
    assert main(["list"]) == 0
    assert "prepared  tinyshakespeare" in capsys.readouterr().out


def test_configs_point_where_prepare_lays_out_and_say_how_when_missing(tmp_path, monkeypatch):
    named = set()
    for d in datasets.DATASETS.values():
        for name in d.configs:
            recipe = yaml.safe_load((REPO / "configs" / name).read_text())
            assert recipe["data"]["path"] == f"data/{d.config_path}", name
            named.add(name)
    for path in (REPO / "configs").glob("*.yaml"):
        data_path = (yaml.safe_load(path.read_text()).get("data") or {}).get("path") or ""
        if data_path.startswith("data/") and not data_path.endswith("shards"):
            assert path.name in named, f"{path.name}: data.path {data_path} is no dataset's"
    # A recipe run before prepare: one line naming the key and the command that gets the data.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        hopperjax.load_config(REPO / "configs" / "dta_davis.yaml")
    message = str(info.value)
    assert message.startswith("data.path: not found: data/davis; get davis with `python -m ")
    assert "hopperjax.data prepare davis --from FILE` (FILE: downloaded from https://" in message
    assert "\n" not in message
    # Another root is named with --to; a path that is no dataset's layout gets no command.
    assert "prepare davis --from FILE --to /scratch/x`" in datasets.not_found("/scratch/x/davis")
    assert datasets.not_found("data/criteo/shards") == "not found: data/criteo/shards"
