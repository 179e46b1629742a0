"""rlpipe/ type-checks: mypy over the package with pyproject.toml's [tool.mypy] finds no error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.slow  # about two minutes without mypy's cache
def test_mypy_finds_no_errors():
    """mypy is in the test extra (pip install -e '.[test]')."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"mypy exited {result.returncode}:\n{result.stdout}{result.stderr}"
