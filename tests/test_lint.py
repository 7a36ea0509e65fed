"""ruff is part of the test command: the code base stays lint-clean."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO


def test_ruff_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it comes with the 'test' extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
