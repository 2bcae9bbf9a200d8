"""The suite's shared persistent compilation cache (tests/conftest.py) cannot fail a run.

Every process of a run (the pytest-xdist workers, the examples and scripts the tests launch)
shares one cache folder. JAX writes an entry with a plain ``write_bytes``, so another process can
read it half-written, and a process killed while writing one (tests/test_checkpoint_faults.py
kills runs on purpose) leaves it truncated for good. JAX then warns ("Error reading persistent
compilation cache entry ...") and compiles the program again; the suite, whose warnings are
errors, lets that one warning through (pyproject.toml's ``filterwarnings``) instead of failing
the test that happened to read the entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run under the suite's own settings (pyproject.toml, tests/conftest.py), with a cache folder
# of its own: compile, tear every entry as a writer killed halfway would, compile again.
_TORN_ENTRY_TEST = """
import tests.conftest  # noqa: F401  (the suite's environment)

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def test_a_torn_cache_entry_is_compiled_again():
    def step(x):
        return jnp.tanh(x) * 3.0

    x = jnp.arange(8, dtype=jnp.float32)
    expected = np.tanh(np.arange(8, dtype=np.float32)) * 3.0
    np.testing.assert_allclose(jax.jit(step)(x), expected, rtol=1e-6)
    entries = [p for p in Path(CACHE).iterdir() if p.name.endswith("-cache")]
    assert entries, "the program was not written to the persistent cache"
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: len(entry.read_bytes()) // 2])
    jax.clear_caches()
    np.testing.assert_allclose(jax.jit(step)(x), expected, rtol=1e-6)
"""


def test_a_torn_cache_entry_is_compiled_again_and_the_run_passes(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    test_file = tmp_path / "test_torn_entry.py"
    test_file.write_text(f"CACHE = {str(cache)!r}\n" + textwrap.dedent(_TORN_ENTRY_TEST))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_"))}
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    command += ["--rootdir", str(ROOT), "-p", "no:xdist", "-q", "-rw", str(test_file)]
    completed = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "1 passed" in output, output[-4000:]
    # The torn entry was read (and reported), not skipped: the run saw it and went on.
    assert "Error reading persistent compilation cache entry" in output, output[-4000:]
