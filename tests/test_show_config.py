"""te_flax's version, ``show_config()`` and ``python -m te_flax``: what a bug report quotes."""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import optax
import pytest

import te_flax
from te_flax._tools.show_config import fp8_gemm_is_native, native_fp8_gemm_in_hlo

ROOT = Path(__file__).resolve().parent.parent


def _config_lines() -> dict[str, str]:
    buffer = io.StringIO()
    te_flax.show_config(file=buffer)
    return dict(line.split(": ", 1) for line in buffer.getvalue().splitlines())


def test_version_is_the_package_metadata_and_pyproject_version():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert te_flax.__version__ == importlib.metadata.version("te-flax")
    assert te_flax.__version__ == pyproject["project"]["version"]


def test_changelog_has_a_section_for_this_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "Keep a Changelog" in changelog
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, flags=re.MULTILINE)
    assert headings[0] == "Unreleased", headings
    assert te_flax.__version__ in headings, headings


def test_show_config_names_versions_backend_devices_and_fp8_lowering():
    lines = _config_lines()
    assert lines["te-flax"] == te_flax.__version__
    assert lines["jax"] == jax.__version__
    assert lines["jaxlib"] == importlib.metadata.version("jaxlib")
    assert lines["flax"] == importlib.metadata.version("flax")
    assert lines["optax"] == optax.__version__
    assert lines["orbax-checkpoint"] == importlib.metadata.version("orbax-checkpoint")
    assert lines["backend"].startswith("cpu ")
    assert lines["devices"] == f"{jax.device_count()} x cpu"
    # XLA's CPU backend widens float8 operands before its GEMMs.
    assert lines["native FP8 GEMMs"].startswith("no (emulated")


def test_python_m_te_flax_prints_the_config():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    completed = subprocess.run(
        [sys.executable, "-m", "te_flax"], env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert f"te-flax: {te_flax.__version__}\n" in completed.stdout
    assert "native FP8 GEMMs: no" in completed.stdout


def test_cpu_compiles_fp8_gemms_as_widened_operands():
    assert not fp8_gemm_is_native(jax.devices("cpu")[0])


def test_hlo_reading_finds_float8_gemm_operands():
    native = """
      %a = f8e4m3fn[64,64]{1,0} parameter(0)
      %b = f8e4m3fn[64,64]{1,0} parameter(1)
      %gemm = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(%a, %b, %one, %one), TARGET
    """.replace("TARGET", 'custom_call_target="__cublas$lt$matmul$f8"')
    widened = """
      %a = f8e4m3fn[64,64]{1,0} parameter(0)
      %wide = bf16[64,64]{1,0} convert(%a)
      ROOT %dot.1 = f32[64,64]{1,0} dot(%wide, %wide), lhs_contracting_dims={1}
    """
    assert native_fp8_gemm_in_hlo(native)
    assert not native_fp8_gemm_in_hlo(widened)
    assert not native_fp8_gemm_in_hlo("")


@pytest.mark.gpu_compile
@pytest.mark.parametrize(("recipe", "native"), [("delayed", True), ("none", False)])
def test_h100_training_step_reads_as_native_fp8_exactly_when_quantized(recipe, native):
    gpu_compile = pytest.importorskip("tests.test_gpu_compile")
    hlo = gpu_compile.optimized_hlo("dense", recipe, use_bias=False)
    assert native_fp8_gemm_in_hlo(hlo) is native
