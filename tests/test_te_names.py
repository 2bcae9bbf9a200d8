"""docs/porting.md gives every public TransformerEngine JAX name a status: ``same`` (importable
from te_flax at the same path, TE's ``flax`` being ``te_flax.linen`` and TE's recipes
``te_flax.quantize``), ``different`` (how), ``refused`` (why) or ``missing`` (not yet there).

The names are TE 2.20.2's, kept in ``tests/data/te_public_names.txt`` (the parity suite checks
the list against TE itself, and the "same" names' arguments).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NAMES_FILE = ROOT / "tests" / "data" / "te_public_names.txt"
PORTING = ROOT / "docs" / "porting.md"
SECTION = "## Every TransformerEngine JAX name"
STATUSES = ("same", "different", "refused", "missing")
ROW = re.compile(r"^\| `([^`]+)` \| (\w+) \| (.*) \|$")
# TE's module prefixes and te_flax's, most specific first.
PATHS = (
    ("transformer_engine.jax.flax", "te_flax.linen"),
    ("transformer_engine.common.recipe", "te_flax.quantize"),
    ("transformer_engine.jax", "te_flax"),
)


def read_names() -> list[str]:
    lines = NAMES_FILE.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def status_rows() -> dict[str, tuple[str, str]]:
    """The table of the section: TE name (or ``module.*``) -> (status, note)."""
    text = PORTING.read_text()
    assert SECTION in text, f"docs/porting.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            name, status, note = match.groups()
            assert name not in rows, f"{name} has two rows"
            rows[name] = (status, note.strip())
    return rows


def te_flax_path(te_name: str) -> str:
    for theirs, ours in PATHS:
        if te_name == theirs or te_name.startswith(theirs + "."):
            return ours + te_name[len(theirs) :]
    raise AssertionError(f"{te_name} is not a TransformerEngine JAX name")


def resolve(path: str) -> Any:
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _status(name: str, rows: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """A name's own row, else the row of the innermost ``module.*`` that covers it."""
    if name in rows:
        return rows[name]
    module = name
    while "." in module:
        module = module.rpartition(".")[0]
        if f"{module}.*" in rows:
            return rows[f"{module}.*"]
    return None


def test_every_name_has_a_status():
    rows = status_rows()
    names = read_names()
    assert len(names) == len(set(names)) and len(names) > 300
    missing = [name for name in names if _status(name, rows) is None]
    assert not missing, f"docs/porting.md has no status for {missing}"
    wrong = {name: status for name, (status, _) in rows.items() if status not in STATUSES}
    assert not wrong, f"statuses must be one of {STATUSES}: {wrong}"
    stale = [row for row in rows if not row.endswith(".*") and row not in names]
    assert not stale, f"rows for names TE does not have: {stale}"
    for row, (status, note) in rows.items():
        if row.endswith(".*"):
            assert status != "same", f"{row}: a module row cannot say 'same'"
            assert any(name.startswith(row[:-1]) for name in names), f"{row} covers no name"
        if status != "same":
            assert note, f"{row} is {status}: say how or why"


def test_same_names_import_from_te_flax_at_tes_path():
    rows = status_rows()
    failures = {}
    for name, (status, _) in rows.items():
        if status != "same":
            continue
        try:
            resolve(te_flax_path(name))
        except (ImportError, AttributeError) as error:
            failures[name] = f"{te_flax_path(name)}: {error}"
    assert not failures, failures


def test_missing_names_are_still_missing():
    """A name marked missing that te_flax now has at TE's path gets its real status."""
    present = []
    for name, (status, _) in status_rows().items():
        if status != "missing":
            continue
        try:
            resolve(te_flax_path(name))
        except (ImportError, AttributeError):
            continue
        present.append(name)
    assert not present, f"te_flax now has {present}: mark them same (or different) in porting.md"
