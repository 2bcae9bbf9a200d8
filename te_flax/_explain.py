"""``te_flax.explain``: which GEMMs of a compiled program run in FP8, and where.

It compiles a function for a target and reads the optimized program (``te_flax._tools``: the
HLO reader, the report, the targets). It sits in the top row of the package because an H100
program compiled on a machine without one must be traced as a GPU process traces it, with
te_flax's Pallas kernels where ``"auto"`` takes them (``te_flax._ops.kernels``): the report then
names the kernels a real H100 runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from te_flax._ops.kernels import mode, pallas_kernels
from te_flax._tools.explain import ExplainReport, read_report
from te_flax._tools.show_config import fp8_gemm_is_native
from te_flax._tools.targets import (
    GPU_TARGETS,
    HOST_TARGETS,
    deviceless_gpus,
    local_gpu,
    on_devices,
)

__all__ = ["TARGETS", "explain"]

TARGETS = (*GPU_TARGETS, *HOST_TARGETS)
# A deviceless compile has no autotuner: without this XLA hands FP8 dots to Triton GEMM fusions
# where a real H100 (which autotunes) runs cuBLASLt (DESIGN.md, "Checking the FP8 lowering").
_DEVICELESS_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def explain(
    fn: Callable[..., Any], *args: Any, target: str = "h100", **kwargs: Any
) -> ExplainReport:
    """Compiles ``fn(*args, **kwargs)`` for ``target`` and reports every GEMM of the compiled
    program: its operand dtypes (float8 or not), where it runs (cuBLASLt, a te_flax kernel, XLA's
    expansion of ``ragged_dot``, an XLA dot), its bytes and the source line that traced it, and
    every collective with its dtypes and bytes. ``print(report)`` shows a table with a one-line
    summary first ("5 of 7 GEMMs in FP8; 2 in bfloat16: <their source lines>").

    Nothing runs: the program is only compiled. Give a training step (a ``value_and_grad``) to
    see the backward GEMMs too, since a forward alone has only the forward ones.

    Args:
      fn: the function, jitted or not (a jitted one keeps its static arguments and shardings).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (pytrees of them); sharded
        arrays keep their mesh's shape and axis names on the target's devices.
      target: ``"h100"`` (default) compiles for an NVIDIA H100, with XLA's GPU compiler and no
        GPU where this machine has none (a deviceless compile: needs the ``gpu-compile``
        extra); ``"cpu"`` for this machine's CPU (FP8 GEMMs are emulated there: XLA widens the
        float8 operands, which the report says); ``"host"`` for JAX's default backend.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      An ``ExplainReport``: ``gemms``, ``collectives``, ``summary``, ``hlo``.

    Example usage::

      >>> import jax, jax.numpy as jnp, te_flax
      >>> report = te_flax.explain(jnp.dot, jnp.ones((8, 16)), jnp.ones((16, 4)), target="cpu")
      >>> [(gemm.dtypes, gemm.fp8) for gemm in report.gemms]
      [('float32', False)]
    """
    if target not in TARGETS:
        raise ValueError(
            f"explain(target=...) takes one of {', '.join(map(repr, TARGETS))} (a GPU to "
            f"compile for, with or without one here, or this machine), got {target!r}"
        )
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    options: dict[str, Any] | None = None
    described = target
    fp8_gemms = target in GPU_TARGETS
    tracing: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if target == "cpu" and jax.default_backend() != "cpu":
        args, kwargs = on_devices((args, kwargs), jax.devices("cpu"))
    elif target in GPU_TARGETS and not local_gpu(target):
        count = max(1, _device_count((args, kwargs)))
        args, kwargs = on_devices((args, kwargs), deviceless_gpus(target, count))
        options, described = _DEVICELESS_OPTIONS, f"{target} (deviceless compile)"
        tracing = _as_on_a_gpu()
    elif target == "host":
        described = f"host ({jax.default_backend()})"
        fp8_gemms = fp8_gemm_is_native()
    start = time.perf_counter()
    with tracing:
        lowered = jitted.lower(*args, **kwargs)
    hlo_text = lowered.compile(options).as_text() or ""
    return read_report(hlo_text, described, time.perf_counter() - start, fp8_gemms)


@contextlib.contextmanager
def _as_on_a_gpu() -> Iterator[None]:
    """Traces as a process with a GPU does: the kernel mode in force, the kernels of a GPU."""
    with pallas_kernels(mode(), assume_gpu=True):
        yield


def _device_count(tree: Any) -> int:
    """The devices of the largest sharding among the arguments."""
    counts = [
        len(leaf.sharding.device_set)
        for leaf in jax.tree.leaves(tree)
        if getattr(leaf, "sharding", None) is not None
    ]
    return max(counts, default=1)
