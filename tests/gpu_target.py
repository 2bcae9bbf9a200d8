"""The deviceless XLA:GPU target of the gpu_compile tests: one H100 SXM, described in data/.

XLA's real GPU compiler (the ``jax[cuda12]`` plugin) compiles for this target on a machine
without a GPU; the tests that use it skip when the plugin is not installed.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
from jax.experimental import topologies

TARGET_CONFIG = Path(__file__).parent / "data" / "h100_sxm.gpu_target_config.txtpb"


@functools.cache
def h100_sharding() -> jax.sharding.NamedSharding:
    """A replicated sharding on one deviceless H100, for the ShapeDtypeStructs of a compile."""
    assert "--xla_gpu_enable_triton_gemm=false" in os.environ.get("XLA_FLAGS", ""), (
        "tests/conftest.py sets --xla_gpu_enable_triton_gemm=false; without it the deviceless "
        "compile hands the FP8 dots to Triton"
    )
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
