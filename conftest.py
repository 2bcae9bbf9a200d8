"""Runs the doctests of te_flax in the test suite's environment (see tests/conftest.py)."""

import tests.conftest  # noqa: F401
