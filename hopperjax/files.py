"""Files that are whole or absent: written under a temporary name, synced, then renamed.

A crash (or a reader racing the writer) never sees half a file under the final name: run
directories (``config.yaml``, a workload's artifacts) and data conversions rely on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

# A writer's temporary file: ``.<final name>.<12 hex digits>.tmp``, the digits its own, so two
# writers of one path (two processes keeping one cache file) never write into each other's file.
# Conversions before the digits left ``.<final name>.tmp``; ``temp_target`` reads both. A writer
# killed mid-write leaves its hidden file behind: shard conversions clear their own; elsewhere
# (a run's config.yaml, the cache directory) it stays, named so, until removed by hand.
_TEMP = re.compile(r"\.(.+?)(?:\.[0-9a-f]{12})?\.tmp")


def temp_target(name: str) -> str | None:
    """The final name a temporary file of ``atomic_write`` was for; None if ``name`` is not one
    (a killed writer leaves its temporary file behind, and a conversion clears them first)."""
    match = _TEMP.fullmatch(name)
    return match.group(1) if match else None


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temp_path)``, fsync, rename onto ``path``; the temporary file never outlives it.
    Each call writes its own temporary file: of concurrent writers, the last rename wins whole."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        write(temp)
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda temp: temp.write_text(text))


def cache_dir() -> Path | None:
    """Where hopperjax keeps what it measures or probes once per machine: ``$HOPPERJAX_CACHE_DIR``
    (default ``$XDG_CACHE_HOME/hopperjax`` or ``~/.cache/hopperjax``); None without a home."""
    root = os.environ.get("HOPPERJAX_CACHE_DIR")
    if root:
        return Path(root)
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no HOME and no passwd entry (a container's --user)
        return None
    return Path(base) / "hopperjax"


def fsync_directory(path: Path) -> None:
    """Makes renames and removals in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Busy(Exception):
    """Another process holds the lock; ``pid`` is what it wrote into the lock file."""

    def __init__(self, path: Path, pid: str):
        super().__init__(f"{path} is locked by process {pid}")
        self.pid = pid


@contextlib.contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``directory`` (created if missing) while the block runs.

    The lock is ``fcntl.flock`` on ``directory/.lock``, which also holds the holder's pid; the
    kernel drops it when the holder exits, however it exits, so a killed run leaves no stale lock.

    Raises:
      Busy: another process holds it.
      OSError: the directory cannot be created or written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(directory, os.pread(fd, 32, 0).decode(errors="replace").strip()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
