"""``te_flax.show_config()``: the versions, backend and devices a bug report needs.

``python -m te_flax`` prints the same. Whether FP8 GEMMs lower natively is not guessed from the
device name: a small float8 GEMM is compiled for the default backend and its optimized HLO is
read, so the answer is what XLA does with te_flax's GEMM form on this machine and jaxlib.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import TextIO

import jax
import jax.numpy as jnp
from jax import lax

from te_flax._base.jax_compat import TESTED_RANGE, outside_tested_range
from te_flax._tools.hlo import native_fp8_gemm

__all__ = ["fp8_gemm_is_native", "native_fp8_gemm_in_hlo", "show_config"]

_PACKAGES = ("te-flax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def native_fp8_gemm_in_hlo(hlo_text: str) -> bool:
    """Whether optimized HLO holds a GEMM that reads float8 operands as they are.

    A GEMM is a ``dot`` or a GEMM custom call (cuBLASLt's ``__cublas$lt$matmul$f8``); it is
    native when one of its two operands has a float8 type. Emulation widens the operands with
    ``convert`` first, so its GEMMs read bf16 or f32.
    """
    return native_fp8_gemm(hlo_text)


def fp8_gemm_is_native(device: jax.Device | None = None) -> bool:
    """Whether te_flax's FP8 GEMM (two float8_e4m3fn operands, bf16 output) compiles to a
    GEMM on float8 operands on ``device`` (default: the first device of the default backend)."""
    device = device or jax.devices()[0]
    operand = jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn)

    def gemm(a: jax.Array, b: jax.Array) -> jax.Array:
        # [64, 64] x [64, 64] -> [64, 64], contracting a's last axis with b's first.
        dimensions = (((1,), (0,)), ((), ()))
        return lax.dot_general(a, b, dimensions, preferred_element_type=jnp.bfloat16)

    with jax.default_device(device):
        compiled = jax.jit(gemm).lower(operand, operand).compile()
    return native_fp8_gemm_in_hlo(compiled.as_text() or "")


def show_config(file: TextIO | None = None) -> None:
    """Prints the versions of te_flax and its dependencies, the platform, the default backend,
    its devices and whether FP8 GEMMs lower natively on them: paste it into a bug report.

    Args:
      file: where to print (default: standard output).
    """
    out = file or sys.stdout
    lines = [f"{package}: {_version(package)}" for package in _PACKAGES]
    lines.append(f"python: {platform.python_version()} ({sys.implementation.name})")
    outside = outside_tested_range()
    tested = ", ".join(f"{p} {low} to {high}.x" for p, (low, high) in TESTED_RANGE.items())
    lines.append(f"tested range: {'no: ' + '; '.join(outside) if outside else 'yes'} ({tested})")
    lines.append(f"platform: {platform.platform()}")
    backend = jax.default_backend()
    devices = jax.devices()
    kinds = sorted({device.device_kind for device in devices})
    lines.append(f"backend: {backend} (platform version: {_platform_version()})")
    lines.append(f"devices: {len(devices)} x {', '.join(kinds)}")
    capabilities = sorted({str(getattr(device, "compute_capability", "")) for device in devices})
    if any(capabilities):
        lines.append(f"compute capability: {', '.join(capabilities)}")
    try:
        native = "yes" if fp8_gemm_is_native(devices[0]) else "no (emulated: operands widened)"
    except Exception as error:  # a backend that cannot compile float8 at all
        native = f"no (the FP8 GEMM does not compile: {type(error).__name__}: {error})"
    lines.append(f"native FP8 GEMMs: {native}")
    print("\n".join(lines), file=out)


def _platform_version() -> str:
    try:
        return str(jax.devices()[0].client.platform_version).strip()
    except Exception:  # not every backend reports one
        return "unknown"
