"""Where a compiled CPU program spends its time, from a JAX profiler trace.

XLA:CPU runs a program as a sequence of thunks, one per entry instruction (a fusion, a GEMM
fusion, a copy...), and records each as a trace event named after the instruction. Summing the
events of one run gives the time per instruction; instructions whose fused computation holds a
``dot`` are the GEMMs.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics
import tempfile
from pathlib import Path

import jax

__all__ = ["profile"]

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*?)\s+([a-z\-]+)\(")
_CALLS = re.compile(r"calls=%([^\s,]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")


def _instructions(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """Entry instruction name -> result type, and the names of those that run a GEMM."""
    bodies: dict[str, list[str]] = {}
    entry: list[str] = []
    current = None
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            current = entry
        elif match := _COMPUTATION.match(line):
            current = bodies.setdefault(match.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    with_dot = {name for name, body in bodies.items() if any(" dot(" in line for line in body)}
    results, gemms = {}, set()
    for line in entry:
        if match := _INSTRUCTION.match(line):
            name, result, opcode = match.groups()
            results[name] = re.sub(r"\{[^}]*\}", "", result)
            calls = _CALLS.search(line)
            if opcode == "dot" or (calls and calls.group(1) in with_dot):
                gemms.add(name)
    return results, gemms


def _trace_once(compiled, args: tuple, names: dict) -> collections.Counter:
    """Milliseconds per entry instruction in one traced run."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            jax.block_until_ready(compiled(*args))
        traces = list(Path(folder).glob("**/*.trace.json.gz"))
        if not traces:
            return collections.Counter()
        with gzip.open(traces[0]) as trace:
            events = json.load(trace)
    events = events["traceEvents"] if isinstance(events, dict) else events
    milliseconds: collections.Counter = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in names:
            milliseconds[event["name"]] += event.get("dur", 0) / 1000
    return milliseconds


def profile(compiled, args: tuple, runs: int = 3, top: int = 4) -> dict:
    """Milliseconds of a run of ``compiled(*args)``: in all, in GEMMs, and the top others.

    Each instruction's time is its median over ``runs`` traced runs, which keeps most of the
    noise of a shared machine out.
    """
    results, gemms = _instructions(compiled.as_text())
    jax.block_until_ready(compiled(*args))  # warm
    traced = [_trace_once(compiled, args, results) for _ in range(runs)]
    names = set().union(*traced)
    milliseconds = collections.Counter(
        {name: statistics.median(run.get(name, 0.0) for run in traced) for name in names}
    )
    if not milliseconds:
        return {}
    gemm_ms = sum(ms for name, ms in milliseconds.items() if name in gemms)
    others = [(name, ms) for name, ms in milliseconds.most_common() if name not in gemms]
    return {
        "total_ms": sum(milliseconds.values()),
        "gemm_ms": gemm_ms,
        "other_ms": sum(ms for _, ms in others),
        "gemms": len(gemms),
        "runs": runs,
        "top_gemms": [
            {"name": name, "ms": ms, "result": results[name]}
            for name, ms in milliseconds.most_common()
            if name in gemms
        ][:top],
        "top_other": [
            {"name": name, "ms": ms, "result": results[name]} for name, ms in others[:top]
        ],
    }
