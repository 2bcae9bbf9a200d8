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
import json
import math
import os
import re
from pathlib import Path

import jax

from bench.memory import compiled_memory
from bench.models import Candidate, make_grad_step

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
FP8_GEMM = "__cublas$lt$matmul$f8"
TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel (or any Triton kernel) as a custom call
# te_flax's Pallas kernels: off (the XLA stages) and the default switch, which chooses them
# for a CUDA program such as this deviceless one.
KERNEL_SETTINGS = {"xla": "0", "kernels": "auto"}

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION = re.compile(r"\sfusion\(.*\bkind=k")
# `%name = f8e4m3fn[512,1024]{1,0} ...` or, for a tuple result, `%name = (bf16[512,2048]{1,0}, ...`
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*\(?([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPERANDS = re.compile(r"custom-call\(([^)]*)\)")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")
_BITS = re.compile(r"(\d+)")


def _element_bytes(element_type: str) -> float:
    if element_type == "token":
        return 0
    if element_type == "pred":
        return 1
    if element_type.startswith("f8"):
        return 1
    return int(_BITS.search(element_type).group(1)) / 8


def _gemms(hlo_text: str) -> list[dict]:
    """Each cuBLAS GEMM call: target, flops (2 * result size * contracted size), bytes."""
    shapes = {}
    for line in hlo_text.splitlines():
        if match := _DEFINITION.match(line):
            name, element_type, dims = match.groups()
            shapes[name] = (element_type, tuple(int(d) for d in dims.split(",") if d))
    gemms = []
    for line in hlo_text.splitlines():
        target = _TARGET.search(line)
        if target is None or not target.group(1).startswith("__cublas$"):
            continue
        result = shapes[_DEFINITION.match(line).group(1)]  # the first tuple element
        operands = [shapes[name] for name in _OPERAND_NAME.findall(_OPERANDS.search(line).group(1))]
        start = line.index("backend_config=") + len("backend_config=")
        config = json.JSONDecoder().raw_decode(line[start:])[0]["gemm_backend_config"]
        contracting = config["dot_dimension_numbers"]["lhs_contracting_dimensions"]
        contracted = math.prod(operands[0][1][int(d)] for d in contracting)
        nbytes = sum(math.prod(dims) * _element_bytes(t) for t, dims in [result, *operands])
        gemms.append(
            {
                "target": target.group(1),
                "flops": 2 * math.prod(result[1]) * contracted,
                "bytes": nbytes,
                "types": [t for t, _ in operands[:2]],
            }
        )
    return gemms


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)"
    r"\s+([a-z\-]+)\((.*?)\)"
)
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Instructions that move no data of their own (a while loop's are its body's).
_FREE = ("parameter", "get-tuple-element", "bitcast", "constant", "tuple", "while")


def _shape_bytes(text: str) -> float:
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) * _element_bytes(element_type)
        for element_type, dims in _SHAPE.findall(text)
    )


def _describe(opcode: str, line: str) -> str:
    if opcode == "custom-call":
        target = _TARGET.search(line).group(1)
        if target == TRITON_CALL:
            kernel = re.search(r'op_name="[^"]*?(te_flax_\w+)', line)
            return f"Pallas kernel {kernel.group(1) if kernel else ''}".strip()
        return "FP8 GEMM" if target == FP8_GEMM else f"GEMM {target}"
    if opcode != "fusion":
        return opcode
    kind = re.search(r"kind=(k\w+)", line).group(1)
    backend = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', line)
    return f"fusion {kind}" + (f" {backend.group(1)}" if backend else "")


def computation_rows(lines: list[str]) -> list[dict]:
    """One row per instruction of one computation that moves data: its bytes (operands +
    result), what it is, its result type, its pass and the JAX op it comes from.

    The same accounting as XLA's cost analysis of a fusion (every distinct operand read once,
    the result written once), applied to custom calls too (cuBLAS GEMMs, Pallas kernels); a
    GEMM's workspace is left out. The last part of the JAX op name says which line of the model
    an instruction comes from.
    """
    types, rows = {}, []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, opcode, operands = match.groups()
        types[name] = result
        if opcode in _FREE:
            continue
        if opcode == "custom-call" and "__cublas$" in line:
            result = result.split(", s8[")[0]  # without the cuBLAS workspace
        operand_names = dict.fromkeys(_OPERAND_NAME.findall(operands))
        read = sum(_shape_bytes(types.get(o, "")) for o in operand_names)
        op_name = _OP_NAME.search(line)
        op_name = op_name.group(1) if op_name else ""
        rows.append(
            {
                "bytes": read + _shape_bytes(result),
                "instruction": _describe(opcode, line),
                "result": re.sub(r"\{[^}]*\}", "", result).strip("()"),
                "pass": "backward" if "transpose(" in op_name else "forward",
                "from": op_name.rsplit("/", 1)[-1],
            }
        )
    return rows


def instruction_bytes(hlo_text: str, top: int | None = 12) -> list[dict]:
    """The entry computation's instructions that move the most bytes (``computation_rows``).
    ``top=None`` returns every instruction."""
    entry = hlo_text[hlo_text.index("\nENTRY") :].splitlines()[1:]
    lines = entry[: next(i for i, line in enumerate(entry) if line.startswith("}"))]
    return sorted(computation_rows(lines), key=lambda row: -row["bytes"])[:top]


def kernel_calls(hlo_text: str) -> list[dict]:
    """The Pallas (Triton) kernel calls of the entry computation, with their bytes."""
    return [
        row
        for row in instruction_bytes(hlo_text, top=None)
        if row["instruction"].startswith("Pallas kernel")
    ]


def count_gemms(hlo_text: str) -> dict[str, int]:
    """cuBLAS GEMM calls by kind, GEMMs left to Triton/cuDNN fusions or dots, and fusions."""
    targets = [g["target"] for g in _gemms(hlo_text)]
    left_to_fusions = sum(
        hlo_text.count(f'"kind":"{kind}"') for kind in ("__triton_gemm", "__cudnn$fusion")
    )
    return {
        "fp8_gemms": sum(t == FP8_GEMM for t in targets),
        "other_gemms": sum(t != FP8_GEMM for t in targets)
        + left_to_fusions
        + len(re.findall(r"\sdot\(", hlo_text)),
        "fusions": len(_FUSION.findall(hlo_text)),
    }


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
    gemms = _gemms(hlo_text)
    kernels = kernel_calls(hlo_text)
    unknown = len(re.findall(r"\scustom-call\(", hlo_text))  # each counted as -1
    kernel_bytes = float(sum(k["bytes"] for k in kernels))
    return {
        "flops": float(xla_cost["flops"]) + unknown + sum(g["flops"] for g in gemms),
        "bytes": float(xla_cost["bytes accessed"])
        + unknown
        + sum(g["bytes"] for g in gemms)
        + kernel_bytes,
        "gemm_bytes": float(sum(g["bytes"] for g in gemms)),
        "gemm_flops": float(sum(g["flops"] for g in gemms)),
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
    from te_flax._kernels import pallas_kernels

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
