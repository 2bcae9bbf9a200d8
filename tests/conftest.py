"""Test environment: 8 CPU devices, strict dtype and rank promotion, warnings as errors.

The environment variables must be set before JAX initialises a backend, so this module does it
on import; the repository's top-level conftest.py imports it too, so the doctests of te_flax
run under the same rules.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    # Deviceless GPU compiles have no autotuner; without this XLA hands FP8 dots to Triton.
    "--xla_gpu_enable_triton_gemm=false",
    # LLVM's optimization level for the code XLA emits (default 2). Most of a test's time is
    # XLA compiling small programs that then run a few times, and level 0 roughly halves that
    # (the 2-layer example's step: 18.5 s of compile CPU time at level 1, 11 s at 0); the HLO
    # passes (fusion, layouts, the GEMM rewrites the compile tests check) are unchanged. The
    # whole suite on two cores: 1320 s at level 1, 1062 s at level 0. Level 0 contracts no
    # multiply-add into an FMA, so a test comparing two programs bit for bit (the kernels
    # against the XLA stages) compiles them at the users' level (helpers.USERS_OPTIMIZATION).
    "--xla_backend_optimization_level=0",
    # The deviceless GPU compiles run ptxas on every kernel of the program; the tests read the
    # optimized HLO, which ptxas's optimization level does not change. At -O0 the gpu_compile
    # modules take about 9% less time (tests/test_gpu_compile*.py: 89 s against 81 s).
    "--xla_gpu_disable_gpuasm_optimizations=true",
)
_existing = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_existing, *(f for f in _FLAGS if f not in _existing)]).strip()

# One persistent compilation cache for the whole run: the first process to import this module
# (the pytest controller) makes a temporary folder and removes it at exit; the xdist workers and
# every subprocess the tests launch (the examples, scripts/gpu_check, the docs build) inherit the
# environment, so a program compiled once is loaded, not recompiled, by every other process.
# Every compile is kept (no minimum compile time or size); executables with host callbacks are
# never cached by JAX. JAX_COMPILATION_CACHE_DIR set beforehand (a folder kept between runs)
# is used as it is; JAX_ENABLE_COMPILATION_CACHE=false turns the cache off. JAX writes an entry
# in place, so a process may read one half-written (or left truncated by a killed process): JAX
# warns and compiles again, and pyproject.toml's filterwarnings lets that warning through.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="te-flax-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
from jax._src import compilation_cache  # noqa: E402

# CPU programs only: a deviceless GPU executable (the gpu_compile tests) is written to the cache
# but cannot be read back without a GPU client ("PjRtCompiler must be constructed with a
# Client"), so a second compile of the same deviceless program would fail on the cache read.
_cache_used_by_jax = compilation_cache.is_cache_used


def _cache_used_on_cpu(backend) -> bool:
    return backend.platform == "cpu" and _cache_used_by_jax(backend)


compilation_cache.is_cache_used = _cache_used_on_cpu

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

try:  # the test extra; a GPU image may run tests/test_gpu.py with pytest alone
    from hypothesis import settings
except ImportError:
    settings = None

# Property-based tests (tests/test_properties.py): "ci", the default, draws a fixed sequence of
# a few examples per test; HYPOTHESIS_PROFILE=long draws many more from a fresh seed each run.
if settings is not None:
    settings.register_profile(
        "ci", max_examples=2, derandomize=True, deadline=None, database=None, print_blob=True
    )
    settings.register_profile(
        "long", max_examples=50, deadline=None, database=None, print_blob=True
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The modules with the longest cases (a minute or more each on two CPU cores), longest first.
_LONGEST_FIRST = (
    "test_gpu_check.py",
    "test_long_run.py",
    "test_example_lm.py",
    "test_readme.py",
    "test_checkpoint_faults.py",
    "test_attention_packing.py",
    "test_example_encoder.py",
    "test_docs.py",
    "test_moe.py",
)


def pytest_collection_modifyitems(config, items):
    """Runs the longest modules first, then the other modules with slow cases, then the rest.

    Under `pytest -n auto --dist worksteal` (scripts/test) the idle worker takes work from the
    end of the busy one's queue, so with the long cases at the front the run ends on short ones
    and has no long tail on one worker. Each module's cases stay together and in their order.
    """
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item):
        if item.path.name in _LONGEST_FIRST:
            return _LONGEST_FIRST.index(item.path.name)
        return len(_LONGEST_FIRST) + (0 if item.path in slow_modules else 1)

    items[:] = sorted(items, key=rank)


import pytest  # noqa: E402

from te_flax._ops.kernels import switch  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_kernels_where_jax_keeps_them(request):
    """Tests marked ``triton_kernels`` check how te_flax's Pallas Triton kernels compile for a
    GPU. From jax 0.12 on that backend is deprecated (te_flax's ``auto`` no longer uses it
    there) and cannot be lowered deviceless (its lowering asks the local GPU for its compute
    capability), so they run on the older JAX of the range only (docs/versions.md)."""
    if request.node.get_closest_marker("triton_kernels") and not switch.pallas_triton_kept():
        pytest.skip("Pallas Triton kernels: deprecated and not lowered deviceless on this JAX")
