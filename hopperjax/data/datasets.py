"""The public datasets the recipes use: where to download each, how to check it, where it goes.

``python -m hopperjax.data prepare NAME --from PATH`` takes what a user downloaded (the official
archive, a file, or a folder holding one of them), checks it (the published checksum where one
exists, always the structure: counts, shapes, formats), and lays it out under ``data/NAME`` in
the current directory, which is where ``configs/*.yaml`` point ``data.path``. Nothing is
downloaded: hopperjax never reaches the network at run time. The layout appears whole or not at
all: it is built under a temporary name and renamed, with a ``PREPARED.json`` recording the
source, every file's sha256 and the counts.

Each dataset is a ``Dataset``: its name, the URL to download from, and a ``lay_out(source,
dest)`` that finds its files in ``source`` (an extracted archive or a folder), verifies them, and
writes them into ``dest``, returning the lines of its report.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import gzip
import json
import os
import shutil
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from hopperjax.data.errors import DataError
from hopperjax.files import digest

DEFAULT_ROOT = "data"
MANIFEST = "PREPARED.json"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One public dataset.

    ``download``: what to fetch and from where (shown by ``list`` and in every missing-data
    message). ``config_path``: ``data.path`` relative to the data root, as the configs name it.
    ``checksum``: how the download is verified, in words (the values live in the module's
    tables). ``lay_out(source, dest) -> report lines``.
    """

    name: str
    what: str
    download: str
    config_path: str
    checksum: str
    lay_out: Callable[[Path, Path], list[str]]
    configs: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Checks shared by the datasets


def verify(path: Path, algorithm: str, expected: str, what: str) -> None:
    """Raises a one-line DataError naming ``path`` when its digest is not ``expected``."""
    got = digest(path, algorithm)
    if got != expected:
        raise DataError(
            f"{path}: {algorithm} {got} is not {what}'s published {expected} (a different "
            "version, or a damaged download: fetch it again)"
        )


def _find(root: Path, name: str, *, prefer: str | None = None) -> Path | None:
    """The file or folder called ``name`` at or under ``root``: ``root`` itself, else the
    shallowest match (one under a folder called ``prefer`` first)."""
    if root.name == name:
        return root
    hits = sorted(root.rglob(name), key=lambda p: (len(p.parts), str(p)))
    if prefer is not None:
        preferred = [p for p in hits if prefer in p.relative_to(root).parts[:-1]]
        hits = preferred or hits
    return hits[0] if hits else None


def _only_file(root: Path) -> Path | None:
    """The one file ``root`` holds (a download given by its own name), else None."""
    files = [p for p in root.iterdir() if p.is_file()] if root.is_dir() else []
    return files[0] if len(files) == 1 else None


def _require(root: Path, name: str, what: str, *, prefer: str | None = None) -> Path:
    found = _find(root, name, prefer=prefer)
    if found is None:
        raise DataError(f"{root}: no {name} in it (is this {what}?)")
    return found


_LINK: contextvars.ContextVar[bool] = contextvars.ContextVar("link", default=False)


def _copy(source: Path, dest: Path) -> None:
    """Copies (``prepare(link=True)``: hard-links where the file system allows)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    source = source.resolve()  # a plain-file download is reached through a symlink: the file
    if _LINK.get():
        try:
            os.link(source, dest)
            return
        except OSError:
            pass
    shutil.copyfile(source, dest)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A damaged or mislabelled compressed file as a one-line DataError naming it."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: damaged or not gzip ({e or type(e).__name__})") from None


def _count_lines(path: Path) -> int:
    opener = gzip.open if path.name.endswith(".gz") else open
    with _reading(path), opener(path, "rb") as f:
        return sum(1 for _ in f)


# ---------------------------------------------------------------------------------------------
# Tiny Shakespeare

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def _shakespeare(source: Path, dest: Path) -> list[str]:
    text = _find(source, "input.txt") or _only_file(source)
    if text is None:
        raise DataError(f"{source}: no input.txt in it (is this Tiny Shakespeare's input.txt?)")
    verify(text, "sha256", SHAKESPEARE_SHA256, "Tiny Shakespeare")
    _copy(text, dest / "input.txt")
    chars = text.read_text(encoding="utf-8")
    return [f"input.txt: {len(chars):,} characters, {len(set(chars))} distinct (sha256 verified)"]


# ---------------------------------------------------------------------------------------------
# Davis and KIBA (DeepDTA's format)

DEEPDTA_FILES = ("ligands_can.txt", "proteins.txt", "Y", "folds/train_fold_setting1.txt",
                 "folds/test_fold_setting1.txt")  # fmt: skip
DEEPDTA_OPTIONAL = ("ligands_iso.txt",)
DAVIS_SHA256 = {
    "Y": "9855c4f234ec6dd18295b0e0cd6ee54214cafa908c6eb1d447b47d454fc0294a",
    "ligands_can.txt": "141094d99510a52091d2ea1b05be7c1f66b2c5fcaeeeb261eaf4cbf2128bde6d",
    "ligands_iso.txt": "58b3cd168ed12962eb856e4e4e5dab1abbd42d6c0912eed2b9987bf578c7fafd",
    "proteins.txt": "187cedeee10cd3b58af915a2861a5ed0c4ff42a2d728f4dea5e0b47e3d75b291",
    "folds/test_fold_setting1.txt": (
        "c97589fa2fae318b01870854af0ab6fdd155dd38524cc6ac1d0319418ac6d568"
    ),
    "folds/train_fold_setting1.txt": (
        "bb7a63b2178c40a4e2417bc701b95511407787fa5eabb6a43a695fe6bd722f56"
    ),
}
DAVIS_SHAPE = (68, 442, 30_056)
KIBA_SHAPE = (2_111, 229, 118_254)


def _deepdta(name: str, pkd: bool, shape: tuple[int, int, int], sha256: dict[str, str]):
    def lay_out(source: Path, dest: Path) -> list[str]:
        from hopperjax.data import molecules

        ligands = _require(source, "ligands_can.txt", f"DeepDTA's {name} folder", prefer=name)
        folder = ligands.parent
        for rel in DEEPDTA_FILES:
            if not (folder / rel).is_file():
                raise DataError(f"{folder}: no {rel} in it (is this DeepDTA's {name} folder?)")
        names = DEEPDTA_FILES + tuple(r for r in DEEPDTA_OPTIONAL if (folder / r).is_file())
        for rel in names:
            if rel in sha256:
                verify(folder / rel, "sha256", sha256[rel], f"{name}'s {rel}")
            _copy(folder / rel, dest / rel)
        table = molecules.load_deepdta(dest, pkd=pkd)
        got = (len(table.drugs), len(table.proteins), len(table.affinity))
        if got != shape:
            raise DataError(
                f"{folder}: {got[0]:,} drugs, {got[1]:,} proteins, {got[2]:,} pairs; DeepDTA's "
                f"{name} has {shape[0]:,}, {shape[1]:,}, {shape[2]:,}"
            )
        train = sum(len(f) for f in table.train_folds)
        checked = "sha256 verified" if sha256 else "no published checksum: checked by its counts"
        return [
            f"{got[0]:,} drugs, {got[1]:,} proteins, {got[2]:,} measured pairs; folds: "
            f"{train:,} training pairs in {len(table.train_folds)} folds, {len(table.test_fold):,} "
            f"test ({checked})"
        ]

    return lay_out


# ---------------------------------------------------------------------------------------------
# CIFAR-10

CIFAR_MD5 = {  # the archives on https://www.cs.toronto.edu/~kriz/cifar.html
    "cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530",
    "cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a",
}
CIFAR_COUNTS = {"train": 50_000, "test": 10_000}


def _cifar(source: Path, dest: Path) -> list[str]:
    """Either official release becomes lossless PNG folders (``split/class/NNNNN.png``), the
    layout of ``configs/cifar10_resnet.yaml`` (``data.source: folder``); image folders in that
    layout (a JPEG copy, say) are copied as they are, checked by their counts."""
    from PIL import Image

    from hopperjax.data import images

    release = None
    for folder, binary in (("cifar-10-batches-bin", True), ("cifar-10-batches-py", False)):
        found = _find(source, folder)
        if found is not None:
            release = (found, binary)
            break
    if release is None:
        train = _find(source, "train")
        if train is None or not (train.parent / "test").is_dir():
            raise DataError(
                f"{source}: neither an official CIFAR-10 release (cifar-10-batches-bin or "
                "-py) nor train/ and test/ image folders"
            )
        lines = []
        for split, count in CIFAR_COUNTS.items():
            classes = images.folder_classes(train.parent, split)
            files, _ = images.list_folder(train.parent, split, classes)
            if len(classes) != 10 or len(files) != count:
                raise DataError(
                    f"{train.parent / split}: {len(classes)} classes, {len(files):,} images; "
                    f"CIFAR-10's {split} split has 10 classes, {count:,} images"
                )
            for f in files:
                _copy(f, dest / split / f.parent.name / f.name)
            lines.append(f"{split}: {count:,} images in 10 classes (image folders, copied)")
        return [*lines, "no published checksum for image folders: checked by their counts"]
    root, binary = release
    lines = []
    for split, count in CIFAR_COUNTS.items():
        data = images.read_cifar(root, split, binary=binary)
        if len(data) != count:
            raise DataError(f"{root}: {len(data):,} {split} images; CIFAR-10 has {count:,}")
        for name in data.classes:
            (dest / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(len(data)):
            name = data.classes[int(data.labels[i])]
            Image.fromarray(data.images[i]).save(dest / split / name / f"{i:05d}.png")
        lines.append(f"{split}: {count:,} images in 10 classes, written as PNG (lossless)")
    return lines


# ---------------------------------------------------------------------------------------------
# Multi30k

MULTI30K_SHA256 = {  # data/task1/raw/ of github.com/multi30k/dataset, commit a3d2e0d2
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
}
MULTI30K_REQUIRED = ("train", "val", "test_2016_flickr")
MULTI30K_PAIRS = {"train": 29_000, "val": 1_014, "test_2016_flickr": 1_000}


def _multi30k(source: Path, dest: Path) -> list[str]:
    first = _require(source, "train.en.gz", "Multi30k's data/task1/raw folder", prefer="raw")
    folder, lines = first.parent, []
    for name, sha in MULTI30K_SHA256.items():
        split = name.split(".")[0]
        if not (folder / name).is_file():
            if split in MULTI30K_REQUIRED:
                raise DataError(f"{folder}: no {name} in it (Multi30k's data/task1/raw has it)")
            continue
        verify(folder / name, "sha256", sha, f"Multi30k's {name}")
        _copy(folder / name, dest / name)
    for split, pairs in MULTI30K_PAIRS.items():
        counts = [_count_lines(dest / f"{split}.{lang}.gz") for lang in ("en", "de")]
        lines.append(f"{split}: {counts[0]:,} English / {counts[1]:,} German lines")
        if counts != [pairs, pairs]:
            raise DataError(f"{folder}: {split} has {counts} lines; Multi30k's has {pairs:,}")
    return [*lines, "sha256 verified"]


# ---------------------------------------------------------------------------------------------
# MovieLens-100k

ML100K_MD5 = "0e33842e24a9c977be4e0107933c0723"  # https://files.grouplens.org/.../ml-100k.zip.md5


def _movielens(source: Path, dest: Path) -> list[str]:
    ratings = _require(source, "u.data", "MovieLens-100k's ml-100k folder")
    folder = ratings.parent
    needed = ["u.data"] + [f"u{k}.{s}" for k in range(1, 6) for s in ("base", "test")]
    for name in needed:
        if not (folder / name).is_file():
            raise DataError(f"{folder}: no {name} in it (MovieLens-100k's ml-100k has it)")
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            _copy(path, dest / path.name)
    count = _count_lines(dest / "u.data")
    if count != 100_000:
        raise DataError(f"{folder / 'u.data'}: {count:,} ratings; MovieLens-100k has 100,000")
    return [f"u.data: {count:,} ratings; folds u1..u5 (base/test)"]


# ---------------------------------------------------------------------------------------------
# Criteo (Kaggle display advertising challenge)

CRITEO_FIELDS = 40  # label, 13 integer features, 26 categorical


def _criteo(source: Path, dest: Path) -> list[str]:
    found = _find(source, "train.txt") or _find(source, "train.txt.gz") or _only_file(source)
    if found is None:
        raise DataError(f"{source}: no train.txt in it (is this Criteo's Kaggle release?)")
    opener = gzip.open if found.name.endswith(".gz") else open
    with _reading(found), opener(found, "rb") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != CRITEO_FIELDS:
                raise DataError(
                    f"{found}:{number}: {len(fields)} tab-separated fields; Criteo's lines have "
                    f"{CRITEO_FIELDS} (label, 13 integers, 26 categories)"
                )
            if number == 1000:
                break
    name = "train.txt.gz" if found.name.endswith(".gz") else "train.txt"
    _copy(found, dest / name)
    return [f"{name}: the first {number:,} lines have Criteo's 40 fields (no published "
            "checksum: checked by its format)"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The registry

DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset(
            "tinyshakespeare",
            "1.1 MB of Shakespeare (char-rnn; nanoGPT's shakespeare_char)",
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
            "input.txt",
            "tinyshakespeare/input.txt",
            f"sha256 {SHAKESPEARE_SHA256}",
            _shakespeare,
            ("shakespeare_char_cpu.yaml",),
        ),
        Dataset(
            "davis",
            "Davis kinase affinities, DeepDTA format (68 drugs x 442 proteins)",
            "https://github.com/hkmztrk/DeepDTA (data/davis; the repository's zip will do)",
            "davis",
            "sha256 of each file (in hopperjax/data/datasets.py, DAVIS_SHA256)",
            _deepdta("davis", True, DAVIS_SHAPE, DAVIS_SHA256),
            ("dta_davis.yaml", "dta_davis_gin.yaml"),
        ),
        Dataset(
            "kiba",
            "KIBA scores, DeepDTA format (2,111 drugs x 229 proteins)",
            "https://github.com/hkmztrk/DeepDTA (data/kiba; the repository's zip will do)",
            "kiba",
            "none published: checked by its counts (2,111 / 229 / 118,254)",
            _deepdta("kiba", False, KIBA_SHAPE, {}),
        ),
        Dataset(
            "cifar10",
            "CIFAR-10, 60,000 32x32 images in 10 classes",
            "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz (or -python.tar.gz)",
            "cifar10",
            "md5 " + " / ".join(CIFAR_MD5.values()) + " (binary / python)",
            _cifar,
            ("cifar10_resnet.yaml", "cifar10_resnet18.yaml", "cifar10_airbench.yaml"),
        ),
        Dataset(
            "multi30k",
            "Multi30k task 1, English-German, raw text",
            "https://github.com/multi30k/dataset (data/task1/raw; the repository's zip will do)",
            "multi30k",
            "sha256 of each .gz (MULTI30K_SHA256)",
            _multi30k,
            ("multi30k_t5.yaml", "t5_base.yaml"),
        ),
        Dataset(
            "ml-100k",
            "MovieLens-100k, 100,000 ratings, 943 users x 1,682 movies",
            "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
            "ml-100k",
            f"md5 {ML100K_MD5}",
            _movielens,
            ("ratings_mf.yaml", "ratings_dlrm.yaml"),
        ),
        Dataset(
            "criteo",
            "Criteo's Kaggle display-advertising logs (45M clicks, 11 GB)",
            "https://ailab.criteo.com/ressources/ (Kaggle Display Advertising Challenge, "
            "dac.tar.gz)",
            "criteo/train.txt",
            "none published: checked by its format",
            _criteo,
            ("dlrm_criteo.yaml",),
        ),
    )
}
ARCHIVE_CHECKSUMS = {  # a downloaded archive's file name -> (algorithm, digest)
    **{name: ("md5", md5) for name, md5 in CIFAR_MD5.items()},
    "ml-100k.zip": ("md5", ML100K_MD5),
}


def get(name: str) -> Dataset:
    if name not in DATASETS:
        raise DataError(f"unknown dataset '{name}'; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def prepare_command(dataset: Dataset, root: str = DEFAULT_ROOT) -> str:
    to = "" if Path(root) == Path(DEFAULT_ROOT) else f" --to {root}"
    return f"python -m hopperjax.data prepare {dataset.name} --from FILE{to}"


def not_found(path: str | os.PathLike) -> str:
    """The message for a ``data.path`` that does not exist: where it is a dataset's layout
    (``ROOT/<config_path>``), how to get it, ``--to ROOT`` included (one line)."""
    parts = Path(path).parts
    for d in DATASETS.values():
        tail = Path(d.config_path).parts
        if len(parts) > len(tail) and parts[-len(tail) :] == tail:
            root = str(Path(*parts[: -len(tail)]))
            return (
                f"not found: {path}; get {d.name} with `{prepare_command(d, root)}` "
                f"(FILE: downloaded from {d.download})"
            )
    return f"not found: {path}"


# ---------------------------------------------------------------------------------------------
# Preparing


def _archive_members(archive: tarfile.TarFile | zipfile.ZipFile, source: Path) -> None:
    """Refuses members that would land outside the extraction folder, or are not plain."""
    if isinstance(archive, tarfile.TarFile):
        members = [(m.name, m.isfile() or m.isdir()) for m in archive.getmembers()]
    else:
        members = [(name, True) for name in archive.namelist()]
    for name, plain in members:
        p = Path(name)
        if p.is_absolute() or ".." in p.parts:
            raise DataError(f"{source}: member {name!r} points outside the archive; not extracted")
        if not plain:
            raise DataError(f"{source}: member {name!r} is not a plain file; not extracted")


@contextlib.contextmanager
def _opened(source: Path, scratch: Path, notes: list[str]) -> Iterator[Path]:
    """``source`` as a folder: an archive (.zip, .tar[.gz]) is extracted into ``scratch``; a
    folder or a plain file is used where it lies (a file through a folder holding only it).

    An archive named like an official one must have its published digest; one named otherwise
    is recognized by its digest when it has one (a renamed download); ``notes`` says which.
    """
    if source.is_dir():
        yield source
        return
    name = source.name
    if name in ARCHIVE_CHECKSUMS:
        algorithm, expected = ARCHIVE_CHECKSUMS[name]
        verify(source, algorithm, expected, name)
        notes.append(f"{name}: {algorithm} verified")
    elif name.endswith((".zip", ".tar", ".tar.gz", ".tgz")):
        md5 = digest(source, "md5")
        known = [n for n, (a, d) in ARCHIVE_CHECKSUMS.items() if a == "md5" and d == md5]
        notes.append(
            f"{name}: md5 verified (the official {known[0]})"
            if known
            else f"{name}: not an archive with a published checksum"
        )
    if name.endswith(".zip"):
        try:
            with zipfile.ZipFile(source) as z:
                _archive_members(z, source)
                z.extractall(scratch)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise DataError(f"{source}: not a readable zip ({e})") from None
        yield scratch
    elif name.endswith((".tar", ".tar.gz", ".tgz")):
        try:
            with tarfile.open(source) as t:
                _archive_members(t, source)
                if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuses what we do too
                    t.extractall(scratch, filter="data")
                else:
                    t.extractall(scratch)
        except tarfile.FilterError as e:
            raise DataError(f"{source}: member refused ({e}); not extracted") from None
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"{source}: not a readable tar archive ({e})") from None
        yield scratch
    else:
        (scratch / name).symlink_to(source.resolve())
        yield scratch


def prepare(
    name: str, source: str | os.PathLike, root: str | os.PathLike = DEFAULT_ROOT, *,
    force: bool = False, link: bool = False, echo: Callable[[str], object] = print,
) -> Path:  # fmt: skip
    """Checks ``source`` and lays ``name`` out under ``root/name``; returns that folder.

    Files are copied (``link``: hard-linked where the file system allows, so the layout shares
    them with the download). ``force`` replaces a layout ``prepare`` made; a folder it did not
    make is never touched.

    Raises DataError (one line, naming the file) for a missing or wrong source, a checksum
    mismatch, wrong counts, a layout already there (unless ``force``), or a folder in the way.
    """
    dataset = get(name)
    source, root = Path(source), Path(root)
    if not source.exists():
        raise DataError(f"--from {source}: no such file or folder")
    dest = root / dataset.name
    if dest.exists() or dest.is_symlink():
        if not (dest / MANIFEST).is_file():
            raise DataError(
                f"{dest}: exists and was not made by prepare (no {MANIFEST}); move it away, or "
                "prepare into another --to"
            )
        if not force:
            raise DataError(f"{dest}: already prepared (--force lays it out again)")
        if source.resolve().is_relative_to(dest.resolve()):
            raise DataError(f"--from {source}: inside {dest}, which --force would replace")
    if root.exists() and not root.is_dir():
        raise DataError(f"--to {root}: not a folder")
    made_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{dataset.name}.") as scratch:
            scratch = Path(scratch)
            build, unpacked = scratch / "build", scratch / "source"
            build.mkdir()
            unpacked.mkdir()
            notes: list[str] = []
            with _opened(source, unpacked, notes) as folder:
                token = _LINK.set(link)
                try:
                    report = notes + dataset.lay_out(folder, build)
                except DataError as e:  # name the download, not the scratch folder it opened in
                    message = str(e).replace(str(unpacked / source.name), str(source))
                    message = message.replace(f"{unpacked}/", f"{source}:")
                    raise DataError(message.replace(str(unpacked), str(source))) from None
                finally:
                    _LINK.reset(token)
            (build / MANIFEST).unlink(missing_ok=True)  # a source's own is not this layout's
            files = {
                str(p.relative_to(build)): digest(p)
                for p in sorted(build.rglob("*"))
                if p.is_file() and dataset.name != "cifar10"  # 60,000 images: counts say enough
            }
            manifest = {
                "dataset": dataset.name,
                "source": str(source.resolve()),
                "prepared": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "linked": link,
                "report": report,
                "sha256": files,
            }
            (build / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if dest.exists():  # --force on a layout prepare made: set aside, then replaced
                os.replace(dest, scratch / "old")
            os.replace(build, dest)
    except BaseException:
        if made_root and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise
    for line in report:
        echo(f"  {line}")
    return dest


def status(root: str | os.PathLike = DEFAULT_ROOT) -> list[tuple[Dataset, bool]]:
    """Each dataset and whether ``root/name`` holds a prepared layout."""
    return [(d, (Path(root) / d.name / MANIFEST).is_file()) for d in DATASETS.values()]


__all__ = ["DATASETS", "Dataset", "get", "not_found", "prepare", "status", "verify"]
