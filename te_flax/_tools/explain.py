"""``te_flax.explain``'s report: every GEMM and collective of a compiled program.

The report is read from the optimized HLO alone (``compiled.as_text()``), so it says what XLA
made of the program for the target it was compiled for, not what the Python code asked for:

* a GEMM is a cuBLAS custom call (``__cublas$lt$matmul$f8`` is cuBLASLt's FP8 GEMM), a
  te_flax Pallas GEMM kernel (``te_flax_*gemm``), a ``dot`` (alone, or inside a fusion: a
  Triton or cuDNN GEMM fusion on a GPU, a library fusion on a CPU) or a ``ragged-dot``;
* its operand dtypes are those of the values it reads, except on a target without FP8 GEMMs
  (a CPU), where XLA widens float8 operands right before the GEMM: there the float8 type counts
  (the FP8 GEMM is emulated), the wider one being the GEMM's ``read_dtypes``. On a target with
  FP8 GEMMs a GEMM that reads widened float8 values is no FP8 GEMM, and the report says so;
* its source line is the innermost Python frame of its metadata outside te_flax, JAX, Flax and
  Optax: the user's line that called the layer or the product.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import sysconfig
from pathlib import Path

from te_flax._tools.hlo import (
    FP8_GEMM,
    MOSAIC_CALL,
    TRITON_CALL,
    Instruction,
    SourceFrame,
    element_bytes,
    instructions,
    moved_bytes,
    source_of,
    stack_frames,
)

__all__ = ["CollectiveInfo", "ExplainReport", "GemmInfo", "dtype_name", "read_report"]

# The labels of the GEMMs cuBLAS runs, by custom call target.
_CUBLAS = {
    FP8_GEMM: "cuBLASLt FP8",
    "__cublas$lt$matmul": "cuBLASLt",
    "__cublas$gemm": "cuBLAS",
}
_KERNEL_NAME = re.compile(r'op_name="[^"]*?(te_flax_\w*gemm\w*)')
_COLLECTIVE = re.compile(
    r"(all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all|collective-permute|"
    r"collective-broadcast)(-start)?"
)
_CALLED = re.compile(r"\b(?:calls|body|condition|to_apply)=%([^\s,}]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
# A fusion's backend: a GPU's Triton or cuDNN GEMM fusion, a CPU's library fusion (YNNPACK, ...).
_FUSION_KIND = re.compile(r'"(?:fusion_backend_config|fusion_config)":\{"kind":"([^"]+)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# Instructions that move or widen a value without computing with it: a float8 value read
# through them is still the GEMM's float8 operand.
_MOVES = ("convert", "bitcast", "copy", "reshape", "transpose", "broadcast", "slice")
# Packages whose frames are not the user's line.
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax", "numpy")


def dtype_name(element_type: str) -> str:
    """NumPy's name of an HLO element type: ``bf16`` -> ``bfloat16``, ``f8e4m3fn`` ->
    ``float8_e4m3fn``, ``s32`` -> ``int32``, ``pred`` -> ``bool``."""
    if element_type == "bf16":
        return "bfloat16"
    if element_type == "pred":
        return "bool"
    if match := re.fullmatch(r"f(\d+)(e\w+)?", element_type):
        bits, kind = match.groups()
        return f"float{bits}_{kind}" if kind else f"float{bits}"
    if match := re.fullmatch(r"([su])(\d+)", element_type):
        return f"{'int' if match.group(1) == 's' else 'uint'}{match.group(2)}"
    return element_type


def _is_float8(element_type: str) -> bool:
    """float8 data (e4m3, e5m2 and their variants), not the e8m0 block-scale type."""
    return element_type.startswith("f8") and not element_type.startswith("f8e8m0")


@dataclasses.dataclass(frozen=True)
class GemmInfo:
    """One matrix product of a compiled program.

    Attributes:
      name: the HLO instruction that runs it (a custom call, a fusion or a dot).
      operand_dtypes: the dtypes of its two matrix operands (``"float8_e4m3fn"``,
        ``"bfloat16"``); on a target without FP8 GEMMs, where XLA widens float8 operands right
        before the GEMM, their float8 type.
      read_dtypes: the dtypes the GEMM itself reads: ``operand_dtypes`` but where XLA
        emulates an FP8 GEMM in a wider type.
      output_dtype: the result's dtype.
      shape: the result's shape (a batched GEMM's batch dims first).
      runs_on: cuBLASLt FP8, cuBLASLt, cuBLAS, a te_flax kernel (by name), XLA's expansion of
        ``ragged_dot``, a Triton or cuDNN GEMM fusion, or an XLA dot.
      bytes: the bytes it moves (operands read once, result written once), those of the whole
        fusion for a GEMM XLA fused with other work.
      runs: how many times one call of the program runs it (a loop's trip count, e.g. once per
        layer of a scanned model); None where a loop's trip count is not known.
      backward: whether it comes from a backward pass (a transposed JAX op).
      source: the user's line that traced it, ``"model.py:42 (Block.__call__)"``.
      stack: every Python frame of its metadata, innermost first, ``"file:line (function)"``.
    """

    name: str
    operand_dtypes: tuple[str, str]
    read_dtypes: tuple[str, str]
    output_dtype: str
    shape: tuple[int, ...]
    runs_on: str
    bytes: float
    runs: int | None
    backward: bool
    source: str
    stack: tuple[str, ...]

    @property
    def fp8(self) -> bool:
        """Whether both operands are float8 (read as such, or widened by XLA where the target
        has no FP8 GEMM)."""
        return all(name.startswith("float8") for name in self.operand_dtypes)

    @property
    def emulated(self) -> bool:
        """Whether XLA widens float8 operands before the GEMM (a target without FP8 GEMMs)."""
        return self.read_dtypes != self.operand_dtypes

    @property
    def dtypes(self) -> str:
        """The operand dtypes in one word, ``"bfloat16"`` or ``"float8_e5m2 x float8_e4m3fn"``."""
        first, second = self.operand_dtypes
        return first if first == second else f"{first} x {second}"


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    """One collective of a compiled program.

    Attributes:
      name: the HLO instruction.
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"``,
        ``"collective-permute"``, ...
      dtypes: the dtypes of the arrays it moves, each once.
      bytes: the bytes of its inputs.
      runs: how many times one call of the program runs it (None: a loop of unknown length).
      backward: whether it comes from a backward pass.
      source: the user's line that traced it.
      stack: every Python frame of its metadata, innermost first.
    """

    name: str
    kind: str
    dtypes: tuple[str, ...]
    bytes: float
    runs: int | None
    backward: bool
    source: str
    stack: tuple[str, ...]

    @property
    def fp8(self) -> bool:
        """Whether it moves float8 data."""
        return any(name.startswith("float8") for name in self.dtypes)


@dataclasses.dataclass(frozen=True)
class ExplainReport:
    """What ``te_flax.explain`` found in a compiled program: its GEMMs and collectives.

    ``str(report)`` is a table: the summary, then one row per GEMM (operand dtypes, output,
    where it runs, bytes, how often it runs, source line), then one per collective.

    Attributes:
      target: what the program was compiled for (``"h100 (deviceless)"``, ``"cpu"``, ...).
      gemms: every matrix product of the compiled program, forward ones first.
      collectives: every collective of the compiled program.
      compile_seconds: how long lowering and compiling took.
      hlo: the optimized HLO text the report was read from.
    """

    target: str
    gemms: tuple[GemmInfo, ...]
    collectives: tuple[CollectiveInfo, ...]
    compile_seconds: float
    hlo: str = dataclasses.field(repr=False)

    @property
    def summary(self) -> str:
        """How many GEMMs run in FP8 and the source lines of the others, in one line."""
        return _summary(self.gemms, self.collectives)

    def __str__(self) -> str:
        return _table(self)


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class _Program:
    """An optimized module's instructions, who calls each computation, and source frames."""

    instructions: dict[str, Instruction]
    callers: dict[str, Instruction]  # computation -> the instruction that calls it
    roots: dict[str, str]  # computation -> its ROOT instruction
    frames: dict[int, tuple[SourceFrame, ...]]

    @classmethod
    def read(cls, hlo_text: str) -> _Program:
        found = instructions(hlo_text)
        callers: dict[str, Instruction] = {}
        roots = {}
        for instruction in found.values():
            called = _CALLED.findall(instruction.line)
            for listed in _CALLED_LISTS.findall(instruction.line):
                called += re.findall(r"%([^\s,}]+)", listed)
            for computation in called:
                callers.setdefault(computation, instruction)
            if instruction.root:
                roots[instruction.computation] = instruction.name
        return cls(found, callers, roots, stack_frames(hlo_text))

    def executor(self, instruction: Instruction) -> Instruction:
        """The instruction that runs ``instruction``: the outermost fusion around it, or
        itself."""
        while (caller := self.callers.get(instruction.computation)) and caller.opcode == "fusion":
            instruction = caller
        return instruction

    def runs(self, instruction: Instruction) -> int | None:
        """How many times one call of the program runs ``instruction``: the product of the
        known trip counts of the loops around it (None if one is not known)."""
        runs, seen = 1, set()
        while (caller := self.callers.get(instruction.computation)) and caller.name not in seen:
            seen.add(caller.name)
            if caller.opcode == "while":
                trips = _TRIPS.search(caller.line)
                if trips is None:
                    return None
                runs *= int(trips.group(1))
            instruction = caller
        return runs

    def float8_source(self, name: str) -> str | None:
        """The float8 type of the value ``name`` reads through moves and widening converts (in
        and out of fusions), or None where it is computed from something else."""
        for _ in range(len(self.instructions)):  # a chain visits each instruction once
            instruction = self.instructions.get(name)
            if instruction is None:
                return None
            if _is_float8(instruction.element_type):
                return instruction.element_type
            caller = self.callers.get(instruction.computation)
            number = instruction.parameter_number
            if number is not None and caller is not None and caller.opcode == "fusion":
                name = caller.operands[number]
            elif instruction.opcode == "fusion" and (root := self._called_root(instruction)):
                name = root
            elif instruction.opcode in _MOVES and instruction.operands:
                name = instruction.operands[0]
            else:
                return None
        return None

    def _called_root(self, fusion: Instruction) -> str | None:
        called = _CALLED.search(fusion.line)
        return self.roots.get(called.group(1)) if called else None

    def moved(self, instruction: Instruction) -> float:
        operands = dict.fromkeys(instruction.operands)
        types = [self.instructions[name].result for name in operands if name in self.instructions]
        return moved_bytes(instruction.opcode, instruction.line, instruction.result, types)

    def stack(self, instruction: Instruction) -> tuple[SourceFrame, ...]:
        return source_of(instruction, self.frames)


# ----------------------------------------------------------------------------- source lines


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """te_flax's folder, the libraries' and Python's own."""
    folders = [Path(__file__).resolve().parents[1], Path(sysconfig.get_paths()["stdlib"])]
    for package in _LIBRARIES:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            folders += [Path(p) for p in spec.submodule_search_locations]
    return tuple(str(folder.resolve()) + os.sep for folder in folders)


@functools.cache
def _in_library(file: str) -> bool:
    return str(Path(file).resolve()).startswith(_library_folders())


def _shown(frame: SourceFrame) -> str:
    """``file:line (function)``, the file relative to the working folder when inside it."""
    path = frame.file
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:  # another drive (Windows)
        pass
    # A nested function by its own name: ``layer``, not ``make.<locals>.step.<locals>.layer``.
    name = frame.function.rsplit(".<locals>.", 1)[-1]
    function = f" ({name})" if name else ""
    return f"{path}:{frame.line}{function}"


def _user_line(frames: tuple[SourceFrame, ...]) -> str:
    """The innermost frame outside te_flax and the libraries under it (else the outermost)."""
    if not frames:
        return "(no source line in the HLO)"
    for frame in frames:
        if not _in_library(frame.file):
            return _shown(frame)
    return _shown(frames[-1])


# ----------------------------------------------------------------------------- reading GEMMs


def _matrix_operands(program: _Program, instruction: Instruction) -> list[str]:
    """The two matrix operands of a GEMM instruction."""
    if instruction.opcode != "custom-call" or instruction.custom_call_target.startswith("__"):
        return list(instruction.operands[:2])  # a dot, a ragged-dot, a cuBLAS call
    # A te_flax kernel also reads group sizes, offsets and scales: its float8 operands, else
    # its two largest floating-point ones.
    typed = [
        (name, program.instructions[name])
        for name in instruction.operands
        if name in program.instructions
    ]
    float8 = [name for name, operand in typed if _is_float8(operand.element_type)]
    if len(float8) >= 2:
        return float8[:2]
    floats = [(name, o) for name, o in typed if re.fullmatch(r"bf16|f\d+\w*", o.element_type)]
    floats.sort(key=lambda item: -math.prod(item[1].dims))
    return sorted((name for name, _ in floats[:2]), key=instruction.operands.index)


def _runs_on(program: _Program, instruction: Instruction, executor: Instruction) -> str | None:
    """Where a GEMM instruction runs, or None if it is no GEMM."""
    target = instruction.custom_call_target
    if instruction.opcode == "custom-call" and target.startswith("__cublas$"):
        label = _CUBLAS.get(target, f"cuBLAS ({target})")
    elif instruction.opcode == "custom-call" and target in (TRITON_CALL, MOSAIC_CALL):
        kernel = _KERNEL_NAME.search(instruction.line)
        return f"te_flax kernel {kernel.group(1)}" if kernel else None
    elif instruction.opcode in ("dot", "ragged-dot"):
        kind = _FUSION_KIND.search(executor.line) if executor is not instruction else None
        label = f"XLA {instruction.opcode}"
        if kind and "triton" in kind.group(1):
            label = "Triton GEMM fusion"
        elif kind and "cudnn" in kind.group(1):
            label = "cuDNN GEMM fusion"
        elif kind:
            label += f" ({kind.group(1)})"
    else:
        return None
    if "ragged_dot" in instruction.op_name:
        return f"XLA's expansion of ragged_dot: {label}"
    return label


def _gemm(program: _Program, instruction: Instruction, fp8_gemms: bool) -> GemmInfo | None:
    executor = program.executor(instruction)
    runs_on = _runs_on(program, instruction, executor)
    if runs_on is None:
        return None
    operands = [program.instructions[name] for name in _matrix_operands(program, instruction)]
    read = tuple(dtype_name(operand.element_type) for operand in operands)
    held = tuple(
        dtype_name(program.float8_source(operand.name) or operand.element_type)
        for operand in operands
    )
    wider = "/".join(sorted(set(read)))
    if read != held and fp8_gemms:  # XLA dequantized float8 operands: no FP8 GEMM
        runs_on += f", float8 widened to {wider} before it"
        held = read
    elif read != held:
        runs_on += f", FP8 emulated in {wider}"
    stack = program.stack(instruction)
    return GemmInfo(
        name=executor.name,
        operand_dtypes=(held[0], held[-1]),
        read_dtypes=(read[0], read[-1]),
        output_dtype=dtype_name(instruction.element_type),
        shape=instruction.dims,
        runs_on=runs_on,
        bytes=program.moved(executor),
        runs=program.runs(executor),
        backward="transpose(" in instruction.op_name,
        source=_user_line(stack),
        stack=tuple(_shown(frame) for frame in stack),
    )


def _collective(program: _Program, instruction: Instruction) -> CollectiveInfo:
    operands = [program.instructions[name] for name in instruction.operands]
    stack = program.stack(instruction)
    kind = _COLLECTIVE.fullmatch(instruction.opcode)
    assert kind is not None, instruction.opcode
    return CollectiveInfo(
        name=instruction.name,
        kind=kind.group(1),
        dtypes=tuple(dict.fromkeys(dtype_name(o.element_type) for o in operands)),
        bytes=sum(math.prod(o.dims) * element_bytes(o.element_type) for o in operands),
        runs=program.runs(instruction),
        backward="transpose(" in instruction.op_name,
        source=_user_line(stack),
        stack=tuple(_shown(frame) for frame in stack),
    )


def read_report(
    hlo_text: str, target: str, compile_seconds: float = 0.0, fp8_gemms: bool = True
) -> ExplainReport:
    """The report of an optimized HLO module (``compiled.as_text()``) compiled for ``target``;
    ``fp8_gemms``: whether the target has FP8 GEMMs (False: XLA emulates them, a CPU)."""
    program = _Program.read(hlo_text)
    gemms, collectives = [], []
    for instruction in program.instructions.values():
        if _COLLECTIVE.fullmatch(instruction.opcode):
            collectives.append(_collective(program, instruction))
        elif gemm := _gemm(program, instruction, fp8_gemms):
            gemms.append(gemm)
    gemms.sort(key=lambda gemm: gemm.backward)  # forward first, each pass in program order
    return ExplainReport(target, tuple(gemms), tuple(collectives), compile_seconds, hlo_text)


# ----------------------------------------------------------------------------- the text


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _summary(gemms: tuple[GemmInfo, ...], collectives: tuple[CollectiveInfo, ...]) -> str:
    if not gemms:
        text = "no GEMM in the compiled program"
    else:
        fp8 = [gemm for gemm in gemms if gemm.fp8]
        text = f"{len(fp8)} of {len(gemms)} GEMMs in FP8"
        others: dict[str, list[GemmInfo]] = {}
        for gemm in gemms:
            if not gemm.fp8:
                others.setdefault(gemm.dtypes, []).append(gemm)
        for dtypes, group in others.items():
            lines = ", ".join(dict.fromkeys(gemm.source for gemm in group))
            text += f"; {len(group)} in {dtypes}: {lines}"
        if any(gemm.emulated for gemm in fp8):
            text += "; FP8 emulated (this target has no FP8 GEMM)"
    if collectives:
        dtypes = ", ".join(dict.fromkeys(d for c in collectives for d in c.dtypes))
        plural = "s" if len(collectives) > 1 else ""
        text += f"; {len(collectives)} collective{plural} ({dtypes})"
    return text


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def _runs(runs: int | None) -> str:
    return "?" if runs is None else str(runs)


def _table(report: ExplainReport) -> str:
    lines = [
        f"te_flax.explain: {report.target}, compiled in {report.compile_seconds:.1f} s",
        report.summary,
        "",
        "GEMMs",
    ]
    header = ["pass", "operands", "output", "runs on", "bytes", "runs", "source"]
    rows = [
        [
            "backward" if gemm.backward else "forward",
            gemm.dtypes,
            f"{gemm.output_dtype}[{','.join(map(str, gemm.shape))}]",
            gemm.runs_on,
            _size(gemm.bytes),
            _runs(gemm.runs),
            gemm.source,
        ]
        for gemm in report.gemms
    ]
    lines += _columns([header, *rows]) if rows else ["  (none)"]
    lines += ["", "Collectives"]
    header = ["kind", "dtypes", "bytes", "runs", "source"]
    rows = [
        [c.kind, ", ".join(c.dtypes), _size(c.bytes), _runs(c.runs), c.source]
        for c in report.collectives
    ]
    lines += _columns([header, *rows]) if rows else ["  (none)"]
    return "\n".join(lines)
