"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_and_prints_what_it_shows(index, capsys):
    exec(compile(BLOCKS[index], f"README.md example {index}", "exec"), {})
    # A reader who pastes an example sees its result, not a silent prompt.
    assert capsys.readouterr().out.strip(), f"README.md example {index} prints nothing"
