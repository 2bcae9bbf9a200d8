"""Deviceless compile for an H100: the same training steps through XLA's real GPU compiler.

With the ``jax[cuda12]`` plugin installed and ``JAX_PLATFORMS=cpu``, XLA compiles for the GPU
described by the test suite's target config (no GPU needed). From the optimized HLO this reads
the cuBLAS GEMM custom calls (FP8 ``__cublas$lt$matmul$f8`` or not), GEMMs left to fusions,
the number of fusions, te_flax's Pallas kernels (Triton, and the Mosaic GPU grouped GEMMs),
and XLA's own cost analysis (flops and bytes accessed) and memory analysis. ``XLA_FLAGS``
must contain ``--xla_gpu_enable_triton_gemm=false`` before JAX starts (``bench/__main__.py``
sets it): without autotuning the deviceless compile hands FP8 dots to Triton.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import jax

from bench.memory import compiled_memory
from bench.models import Candidate, make_grad_step
from te_flax._tools.hlo import (
    MOSAIC_CALL,
    computation_rows,
    count_gemms,
    custom_call_targets,
    entry_rows,
    parse_gemms,
    value_types,
)

__all__ = [
    "KERNEL_SETTINGS",
    "TRITON_OFF",
    "analyze",
    "available",
    "computation_rows",
    "cost",
    "count_gemms",
    "grouped_kernel_gemms",
    "instruction_bytes",
    "kernel_calls",
]

TARGET_CONFIG = Path(__file__).parents[1] / "tests" / "data" / "h100_sxm.gpu_target_config.txtpb"
TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
# te_flax's Pallas kernels: off (the XLA stages) and the default switch, which chooses them
# for a CUDA program such as this deviceless one.
KERNEL_SETTINGS = {"xla": "0", "kernels": "auto"}
# A Pallas Mosaic GPU kernel as a custom call; ``entry_rows`` describes it as ``Pallas kernel
# te_flax_<name>``, te_flax's grouped GEMMs as ``te_flax_rows_gemm`` and ``te_flax_group_gemm``.
_MOSAIC_LINE = re.compile(
    r'^\s*(?:ROOT\s+)?%([^\s=]+)\s*=.*?custom-call\(([^)]*)\).*custom_call_target="'
    + MOSAIC_CALL
    + '"'
)
GROUPED_KERNELS = {f"Pallas kernel te_flax_{kind}": kind for kind in ("rows_gemm", "group_gemm")}


def instruction_bytes(hlo_text: str, top: int | None = 12) -> list[dict]:
    """The entry computation's instructions that move the most bytes (``entry_rows``).
    ``top=None`` returns every instruction."""
    return sorted(entry_rows(hlo_text), key=lambda row: -row["bytes"])[:top]


def kernel_calls(hlo_text: str) -> list[dict]:
    """The Pallas kernel calls (Triton and Mosaic GPU) of the entry computation, with their
    bytes."""
    return [row for row in entry_rows(hlo_text) if row["instruction"].startswith("Pallas kernel")]


def grouped_kernel_gemms(hlo_text: str) -> list[dict]:
    """te_flax's grouped GEMM kernels (Mosaic GPU calls) of the entry computation: each call's
    name, kind, GEMM flops, bytes (operands read once, result written once) and the element
    types of its two matrix operands.

    The operands say which kernel it is: ``rows_gemm`` takes ``(table, scale, lhs [M, C],
    rhs [G, N, C])``, ``2 * M * N * C`` flops (the forward GEMM and dgrad); ``group_gemm``
    takes ``(first_tile, scale, lhs [C, W], rhs [N, W])``, ``2 * C * N * W`` flops over the
    group-aligned columns ``W`` (wgrad). The kernels are told apart by their names.
    """
    types = value_types(hlo_text)
    operands = {
        match.group(1): re.findall(r"%([^\s,()]+)", match.group(2))
        for line in hlo_text.splitlines()
        if (match := _MOSAIC_LINE.match(line))
    }
    calls = []
    for row in entry_rows(hlo_text):
        kind = GROUPED_KERNELS.get(row["instruction"])
        if kind is None:
            continue
        shapes = [types[name] for name in operands[row["name"]]]
        (m, c), rhs = shapes[2][1], shapes[3][1]
        # rows_gemm: M rows times N = rhs[1] columns over C; group_gemm: C x rhs[0] over W = m.
        flops = 2 * m * c * (rhs[1] if kind == "rows_gemm" else rhs[0])
        matrices = tuple(element_type for element_type, _ in shapes[2:4])
        calls.append(
            {
                "name": row["name"],
                "kind": kind,
                "flops": flops,
                "bytes": row["bytes"],
                "operand_types": matrices,
                "fp8": all(element_type.startswith("f8") for element_type in matrices),
                "result": row["result"],
            }
        )
    return calls


def cost(compiled) -> dict[str, float]:
    """Flops and bytes accessed of the optimized H100 program.

    The deviceless executable has no cost analysis of its own, so XLA's ``HloCostAnalysis`` is
    run (through the CPU client) on the optimized H100 HLO module. That analysis knows nothing
    of custom calls: it counts each as -1 flops and -1 bytes ("unknown"). So those -1 are taken
    back out, and from the HLO each cuBLAS GEMM's ``2 * M * N * K`` flops and the bytes of its
    operands and result (not its workspace) are added, and each Pallas kernel's bytes as a
    fusion's are counted: every operand read once, every result written once. The grouped
    GEMM kernels' flops (``grouped_kernel_gemms``) are added too, and given on their own
    (``grouped_kernel_flops``, not in ``gemm_flops``, the cuBLAS calls'); other kernels' flops
    are not counted: they are element-wise work, a rounding error next to the GEMMs.
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
    grouped = grouped_kernel_gemms(hlo_text)
    grouped_flops = float(sum(g["flops"] for g in grouped))
    return {
        "flops": float(xla_cost["flops"]) + unknown + sum(g.flops for g in gemms) + grouped_flops,
        "bytes": float(xla_cost["bytes accessed"])
        + unknown
        + sum(g.bytes for g in gemms)
        + kernel_bytes,
        "gemm_bytes": float(sum(g.bytes for g in gemms)),
        "gemm_flops": float(sum(g.flops for g in gemms)),
        "kernel_bytes": kernel_bytes,
        "kernels": len(kernels),
        "grouped_kernel_flops": grouped_flops,
        "grouped_kernel_bytes": float(sum(g["bytes"] for g in grouped)),
        "grouped_kernels": len(grouped),
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
