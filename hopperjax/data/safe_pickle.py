"""Pickles read without running their code: only numpy arrays and plain Python values.

``pickle.load`` calls whatever globals a file names, so a data file from the internet could run
code. Data releases that ship as pickles (DeepDTA's Davis matrix, CIFAR-10's python release) hold
numpy arrays, dicts, lists, strings and numbers: this unpickler resolves the few globals a numpy
array needs and refuses every other one.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from hopperjax.data.errors import DataError, one_line


def _reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2 without the numpy._core alias
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _frombuffer():
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:
        from numpy.core.numeric import _frombuffer
    return _frombuffer


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Python 3 pickles bytes at protocol 2 as _codecs.encode(text, "latin1"); any other codec
    # (codec lookup can import modules) is refused.
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with codec {encoding!r}")
    return text.encode("latin1")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled numpy array needs, so a pickle cannot run code."""

    def __init__(self, file, path: Path):
        super().__init__(file, encoding="latin1")  # Python 2 str -> bytes as numpy expects
        self._path = path
        self._allowed = {
            ("numpy.core.multiarray", "_reconstruct"): _reconstruct(),  # numpy 1 pickles (Davis)
            ("numpy._core.multiarray", "_reconstruct"): _reconstruct(),  # numpy 2 pickles
            ("numpy.core.numeric", "_frombuffer"): _frombuffer(),  # protocol 5
            ("numpy._core.numeric", "_frombuffer"): _frombuffer(),
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): _latin1_encode,  # array bytes, Python 3 at protocol 2
        }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._allowed:
            raise DataError(
                f"{self._path}: refused to unpickle global '{module}.{name}' "
                "(only numpy arrays are loaded from pickles)"
            )
        return self._allowed[module, name]


def load(path: str | Path) -> Any:
    """The object in a (Python 2 or 3) pickle; Python 2 strings come back as ``str`` (latin-1).

    Raises: DataError naming the file (and a refused global).
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            return _NumpyOnlyUnpickler(f, path).load()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except DataError:
        raise
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a readable pickle ({one_line(e)})") from None
