"""Test environment: 8 CPU devices, strict dtype and rank promotion, warnings as errors.

The environment variables must be set before JAX initialises a backend, so this module does it
on import; the repository's top-level conftest.py imports it too, so the doctests of te_flax
run under the same rules.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    # Deviceless GPU compiles have no autotuner; without this XLA hands FP8 dots to Triton.
    "--xla_gpu_enable_triton_gemm=false",
)
_existing = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_existing, *(f for f in _FLAGS if f not in _existing)]).strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
