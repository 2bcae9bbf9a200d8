"""The one switch of te_flax's Pallas kernels, and the dispatch between a kernel and XLA.

``TE_FLAX_PALLAS`` (environment variable, read when a function is traced) or
``pallas_kernels(mode)`` (a context manager, which wins over the variable):

- ``"auto"`` (default): on CUDA GPUs the kernels that save memory traffic (``AUTO``), the XLA
  stages everywhere else. The choice is made per platform when the program is lowered
  (``lax.platform_dependent``), so a program compiled for a GPU from a CPU host (a deviceless
  compile) gets the kernels too.
- ``"1"``: every kernel, everywhere; on platforms other than CUDA they run in Pallas interpret
  mode (slow, for tests).
- ``"0"``: the XLA stages everywhere.

Programs partitioned over a mesh of more than one device (outside ``shard_map``) keep the XLA
stages: a custom call is not partitioned by XLA's SPMD partitioner, which would gather its
operands.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import jax
from jax import lax

__all__ = ["AUTO", "ENV_VAR", "MODES", "dispatch", "mode", "pallas_kernels"]

ENV_VAR = "TE_FLAX_PALLAS"
MODES = ("auto", "0", "1")
_ALIASES = {"on": "1", "true": "1", "off": "0", "false": "0"}
T = TypeVar("T")
# The kernels "auto" uses (see ``dispatch``); "1" uses every kernel. The norm-quantize kernel
# is left out: in a deviceless H100 compile of the benchmark steps it moves as many bytes as
# the XLA fusion it replaces (XLA already fuses normalize, quantize and amax), give or take a
# few kilobytes, so it buys nothing measurable.
AUTO = frozenset({"norm_backward"})
_override: list[str] = []


def _checked(value: str, source: str) -> str:
    normalized = _ALIASES.get(value.strip().lower(), value.strip().lower())
    if normalized not in MODES:
        raise ValueError(
            f"{source} must be one of {', '.join(MODES)} (Pallas kernels on GPUs, everywhere, "
            f"or nowhere), got {value!r}"
        )
    return normalized


def mode() -> str:
    """The active mode: the innermost ``pallas_kernels`` context, else ``TE_FLAX_PALLAS``."""
    if _override:
        return _override[-1]
    return _checked(os.environ.get(ENV_VAR, "auto"), ENV_VAR)


@contextlib.contextmanager
def pallas_kernels(value: str) -> Iterator[None]:
    """Within the context, functions traced use the Pallas kernels per ``value``.

    Args:
      value: ``"auto"`` (CUDA GPUs only), ``"1"`` (everywhere, interpret mode off GPUs) or
        ``"0"`` (never).
    """
    _override.append(_checked(value, "pallas_kernels(value)"))
    try:
        yield
    finally:
        _override.pop()


def _partitioned() -> bool:
    """True inside a mesh of more than one device whose axes are not all manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return False
    return set(mesh.manual_axes) != set(mesh.axis_names)


def dispatch(
    name: str,
    kernel: Callable[..., T],
    fallback: Callable[..., T],
    *args: Any,
    supported: bool = True,
) -> T:
    """``kernel(*args, interpret=...)`` where the switch selects it, else ``fallback(*args)``.

    Both must return the same pytree of arrays. ``supported`` is False where the kernel cannot
    take these operands (shapes, dtypes); the fallback runs then whatever the switch says.
    Under ``"auto"`` only the kernels named in ``AUTO`` are used: those that move fewer bytes
    than the XLA fusions they replace in a whole training step.
    """
    selected = mode()
    if selected == "0" or not supported or _partitioned():
        return fallback(*args)
    if selected == "auto" and name not in AUTO:
        return fallback(*args)
    on_gpu = partial(kernel, interpret=False)
    elsewhere = partial(kernel, interpret=True) if selected == "1" else fallback
    return lax.platform_dependent(*args, cuda=on_gpu, default=elsewhere)
