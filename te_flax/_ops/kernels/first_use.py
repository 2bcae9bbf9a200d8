"""A kernel configuration checked on its first use: run once on a small problem beside its XLA
stage, on the GPU that will run it, before any program uses it.

No te_flax kernel had run on a GPU when it became the default there, and interpret mode on a
CPU cannot see what only the hardware does (the tensor cores' layouts, TMA copies past an
array's end, the accumulator's precision). So the first time a process traces a kernel
configuration for the CUDA GPU it has, ``switch.dispatch`` runs that configuration once on a
small problem (``Probe``) and compares it with its XLA stage on the same operands. Where they
disagree, or where the kernel does not compile or run, te_flax uses the XLA stage for that
configuration for the rest of the process and warns once (``KernelCheckWarning``), naming the
kernel, the configuration and the error. A configuration is what the kernel compiles
differently for (operand dtypes, tile shapes, static options), not the problem's size.

``TE_FLAX_KERNEL_CHECK`` (environment variable, read when a function is traced) or
``kernel_checks(mode)`` (a context manager, which wins over the variable):

- ``"auto"`` (default): check each configuration once per process on a CUDA GPU, in
  single-process programs (the processes of a multi-process program must trace the same
  program, which verdicts reached apart could break: check there with a one-process run,
  ``scripts/gpu_check``);
- ``"0"``: no check, the kernels run unchecked (the opt-out, once the configurations a model
  uses are known to agree on its GPU: the check costs the first step a few small compiles);
- ``"1"``: check everywhere, off GPUs in interpret mode (for tests).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_flax._base.settings import ScopedSetting

__all__ = [
    "ENV_VAR",
    "MODES",
    "KernelCheckWarning",
    "Probe",
    "active_mode",
    "agrees",
    "check_mode",
    "checked",
    "forget",
    "kernel_checks",
    "parsed_mode",
    "random_operand",
]

ENV_VAR = "TE_FLAX_KERNEL_CHECK"
MODES = ("auto", "0", "1")
_ALIASES = {"on": "1", "true": "1", "off": "0", "false": "0"}
_SELECTED: ScopedSetting[str | None] = ScopedSetting("kernel_checks", None)
# (kernel name, configuration) -> None where the kernel agreed, else the disagreement.
_VERDICTS: dict[tuple[str, Hashable], str | None] = {}


class KernelCheckWarning(UserWarning):
    """A te_flax kernel disagreed with its XLA stage on its first use: the XLA stage runs."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """One kernel configuration's check: a small problem for the kernel and its XLA stage.

    Attributes:
      configuration: what the kernel compiles differently for (hashable; in the warning).
      operands: makes the small problem's operands (arrays of the configuration's dtypes
        and tiling).
      kernel: ``kernel(*operands, interpret=...)``, the configuration's kernel.
      xla: ``xla(*operands)``, its XLA stage; the same pytree of results.
      tolerance: the largest difference allowed, relative to the largest magnitude of each
        result of the XLA stage: loose enough for another order of float32 sums and for a
        16-bit rounding the other way, far below what a wrong layout, tile or copy gives.
    """

    configuration: Hashable
    operands: Callable[[], tuple[Any, ...]]
    kernel: Callable[..., Any]
    xla: Callable[..., Any]
    tolerance: float = 2**-5


def parsed_mode(value: str, source: str, meaning: str) -> str:
    """``value`` as one of ``MODES`` (``on`` and ``true`` are ``"1"``, ``off`` and ``false``
    ``"0"``), the mode of a kernel setting (this one's, or the kernel switch's); ``source``
    and ``meaning`` name the setting and its modes in the error."""
    normalized = _ALIASES.get(value.strip().lower(), value.strip().lower())
    if normalized not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(MODES)} ({meaning}), got {value!r}")
    return normalized


def active_mode(selected: str | None, env_var: str, meaning: str) -> str:
    """A kernel setting's mode: ``selected`` (its innermost context), else ``env_var``'s."""
    if selected is not None:
        return selected
    return parsed_mode(os.environ.get(env_var, "auto"), env_var, meaning)


_MEANING = "check each kernel configuration on its first use on a GPU, never, or everywhere"


def check_mode() -> str:
    """The active mode: the innermost ``kernel_checks`` context, else ``TE_FLAX_KERNEL_CHECK``."""
    return active_mode(_SELECTED.value, ENV_VAR, _MEANING)


@contextlib.contextmanager
def kernel_checks(value: str) -> Iterator[None]:
    """Within the context, the first use of a kernel configuration is checked per ``value``:
    ``"auto"`` (on CUDA GPUs), ``"0"`` (never) or ``"1"`` (everywhere, interpret mode off
    GPUs). The mode is part of ``jax.jit``'s cache key."""
    with _SELECTED.scope(parsed_mode(value, "kernel_checks(value)", _MEANING)):
        yield


def agrees(name: str, probe: Probe | None, on_gpu: bool) -> bool:
    """Whether the kernel ``name`` may run the configuration of ``probe``: True without a
    probe or a check to make; else the configuration's verdict, checked on first use (on this
    process's GPU, or off one in interpret mode under ``"1"``)."""
    mode = check_mode()
    if probe is None or mode == "0" or (mode == "auto" and not on_gpu):
        return True
    if mode == "auto" and jax.process_count() > 1:
        # Every process of a multi-process program must trace the same program: a verdict
        # reached apart on each could differ (a failure on one host) and hang a collective.
        return True
    key = (name, probe.configuration)
    if key not in _VERDICTS:
        _VERDICTS[key] = _disagreement(probe, interpret=not on_gpu)
        if _VERDICTS[key] is not None:
            warnings.warn(
                f"te_flax's {name} kernel disagrees with its XLA stage on a small problem "
                f"of its configuration {probe.configuration}: {_VERDICTS[key]}. te_flax runs "
                "the XLA stage for this configuration in this process (the step is right, "
                "without the kernel's speed). Please report it with the GPU and the JAX "
                f"version; {ENV_VAR}=0 turns the check off, TE_FLAX_PALLAS=0 every kernel.",
                KernelCheckWarning,
                stacklevel=4,
            )
    return _VERDICTS[key] is None


def checked() -> dict[tuple[str, Hashable], str | None]:
    """Every configuration checked in this process: None where it agreed, else the error."""
    return dict(_VERDICTS)


def forget() -> None:
    """Forgets every verdict: the next use of each configuration is checked again, as in a new
    process (for tests)."""
    _VERDICTS.clear()


def _disagreement(probe: Probe, interpret: bool) -> str | None:
    """None where the kernel's results are the XLA stage's within ``probe.tolerance``; else
    what differs, or the error that stopped the kernel.

    Both run now, in a thread of their own: JAX's trace state is per thread, so there the
    probe's programs are compiled and run apart from the program being traced (whose trace
    would otherwise take in the operands, and the interpreter's host callbacks)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            got, want = pool.submit(_run, probe, interpret).result()
        except Exception as error:  # a kernel that fails to compile or run disagrees too
            return f"{type(error).__name__}: {error}"[:400]
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} results where the XLA stage has {len(want_leaves)}"
    for index, (actual, expected) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        difference = _difference(np.asarray(actual), np.asarray(expected), probe.tolerance)
        if difference is not None:
            return f"result {index}: {difference}"
    return None


def _run(probe: Probe, interpret: bool) -> tuple[Any, Any]:
    """The kernel's and the XLA stage's results on the probe's operands, on the host."""
    operands = probe.operands()
    got = jax.jit(partial(probe.kernel, interpret=interpret))(*operands)
    want = jax.jit(probe.xla)(*operands)
    return jax.device_get((got, want))


def _difference(actual: np.ndarray, expected: np.ndarray, tolerance: float) -> str | None:
    """What tells ``actual`` from ``expected`` beyond ``tolerance`` (of the largest magnitude;
    float8 values: one step of their format, element by element), or None."""
    if actual.shape != expected.shape:
        return f"shape {actual.shape} where the XLA stage's is {expected.shape}"
    float8 = expected.dtype.itemsize == 1 and jnp.issubdtype(expected.dtype, jnp.floating)
    step = float(jnp.finfo(expected.dtype).eps) if float8 else 0.0
    smallest = float(jnp.finfo(expected.dtype).tiny) if float8 else 0.0
    actual, expected = actual.astype(np.float64), expected.astype(np.float64)
    if not np.array_equal(np.isnan(actual), np.isnan(expected)):
        return "NaN where the XLA stage has none, or the reverse"
    finite = ~np.isnan(expected)
    actual, expected = actual[finite], expected[finite]
    error = np.abs(actual - expected)
    if float8:
        if np.any(error > step * np.abs(expected) + smallest):
            return f"{int(np.sum(error > step * np.abs(expected) + smallest))} float8 values off"
        return None
    largest = float(np.max(np.abs(expected), initial=0.0))
    if float(np.max(error, initial=0.0)) > tolerance * largest:
        return (
            f"off by {float(np.max(error)):.3g} where the XLA stage's largest magnitude is "
            f"{largest:.3g}"
        )
    return None


def random_operand(seed: int, shape: tuple[int, ...], dtype: Any, scale: float = 1.0) -> Any:
    """A normal operand of ``dtype`` (float8 too) for a probe's small problem."""
    values = np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(scale)
    return values.astype(jnp.dtype(dtype))
