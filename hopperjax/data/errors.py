"""The error every data source raises for bad input data."""


class DataError(ValueError):
    """Bad input data; the one-line message names the file and the record (id, line, pair,
    image)."""


def one_line(text: object) -> str:
    """``text`` with its whitespace runs (newlines included) folded to single spaces."""
    return " ".join(str(text).split())
