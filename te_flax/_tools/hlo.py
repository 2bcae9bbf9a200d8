"""Reading optimized HLO text: GEMMs by kind, custom calls, Pallas kernels, collectives, bytes.

The one reader of compiled programs for the benchmarks, the compile tests and
``te_flax.show_config``. It works on the text of ``compiled.as_text()`` (any backend), where
each instruction is one line, ``%name = type opcode(operands), attributes``:

* a value's type is an element type and dims, ``f8e4m3fn[512,1024]{1,0}``, or a tuple of them,
  ``(bf16[512,2048]{1,0}, s8[4194304]{0})`` (a cuBLAS call's result and workspace);
* a cuBLAS GEMM is a ``custom-call`` whose target starts with ``__cublas$`` (FP8:
  ``__cublas$lt$matmul$f8``), with its dot dimensions and operand precisions in the
  ``gemm_backend_config`` of its ``backend_config`` JSON;
* a GEMM left to a fusion is a ``dot`` or a Triton / cuDNN GEMM fusion;
* a Pallas kernel is a ``__gpu$xla.gpu.triton`` (Triton) or ``mosaic_gpu_v2`` (Mosaic GPU)
  custom call; te_flax's kernels carry their name (``te_flax_...``) in the op name;
* an instruction's ``metadata`` names the JAX op (``op_name``) and the Python lines that traced
  it: a ``stack_frame_id`` into the module's ``FileNames`` / ``FunctionNames`` /
  ``FileLocations`` / ``StackFrames`` tables (``stack_frames``), or, from older XLA, one
  ``source_file`` and ``source_line``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "FP8_GEMM",
    "MOSAIC_CALL",
    "NON_FP8_GEMMS",
    "TRITON_CALL",
    "Collective",
    "Gemm",
    "Instruction",
    "SourceFrame",
    "computation_rows",
    "count_gemms",
    "custom_call_targets",
    "element_bytes",
    "entry_rows",
    "fused_attention_calls",
    "gemms_left_to_fusions",
    "instructions",
    "kernel_names",
    "moved_bytes",
    "native_fp8_gemm",
    "parse_collectives",
    "parse_gemms",
    "shape_bytes",
    "source_of",
    "stack_frames",
    "value_types",
]

FP8_GEMM = "__cublas$lt$matmul$f8"
NON_FP8_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel (or any Triton kernel) as a custom call
MOSAIC_CALL = "mosaic_gpu_v2"  # a Pallas Mosaic GPU kernel as a custom call
_KERNEL_CALLS = (TRITON_CALL, MOSAIC_CALL)

# `%name = f8e4m3fn[512,1024]{1,0} ...` or, for a tuple result, `%name = (bf16[512,2048]{1,0}, ...`
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*\(?([a-z][a-z0-9]*)\[([0-9,]*)\]")
# The whole instruction: name, result type (one or a tuple), opcode, operands.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)"
    r"\s+([a-z\-]+)\((.*?)\)"
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERANDS = re.compile(r"custom-call\(([^)]*)\)")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_KERNEL_NAME = re.compile(r'op_name="[^"]*?(te_flax_\w+)')
_FUSION = re.compile(r"\sfusion\(.*\bkind=k")
_BITS = re.compile(r"(\d+)")
# A tuple of six or more values carries ``/*index=5*/`` comments, whose "=" would end the
# result type early: instructions are matched with them removed.
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_COLLECTIVE = re.compile(
    r"\s(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\(([^)]*)\)"
)
# GEMMs XLA hands to a fusion instead of cuBLAS.
_FUSION_GEMM_KINDS = ("__triton_gemm", "__cudnn$fusion")
# Instructions that move no data of their own (a while loop's are its body's; an async
# operation's "-done" waits for the transfer its "-start" counted).
_FREE = ("parameter", "get-tuple-element", "bitcast", "constant", "tuple", "while")
# Async starts whose result tuple holds their operands (aliased, not written again) beside the
# outputs; an all-reduce-start's result is its outputs alone.
_ALIASING_STARTS = (
    "all-gather-start",
    "reduce-scatter-start",
    "collective-permute-start",
    "all-to-all-start",
    "async-start",
    "copy-start",
)

ValueType = tuple[str, tuple[int, ...]]  # (element type, dims) of a value (a tuple's first)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def element_bytes(element_type: str) -> float:
    """Bytes of one element: ``bf16`` 2, ``f8e4m3fn`` 1, ``pred`` 1, ``f4e2m1fn`` 0.5."""
    if element_type == "token":
        return 0
    if element_type == "pred" or element_type.startswith("f8"):
        return 1
    match = _BITS.search(element_type)
    assert match is not None, element_type
    return int(match.group(1)) / 8


def shape_bytes(text: str) -> float:
    """Bytes of every array type in ``text`` (a type or a tuple of types)."""
    return sum(
        math.prod(_dims(dims)) * element_bytes(element_type)
        for element_type, dims in _SHAPE.findall(text)
    )


def value_types(hlo_text: str) -> dict[str, ValueType]:
    """Each defined value's element type and dims (a tuple value: its first element's)."""
    types = {}
    for line in hlo_text.splitlines():
        if match := _DEFINITION.match(line):
            name, element_type, dims = match.groups()
            types[name] = (element_type, _dims(dims))
    return types


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One cuBLAS GEMM custom call of an optimized HLO module."""

    name: str
    target: str
    dims: tuple[int, ...]  # of the GEMM's result
    operand_types: tuple[str, ...]  # element types of the two matrix operands
    precision: tuple[str, ...]
    epilogue: str
    flops: int  # 2 * result size * contracted size
    bytes: float  # operands and result, not the workspace

    @property
    def fp8(self) -> bool:
        return self.target == FP8_GEMM


def _backend_config(line: str) -> dict[str, Any]:
    start = line.index("backend_config=") + len("backend_config=")
    config: dict[str, Any] = json.JSONDecoder().raw_decode(line[start:])[0]
    return config


def parse_gemms(hlo_text: str) -> list[Gemm]:
    """The cuBLAS GEMM custom calls, with their operand types, precisions, flops and bytes."""
    types = value_types(hlo_text)
    gemms = []
    for line in hlo_text.splitlines():
        target = _TARGET.search(line)
        if target is None or not target.group(1).startswith("__cublas$"):
            continue
        definition = _DEFINITION.match(line)
        operand_text = _OPERANDS.search(line)
        assert definition is not None and operand_text is not None, line
        result = types[definition.group(1)]
        operands = [types[name] for name in _OPERAND_NAME.findall(operand_text.group(1))]
        config = _backend_config(line)["gemm_backend_config"]
        contracting = config["dot_dimension_numbers"]["lhs_contracting_dimensions"]
        contracted = math.prod(operands[0][1][int(d)] for d in contracting)
        gemms.append(
            Gemm(
                name=definition.group(1),
                target=target.group(1),
                dims=result[1],
                operand_types=tuple(element_type for element_type, _ in operands[:2]),
                precision=tuple(config["precision_config"]["operand_precision"]),
                epilogue=config.get("epilogue", "DEFAULT"),
                flops=2 * math.prod(result[1]) * contracted,
                bytes=sum(
                    math.prod(dims) * element_bytes(element_type)
                    for element_type, dims in [result, *operands]
                ),
            )
        )
    return gemms


def custom_call_targets(hlo_text: str) -> list[str]:
    """The target of every custom call, in program order."""
    return _TARGET.findall(hlo_text)


def fused_attention_calls(hlo_text: str) -> list[str]:
    """cuDNN's fused attention custom calls (``__cudnn$fmha...``)."""
    return [target for target in custom_call_targets(hlo_text) if target.startswith("__cudnn$fmha")]


def kernel_names(hlo_text: str) -> list[str]:
    """te_flax's Pallas kernels (Triton and Mosaic GPU custom calls) by their name, sorted."""
    names = []
    for line in hlo_text.splitlines():
        called = any(f'"{target}"' in line for target in _KERNEL_CALLS)
        if called and (match := _KERNEL_NAME.search(line)):
            names.append(match.group(1))
    return sorted(names)


def gemms_left_to_fusions(hlo_text: str) -> int:
    """GEMMs XLA did not give cuBLAS: plain ``dot`` instructions and Triton / cuDNN GEMM
    fusions."""
    count = len(re.findall(r"\sdot\(", hlo_text))
    return count + sum(hlo_text.count(f'"kind":"{kind}"') for kind in _FUSION_GEMM_KINDS)


def count_gemms(hlo_text: str) -> dict[str, int]:
    """cuBLAS FP8 GEMMs, every other GEMM (cuBLAS, fusions, dots) and the fusions."""
    targets = [gemm.target for gemm in parse_gemms(hlo_text)]
    return {
        "fp8_gemms": sum(target == FP8_GEMM for target in targets),
        "other_gemms": sum(target != FP8_GEMM for target in targets)
        + gemms_left_to_fusions(hlo_text),
        "fusions": len(_FUSION.findall(hlo_text)),
    }


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of an optimized HLO module (sync or async start)."""

    kind: str  # "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "collective-permute"
    operands: tuple[ValueType, ...]  # (element type, dims) of each input
    # The JAX op it comes from, with its named scopes; a backward's is under "transpose(".
    op_name: str = ""

    @property
    def bytes(self) -> float:
        return sum(math.prod(dims) * element_bytes(t) for t, dims in self.operands)


def parse_collectives(hlo_text: str) -> list[Collective]:
    """The collectives, with their input types and JAX op names; a combined collective (one op
    moving several arrays) is one entry with several operands."""
    types = value_types(hlo_text)
    collectives = []
    for line in hlo_text.splitlines():
        if match := _COLLECTIVE.search(line):
            kind, operands = match.groups()
            names = _OPERAND_NAME.findall(operands)
            source = _OP_NAME.search(line)
            op_name = source.group(1) if source else ""
            collectives.append(Collective(kind, tuple(types[name] for name in names), op_name))
    return collectives


def native_fp8_gemm(hlo_text: str) -> bool:
    """Whether the program holds a GEMM (a ``dot`` or a GEMM custom call) that reads a float8
    operand as it is. Emulation widens the operands with ``convert`` first, so its GEMMs read
    bf16 or f32."""
    types: dict[str, str] = {}
    gemm_operands: list[list[str]] = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, value_type, opcode, operands = match.groups()
        types[name] = value_type.lstrip("(")
        if opcode == "dot" or (opcode == "custom-call" and "matmul" in line):
            gemm_operands.append(_OPERAND_NAME.findall(operands)[:2])
    return any(
        types.get(operand, "").startswith("f8")
        for operands in gemm_operands
        for operand in operands
    )


def _describe(opcode: str, line: str) -> str:
    if opcode == "custom-call":
        target = _TARGET.search(line)
        assert target is not None, line
        if target.group(1) in _KERNEL_CALLS:
            kernel = _KERNEL_NAME.search(line)
            return f"Pallas kernel {kernel.group(1) if kernel else ''}".strip()
        return "FP8 GEMM" if target.group(1) == FP8_GEMM else f"GEMM {target.group(1)}"
    if opcode != "fusion":
        return opcode
    kind = re.search(r"kind=(k\w+)", line)
    backend = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', line)
    described = f"fusion {kind.group(1) if kind else ''}".strip()
    return described + (f" {backend.group(1)}" if backend else "")


def _without_workspace(opcode: str, line: str, result: str) -> str:
    """A cuBLAS call's result without its workspace (the last value of its tuple)."""
    if opcode == "custom-call" and "__cublas$" in line:
        return result.split(", s8[")[0]
    return result


def moved_bytes(opcode: str, line: str, result: str, operand_types: Iterable[str]) -> float:
    """The bytes one instruction moves: each distinct operand read once (``operand_types``, one
    type text per distinct operand) and its result written once, as XLA's cost analysis counts
    a fusion; a cuBLAS GEMM's workspace is left out, and an async start whose result tuple
    repeats its operands writes only its outputs."""
    read = sum(shape_bytes(text) for text in operand_types)
    written = shape_bytes(_without_workspace(opcode, line, result))
    if opcode in _ALIASING_STARTS:
        written -= read
    return read + written


def computation_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """One row per instruction of one computation that moves data: its bytes (operands +
    result), what it is, its result type, its pass and the JAX op it comes from.

    The accounting of XLA's cost analysis of a fusion (every distinct operand read once, the
    result written once), applied to custom calls too (cuBLAS GEMMs, Pallas kernels); a GEMM's
    workspace is left out. An async collective is one row, its start: operands read, outputs
    written once (the start's result tuple repeats its operands, and the done only waits).
    The last part of the JAX op name says which line of the model an instruction comes from.
    """
    types: dict[str, str] = {}
    rows = []
    for line in lines:
        line = _INDEX_COMMENT.sub("", line)
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, opcode, operands = match.groups()
        types[name] = result
        if opcode in _FREE or opcode.endswith("-done"):
            continue
        result = _without_workspace(opcode, line, result)
        operand_names = dict.fromkeys(_OPERAND_NAME.findall(operands))
        moved = moved_bytes(opcode, line, result, [types.get(name, "") for name in operand_names])
        op_name = _OP_NAME.search(line)
        source = op_name.group(1) if op_name else ""
        rows.append(
            {
                "name": name,
                "bytes": moved,
                "instruction": _describe(opcode, line),
                "result": re.sub(r"\{[^}]*\}", "", result).strip("()"),
                "pass": "backward" if "transpose(" in source else "forward",
                "from": source.rsplit("/", 1)[-1],
            }
        )
    return rows


def entry_rows(hlo_text: str) -> list[dict[str, Any]]:
    """``computation_rows`` of the entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY") :].splitlines()[1:]
    return computation_rows(
        entry[: next(i for i, line in enumerate(entry) if line.startswith("}"))]
    )


# ----------------------------------------------------------------------------- every instruction

# A computation's first line: ``%fused_computation.3 (param_0: f32[8]) -> bf16[8] {`` or
# ``ENTRY %main.12 (...) -> ... {``.
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s")
_PARAMETER_NUMBER = re.compile(r"\sparameter\((\d+)\)")
_STACK_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE_LINE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TABLE_ENTRY = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


@dataclasses.dataclass(frozen=True)
class SourceFrame:
    """One Python frame that traced an instruction: its file, function and line."""

    file: str
    function: str
    line: int


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of an optimized HLO module, in any of its computations."""

    name: str
    result: str  # its type: one array type, or a tuple of them
    opcode: str
    operands: tuple[str, ...]  # the names of the values it reads
    computation: str  # the computation it belongs to
    root: bool  # whether it is that computation's ROOT
    line: str  # its text, for the attributes (without ``/*index=N*/`` comments)

    @property
    def element_type(self) -> str:
        """The element type of its result (a tuple's first value)."""
        match = _SHAPE.search(self.result)
        return match.group(1) if match else ""

    @property
    def dims(self) -> tuple[int, ...]:
        """The dims of its result (a tuple's first value)."""
        match = _SHAPE.search(self.result)
        return _dims(match.group(2)) if match else ()

    @property
    def op_name(self) -> str:
        """The JAX op it comes from (``jit(step)/transpose(jvp())/dot_general``)."""
        match = _OP_NAME.search(self.line)
        return match.group(1) if match else ""

    @property
    def parameter_number(self) -> int | None:
        match = _PARAMETER_NUMBER.search(self.line)
        return int(match.group(1)) if match and self.opcode == "parameter" else None

    @property
    def custom_call_target(self) -> str:
        match = _TARGET.search(self.line)
        return match.group(1) if match else ""


def instructions(hlo_text: str) -> dict[str, Instruction]:
    """Every instruction of every computation by name (names are unique in a module), in
    program order; ``Instruction.computation`` says where each one is."""
    found: dict[str, Instruction] = {}
    computation = ""
    for line in _INDEX_COMMENT.sub("", hlo_text).splitlines():
        if header := _COMPUTATION.match(line):
            computation = header.group(2)
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, opcode, operands = match.groups()
        found[name] = Instruction(
            name=name,
            result=result,
            opcode=opcode,
            operands=tuple(_OPERAND_NAME.findall(operands)),
            computation=computation,
            root=line.lstrip().startswith("ROOT"),
            line=line,
        )
    return found


# ----------------------------------------------------------------------------- source lines


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The module's tables of file names, function names, file locations and stack frames,
    each ``id -> text`` (printed before the first computation)."""
    tables: dict[str, dict[int, str]] = {}
    current: dict[int, str] | None = None
    for line in hlo_text.splitlines():
        if line.startswith(("%", "ENTRY")):
            break
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (entry := _TABLE_ENTRY.match(line)):
            current[int(entry.group(1))] = entry.group(2)
        else:
            current = None
    return tables


def stack_frames(hlo_text: str) -> dict[int, tuple[SourceFrame, ...]]:
    """Each ``stack_frame_id`` of the module's metadata -> its Python frames, innermost first.

    XLA prints a frame's parent one above its id (``parent_frame_id=1`` for a frame without a
    parent; a frame never is its own parent): where a frame names itself, every parent is read
    one lower.
    """
    tables = _tables(hlo_text)
    files = {i: text.strip('"') for i, text in tables.get("FileNames", {}).items()}
    functions = {i: text.strip('"') for i, text in tables.get("FunctionNames", {}).items()}
    locations = {}
    for i, text in tables.get("FileLocations", {}).items():
        fields = {key: int(value) for key, value in _FIELD.findall(text)}
        locations[i] = SourceFrame(
            files.get(fields.get("file_name_id", 0), "?"),
            functions.get(fields.get("function_name_id", 0), "?"),
            fields.get("line", 0),
        )
    links = {}
    for i, text in tables.get("StackFrames", {}).items():
        fields = {key: int(value) for key, value in _FIELD.findall(text)}
        links[i] = (fields.get("file_location_id", 0), fields.get("parent_frame_id", 0))
    shift = 1 if any(parent == i for i, (_, parent) in links.items()) else 0
    frames: dict[int, tuple[SourceFrame, ...]] = {}
    for i in links:
        chain: list[SourceFrame] = []
        frame = i
        while frame in links and len(chain) <= len(links):  # bounded: a malformed table ends
            location, parent = links[frame]
            if location in locations:
                chain.append(locations[location])
            frame = parent - shift
        frames[i] = tuple(chain)
    return frames


def source_of(
    instruction: Instruction, frames: dict[int, tuple[SourceFrame, ...]]
) -> tuple[SourceFrame, ...]:
    """The Python frames that traced ``instruction``, innermost first (none when its metadata
    names no source)."""
    if match := _STACK_FRAME_ID.search(instruction.line):
        return frames.get(int(match.group(1)), ())
    if match := _SOURCE_LINE.search(instruction.line):
        return (SourceFrame(match.group(1), "", int(match.group(2))),)
    return ()
