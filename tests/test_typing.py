"""The library type-checks: ``mypy --strict`` over te_flax/, configured in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_te_flax_passes_strict_mypy():
    pytest.importorskip("mypy", reason="needs the test extra")
    completed = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--config-file", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Success: no issues found" in completed.stdout


def test_package_is_marked_typed():
    assert (ROOT / "te_flax" / "py.typed").is_file()
