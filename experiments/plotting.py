"""The one matplotlib loader of the experiment scripts: headless, and optional."""

from __future__ import annotations

import sys
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "plot skipped: matplotlib is not installed (pip install -e '.[tools]')", file=sys.stderr
        )
        return None
    return plt
