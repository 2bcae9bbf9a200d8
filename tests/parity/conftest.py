"""The parity suite's results table, printed at the end of the run (docs/parity.md)."""

from __future__ import annotations

import importlib.util

import jax
import pytest

# Imported by the tests once TransformerEngine is known to import; not a test module itself
# (the suite collects every module for doctests).
collect_ignore = ["te_reference.py"]
if importlib.util.find_spec("transformer_engine") is None:
    # Without TE (scripts/test, CI) the suite is not collected at all: nothing to skip, so
    # selections such as `-m gpu` see no parity module.
    collect_ignore_glob = ["test_*.py"]

_RESULTS: dict[tuple[str, str], dict[str, float]] = {}


@pytest.fixture
def parity_results():
    return _RESULTS


@pytest.fixture(autouse=True)
def _te_promotion_rules():
    """TE's own code mixes dtypes and ranks, which the test suite's strict rules refuse."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def pytest_collection_modifyitems(items):
    # TE warns about its own deprecated names (logical axes, defaults that will change); the
    # suite's warnings-as-errors rule is for te_flax, not for the reference.
    for item in items:
        if "tests/parity/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            # On a CPU TE takes its unfused (pure-JAX) softmax and attention, and says so.
            item.add_marker(pytest.mark.filterwarnings("ignore:Using unfused JAX"))


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    whats = ("output", "parameter gradients", "FP8 state")
    lines = [
        "| layer | recipe | " + " | ".join(whats) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in whats) + " |",
    ]
    for (case, recipe), errors in sorted(_RESULTS.items()):
        cells = " | ".join(f"{errors[w]:.1e}" if errors[w] else "0" for w in whats)
        lines.append(f"| {case} | {recipe} | {cells} |")
    terminalreporter.write_sep("=", "te_flax against TransformerEngine: worst relative error")
    terminalreporter.write_line("\n".join(lines))
