"""Files that are whole or absent: written under a temporary name, synced, then renamed.

A crash (or a reader racing the writer) never sees half a file under the final name: run
directories (``config.yaml``, a workload's artifacts) and data conversions rely on it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temp_path)``, fsync, rename onto ``path``; the temporary file never outlives it."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.tmp")
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


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically, creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda temp: temp.write_text(text))


def fsync_directory(path: Path) -> None:
    """Makes renames and removals in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
