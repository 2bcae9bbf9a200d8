"""The release artifacts: ``python -m build`` makes an sdist and a wheel without a warning,
``twine check`` accepts them, and the wheel installed into a fresh virtual environment (not the
source tree) imports every module, runs an FP8 training step and a doctest of the package."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# What the sdist is made from: the package and the files pyproject.toml names.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in", "te_flax")


def _run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-5000:]
    return output


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """A copy of the sources, built into ``dist/``; returns the folder and the build's output."""
    work = tmp_path_factory.mktemp("release")
    source = work / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(path, source / name)
    dist = work / "dist"
    # PYTHONDONTWRITEBYTECODE, a setting of the caller's, makes distutils say it skips
    # byte-compiling; a plain build does not have it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # The default build: the sdist, then the wheel built from the unpacked sdist.
    output = _run(sys.executable, "-m", "build", "--outdir", dist, source, cwd=work, env=env)
    return dist, output


def test_build_makes_an_sdist_and_a_wheel_without_warnings(built):
    dist, output = built
    names = sorted(path.name for path in dist.iterdir())
    assert names == [f"te_flax-{VERSION}-py3-none-any.whl", f"te_flax-{VERSION}.tar.gz"], names
    # setuptools' "WARNING `project.license` as a TOML table is deprecated", Python warnings
    # (SetuptoolsDeprecationWarning, ...) and distutils' "warning:" lines.
    warnings = [line for line in output.splitlines() if re.search("warning", line, re.IGNORECASE)]
    assert not warnings, "\n".join(warnings)


def test_twine_accepts_both_artifacts(built):
    dist, _ = built
    output = _run(sys.executable, "-m", "twine", "check", "--strict", *dist.iterdir(), cwd=dist)
    assert output.count("PASSED") == 2, output


def test_artifacts_hold_the_package_license_and_type_marker(built):
    dist, _ = built
    with zipfile.ZipFile(dist / f"te_flax-{VERSION}-py3-none-any.whl") as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"te_flax-{VERSION}.dist-info/METADATA").decode()
    assert {"te_flax/__init__.py", "te_flax/py.typed", "te_flax/linen/__init__.py"} <= names
    # The NNX constructors as type checkers see them (scripts/nnx_stub).
    assert "te_flax/nnx/__init__.pyi" in names
    # The table te_flax.as_transformer_engine() reads (docs/porting.md's, as package data).
    assert "te_flax/transformer_engine_names.tsv" in names
    assert f"te_flax-{VERSION}.dist-info/licenses/LICENSE" in names
    # Only the library: no tests, examples or benchmarks.
    assert all(name.startswith(("te_flax/", f"te_flax-{VERSION}.dist-info/")) for name in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    with tarfile.open(dist / f"te_flax-{VERSION}.tar.gz") as sdist:
        members = {Path(*Path(name).parts[1:]).as_posix() for name in sdist.getnames()}
    assert {"te_flax/py.typed", "te_flax/nnx/__init__.pyi", "LICENSE", "CHANGELOG.md"} <= members
    assert "te_flax/transformer_engine_names.tsv" in members
    assert "README.md" in members


INSTALLED_CHECK = textwrap.dedent(
    """
    import doctest, importlib, pkgutil, sys
    from pathlib import Path

    import jax, jax.numpy as jnp
    import te_flax
    import te_flax.dense

    assert Path(te_flax.__file__).is_relative_to(sys.prefix), te_flax.__file__
    assert te_flax.__version__ == sys.argv[1], te_flax.__version__
    modules = [info.name for info in pkgutil.walk_packages(te_flax.__path__, "te_flax.")]
    for name in modules:
        if name != "te_flax.__main__":
            importlib.import_module(name)

    from te_flax.layernorm_dense import layernorm_dense
    from te_flax.quantize import DelayedScaling, QuantizerFactory

    x = jax.random.normal(jax.random.key(0), (4, 16, 32), jnp.bfloat16)
    params = (jax.random.normal(jax.random.key(1), (32, 64)) * 0.1, jnp.ones(32), jnp.zeros(32))
    state = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))

    def loss(params, state):
        y = layernorm_dense(x, *params, quantizer_set=state)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    value, (grads, state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, state)
    assert jnp.isfinite(value) and all(jnp.isfinite(g).all() for g in grads)
    assert float(state.x.amax_history[0]) > 0 and float(state.dgrad.amax_history[0]) > 0

    failed, attempted = doctest.testmod(te_flax.dense)
    assert attempted > 0 and failed == 0, (failed, attempted)
    print(f"imported {len(modules)} modules; fp8 step loss {float(value):.4f}; doctests ok")
    """
)


def test_wheel_installed_in_a_fresh_venv_imports_trains_and_runs_a_doctest(built, tmp_path):
    dist, _ = built
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run(python, "-c", purelib, cwd=tmp_path).strip().splitlines()[-1])
    # The dependencies (jax, flax, ...) come from this environment's site-packages, listed after
    # the fresh one's: te_flax itself comes from the wheel, and the source tree is not on the path.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = dist / f"te_flax-{VERSION}-py3-none-any.whl"
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    check = tmp_path / "check.py"
    check.write_text(INSTALLED_CHECK)
    output = _run(python, check, VERSION, cwd=tmp_path, env=env)
    assert "doctests ok" in output
    config = _run(python, "-m", "te_flax", cwd=tmp_path, env=env)
    assert f"te-flax: {VERSION}\n" in config
