"""The documentation site: its Python examples run, and it builds without a warning.

Each guide's ``python`` blocks run in order in one namespace, as a reader would run them. The
build (slow) is ``scripts/docs``'s: Sphinx with ``-W -n``, so a warning, a docstring that does
not parse or a broken cross-reference fails it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import te_flax

DOCS = Path(__file__).parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.DOTALL)
PAGES_WITH_CODE = [page for page in PAGES if BLOCK.search(page.read_text())]


def _api_modules() -> list[str]:
    sys.path.insert(0, str(DOCS))
    try:
        conf = importlib.import_module("conf")
    finally:
        sys.path.remove(str(DOCS))
    return list(conf.API_MODULES)


def test_every_guide_page_has_examples():
    guides = {"getting_started", "fp8_state", "recipes", "linen_nnx", "sharding",
              "checkpointing", "porting"}  # fmt: skip
    assert guides <= {page.stem for page in PAGES_WITH_CODE}


# Pages whose examples compile several whole training steps (about a minute on 2 cores).
SLOW_PAGES = {"linen_nnx"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=[pytest.mark.slow] if page.stem in SLOW_PAGES else [])
        for page in PAGES_WITH_CODE
    ],
    ids=lambda page: page.stem,
)
def test_page_examples_run(page):
    namespace: dict = {}
    # The pages show code as users run it: with JAX's standard dtype promotion (optax's step
    # counters need it), not the test suite's strict one.
    with jax.numpy_dtype_promotion("standard"):
        for index, block in enumerate(BLOCK.findall(page.read_text())):
            exec(compile(block, f"{page.name} example {index}", "exec"), namespace)


def test_api_reference_lists_every_public_module():
    documented = set(_api_modules())
    public = {
        module.name
        for module in pkgutil.iter_modules(te_flax.__path__, "te_flax.")
        if not module.name.rsplit(".", 1)[-1].startswith("_")
    }
    assert public <= documented, f"public modules missing from docs/conf.py: {public - documented}"


@pytest.mark.slow
def test_site_builds_without_warnings(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    options = ["-b", "html", "-n", "-W", "--keep-going", "-q", "-E", "-d", str(tmp_path / "trees")]
    command = [sys.executable, "-m", "sphinx", *options, str(DOCS), str(tmp_path / "html")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    built = {path.stem for path in (tmp_path / "html" / "api").glob("*.html")}
    assert set(_api_modules()) <= built
