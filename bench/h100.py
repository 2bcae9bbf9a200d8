"""Deviceless compile for an H100: the same training steps through XLA's real GPU compiler.

With the ``jax[cuda12]`` plugin installed and ``JAX_PLATFORMS=cpu``, XLA compiles for the GPU
described by the test suite's target config (no GPU needed). From the optimized HLO this reads
the cuBLAS GEMM custom calls (FP8 ``__cublas$lt$matmul$f8`` or not), GEMMs left to fusions,
the number of fusions, and XLA's own cost analysis (flops and bytes accessed) and memory
analysis. ``XLA_FLAGS`` must contain ``--xla_gpu_enable_triton_gemm=false`` before JAX starts
(``bench/__main__.py`` sets it): without autotuning the deviceless compile hands FP8 dots to
Triton.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax

from bench.memory import compiled_memory
from bench.models import Candidate, make_grad_step
from te_flax._tools.hlo import (
    computation_rows,
    count_gemms,
    custom_call_targets,
    entry_rows,
    parse_gemms,
)

__all__ = [
    "KERNEL_SETTINGS",
    "TRITON_OFF",
    "analyze",
    "available",
    "computation_rows",
    "cost",
    "count_gemms",
    "instruction_bytes",
    "kernel_calls",
]

TARGET_CONFIG = Path(__file__).parents[1] / "tests" / "data" / "h100_sxm.gpu_target_config.txtpb"
TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
# te_flax's Pallas kernels: off (the XLA stages) and the default switch, which chooses them
# for a CUDA program such as this deviceless one.
KERNEL_SETTINGS = {"xla": "0", "kernels": "auto"}


def instruction_bytes(hlo_text: str, top: int | None = 12) -> list[dict]:
    """The entry computation's instructions that move the most bytes (``entry_rows``).
    ``top=None`` returns every instruction."""
    return sorted(entry_rows(hlo_text), key=lambda row: -row["bytes"])[:top]


def kernel_calls(hlo_text: str) -> list[dict]:
    """The Pallas (Triton) kernel calls of the entry computation, with their bytes."""
    return [row for row in entry_rows(hlo_text) if row["instruction"].startswith("Pallas kernel")]


def cost(compiled) -> dict[str, float]:
    """Flops and bytes accessed of the optimized H100 program.

    The deviceless executable has no cost analysis of its own, so XLA's ``HloCostAnalysis`` is
    run (through the CPU client) on the optimized H100 HLO module. That analysis knows nothing
    of custom calls: it counts each as -1 flops and -1 bytes ("unknown"). So those -1 are taken
    back out, and from the HLO each cuBLAS GEMM's ``2 * M * N * K`` flops and the bytes of its
    operands and result (not its workspace) are added, and each Pallas kernel's bytes as a
    fusion's are counted: every operand read once, every result written once. (A kernel's
    flops are not counted; they are element-wise work, a rounding error next to the GEMMs.)
    """
    from jax._src.lib import xla_client

    (module,) = compiled.runtime_executable().hlo_modules()
    client = jax.devices("cpu")[0].client
    xla_cost = xla_client._xla.hlo_module_cost_analysis(client, module)
    hlo_text = compiled.as_text()
    gemms = parse_gemms(hlo_text)
    kernels = kernel_calls(hlo_text)
    unknown = len(custom_call_targets(hlo_text))  # each counted as -1
    kernel_bytes = float(sum(k["bytes"] for k in kernels))
    return {
        "flops": float(xla_cost["flops"]) + unknown + sum(g.flops for g in gemms),
        "bytes": float(xla_cost["bytes accessed"])
        + unknown
        + sum(g.bytes for g in gemms)
        + kernel_bytes,
        "gemm_bytes": float(sum(g.bytes for g in gemms)),
        "gemm_flops": float(sum(g.flops for g in gemms)),
        "kernel_bytes": kernel_bytes,
        "kernels": len(kernels),
    }


def available() -> str | None:
    """None when the deviceless compile can run, else the reason it cannot."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return "the jax[cuda12] plugin is not installed (pip install -e '.[gpu-compile]')"
    if TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
        return f"XLA_FLAGS lacks {TRITON_OFF} (it must be set before JAX starts)"
    if not TARGET_CONFIG.exists():
        return f"the target config {TARGET_CONFIG.name} is missing"
    return None


@functools.cache
def _sharding() -> jax.sharding.NamedSharding:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def analyze(candidate: Candidate, kernels: str = "auto") -> dict:
    """GEMM counts, fusions, cost and memory analysis of one training step on the H100.

    ``kernels`` is the setting of te_flax's Pallas kernel switch while the step is traced
    (``"0"``: the XLA stages; ``"auto"``, the default: the kernels, on this CUDA target).
    """
    from te_flax._ops.kernels import pallas_kernels

    sharding = _sharding()

    def spec(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    # The deviceless compile runs on a CPU host: "auto" traces as a GPU process would.
    with pallas_kernels(kernels, assume_gpu=True):
        step = jax.jit(make_grad_step(candidate))
        lowered = step.lower(jax.tree.map(spec, candidate.variables), spec(candidate.x))
    compiled = lowered.compile()
    hlo_text = compiled.as_text()
    return {
        **count_gemms(hlo_text),
        **cost(compiled),
        "memory": compiled_memory(compiled),
        "top_instructions": instruction_bytes(hlo_text),
        "kernel_calls": kernel_calls(hlo_text),
    }
