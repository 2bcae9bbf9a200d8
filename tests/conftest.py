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

from hypothesis import settings  # noqa: E402

# Property-based tests (tests/test_properties.py): "ci", the default, draws a fixed sequence of
# a few examples per test; HYPOTHESIS_PROFILE=long draws many more from a fresh seed each run.
settings.register_profile(
    "ci", max_examples=2, derandomize=True, deadline=None, database=None, print_blob=True
)
settings.register_profile("long", max_examples=50, deadline=None, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
