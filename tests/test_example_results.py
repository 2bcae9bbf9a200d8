"""The README's results of ``scripts/train`` are the committed report's
(``docs/example_results/report.md``), and that report is in the form the job writes today: a
figure changed in one place and not the other, or a report older than its writer, fails here.
Regenerate both with ``scripts/train`` and copy ``runs/lm/report.md``, ``runs/lm/loss.png`` and
``runs/lm/fp8_health.png`` into ``docs/example_results``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REPORT = (ROOT / "docs" / "example_results" / "report.md").read_text()


def _table(text: str) -> list[str]:
    """The first Markdown table that starts with ``| run | final train loss``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| run | final train loss"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line.strip())
    return table


def _readme_results() -> str:
    start = README.index("Results of `scripts/train`")
    return README[start : README.index("\n## ", start)]


def test_the_readme_table_is_the_committed_report_table():
    assert _table(_readme_results()) == _table(REPORT)


def test_the_readme_states_the_reports_gap_and_jax():
    gap = re.search(r"fp8 relative to bf16: ([+-][\d.]+%)", REPORT)
    assert gap is not None
    assert f"fp8 relative to bf16: {gap.group(1)}" in _readme_results()
    jax_version = re.search(r"Machine: .*jax ([\d.]+)\.", REPORT)
    assert jax_version is not None
    assert f"jax {jax_version.group(1)}" in _readme_results()


def test_the_committed_report_has_the_columns_the_job_writes():
    source = (ROOT / "examples" / "lm" / "report.py").read_text()
    header = re.search(r'"(\| run \| final train loss[^"]*)"\s*"([^"]*)"', source)
    if header is None:
        pytest.fail("examples/lm/report.py no longer writes the results table as expected")
    assert _table(REPORT)[0] == (header.group(1) + header.group(2)).strip()
