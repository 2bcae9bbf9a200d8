"""The two commands' environment handling: a virtual environment is one of the interpreter it
is announced as, or it is made again (``scripts/check_venv``, used by ``scripts/_env.sh``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _fake_venv(path: Path, version: str) -> Path:
    """A folder shaped like a venv whose ``bin/python`` says it is Python ``version``."""
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho {version}\n")
    python.chmod(0o755)
    (path / ".te_flax-test").touch()  # an install stamp, as a made environment has
    return path


def _check(venv: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / "check_venv"), str(venv), sys.executable],
        capture_output=True, text=True, check=True,
    )  # fmt: skip


def test_a_venv_of_another_python_is_made_again_with_a_word(tmp_path):
    venv = _fake_venv(tmp_path / ".venv", "3.11" if THIS != "3.11" else "3.13")
    result = _check(venv)
    assert not venv.exists()
    assert f"but this run uses Python {THIS}" in result.stderr
    assert "making" in result.stderr


def test_a_venv_of_the_same_python_is_kept_quietly(tmp_path):
    venv = _fake_venv(tmp_path / ".venv", THIS)
    result = _check(venv)
    assert (venv / ".te_flax-test").exists()
    assert result.stderr == ""


def test_a_venv_whose_interpreter_is_gone_is_made_again(tmp_path):
    venv = _fake_venv(tmp_path / ".venv", THIS)
    (venv / "bin" / "python").unlink()
    result = _check(venv)
    assert not venv.exists()
    assert "does not run" in result.stderr


def test_every_script_sets_up_its_environment_through_the_check():
    env = (ROOT / "scripts" / "_env.sh").read_text()
    assert 'scripts/check_venv "$VENV" "$PYTHON"' in env
    # The suite's header reads the versions inside the activated environment, not the
    # interpreter it was asked for.
    test = (ROOT / "scripts" / "test").read_text()
    assert "$(stack) in .venv" in test and "$(stack) in .venv-oldest" in test
