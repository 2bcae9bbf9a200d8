"""Every use of JAX's private internals, and the range of JAX and Flax te_flax is tested with.

te_flax runs on one code base across a declared range of JAX and Flax releases
(``TESTED_RANGE``; CI runs the whole suite at the newest end and a quick tier at the oldest).
Three of its optimizations need something JAX has no public name for. Each is read here, from
``jax._src``, guarded: where a JAX release has moved it, te_flax takes a slower path that gives
the same numbers, and says so once (a ``RuntimeWarning`` naming the feature). No other module
imports ``jax._src``.

- ``is_batch_tracer``: whether an operand is being batched by ``vmap`` (the kernels'
  partitioning rule has none; such operands take the XLA stages). Fallback: every tracer on a
  partitioned mesh is treated as batched, so the XLA stages run there.
- ``traced_for_scan``: whether a value was traced in a ``lax.scan`` body (a scanned kernel is
  quantized in place, not copied out for a kernel). Fallback: False (a copy, no error).
- ``partial_eval_jaxpr_nounits``: JAX's partial evaluation, which ``accumulate_gradients``
  uses to quantize the kernels once per step. Fallback: None; they are quantized in every
  microbatch (``quantize_once=False``).

``pallas_triton_kept()``: the Pallas Triton backend, which every te_flax kernel is written in
today, is deprecated from jax 0.12 on (every lowering warns, and a later release removes it).
Under ``TE_FLAX_PALLAS=auto`` the kernels are used only where it is kept without a warning
(``docs/versions.md``, "Kernel backends"). ``mixed_fp8_wgmma()``: whether the Mosaic GPU
grouped GEMM kernels can multiply e4m3 by e5m2 (the float8 gradient GEMMs); where not, those
GEMMs take the XLA lowering.

``add_eagerly_by_max``: outside ``jit`` JAX has no rule to add cotangents of an extended dtype,
which te_flax's max-merge of a reused FP8 state uses; one is registered from ``jax._src``.
Fallback: said once, and such a reuse needs ``jit``.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "JAX_VERSION",
    "TESTED_RANGE",
    "add_eagerly_by_max",
    "is_batch_tracer",
    "mixed_fp8_wgmma",
    "mosaic_gpu_interpreted",
    "outside_tested_range",
    "pallas_triton_kept",
    "partial_eval_jaxpr_nounits",
    "traced_for_scan",
    "version_tuple",
]

# package -> (oldest tested, newest tested minor line): pyproject.toml's ranges, whose upper
# bounds are the first releases not tested.
TESTED_RANGE = {
    "jax": ("0.10.2", "0.12"),
    "jaxlib": ("0.10.2", "0.12"),
    "flax": ("0.12.8", "0.12.12"),
}


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a pre-release or local suffix is dropped."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0]))


JAX_VERSION = version_tuple(jax.__version__)


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def outside_tested_range(versions: dict[str, str | None] | None = None) -> list[str]:
    """A line for each of JAX, jaxlib and Flax whose installed version is outside
    ``TESTED_RANGE`` (empty when all are inside). ``versions`` overrides what is installed."""
    found = versions if versions is not None else {p: _installed(p) for p in TESTED_RANGE}
    lines = []
    for package, (oldest, newest) in TESTED_RANGE.items():
        version = found.get(package)
        if version is None:
            continue
        have, low, high = version_tuple(version), version_tuple(oldest), version_tuple(newest)
        if have < low or have[: len(high)] > high:
            lines.append(
                f"{package} {version} is outside the range te_flax is tested with "
                f"({oldest} to {newest}.x)"
            )
    return lines


_said: set[str] = set()


def _degraded(feature: str, why: str) -> None:
    """Says once per process that ``feature`` takes its slower fallback."""
    if feature in _said:
        return
    _said.add(feature)
    warnings.warn(
        f"te_flax: {feature} is not available with jax {jax.__version__} ({why}); te_flax "
        "takes a slower path that gives the same results. Please report it with "
        "`python -m te_flax`.",
        RuntimeWarning,
        stacklevel=3,
    )


def _private(module: str, name: str) -> Any:
    """``jax._src.<module>.<name>``, or None where this JAX does not have it."""
    try:
        return getattr(importlib.import_module(f"jax._src.{module}"), name)
    except (ImportError, AttributeError):
        return None


_BATCH_TRACER = _private("interpreters.batching", "BatchTracer")


def is_batch_tracer(x: Any) -> bool:
    """True for a value being batched by ``vmap`` (where JAX cannot tell: any tracer)."""
    if _BATCH_TRACER is None:
        _degraded("recognising vmap's operands", "jax._src.interpreters.batching.BatchTracer")
        return isinstance(x, jax.core.Tracer)
    return isinstance(x, _BATCH_TRACER)


def traced_for_scan(x: Any) -> bool:
    """True for a value traced in the body of a ``lax.scan`` (or a transform inside one).

    JAX has no public query for where a value was traced; this reads the tracer's trace and
    its parents (their ``frame.debug_info.traced_for``). Where those attributes are missing it
    says False, and the scanned kernel is copied out of its stack for the kernel (speed only).
    """
    if not isinstance(x, jax.core.Tracer):
        return False
    trace = getattr(x, "_trace", None)
    if trace is None:
        _degraded("recognising scanned kernels", "a tracer without _trace")
        return False
    while trace is not None:
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        if getattr(info, "traced_for", None) == "scan":
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


_PARTIAL_EVAL = _private("interpreters.partial_eval", "partial_eval_jaxpr_nounits")


def partial_eval_jaxpr_nounits() -> Callable[..., Any] | None:
    """JAX's ``partial_eval_jaxpr_nounits(jaxpr, unknowns, instantiate)``, or None (said once)."""
    if _PARTIAL_EVAL is None:
        _degraded(
            "quantizing the kernels once per accumulated step",
            "jax._src.interpreters.partial_eval.partial_eval_jaxpr_nounits",
        )
    return _PARTIAL_EVAL


def pallas_triton_kept() -> bool:
    """Whether this JAX keeps the Pallas Triton backend without a deprecation (before 0.12)."""
    return JAX_VERSION < (0, 12)


def mixed_fp8_wgmma() -> bool:
    """Whether Pallas Mosaic GPU's ``wgmma`` takes an e4m3 operand with an e5m2 one (from jax
    0.11 on; jax 0.10 wants both operands of one type)."""
    return JAX_VERSION >= (0, 11)


def mosaic_gpu_interpreted() -> bool:
    """Whether this JAX has Pallas Mosaic GPU's interpret mode (from jax 0.11 on)."""
    return JAX_VERSION >= (0, 11)


_ADDERS = _private("ad_util", "raw_jaxval_adders")
_EARRAY = _private("earray", "EArray")


def add_eagerly_by_max(dtype: Any) -> None:
    """Lets JAX add cotangents of ``dtype`` (an extended dtype over float32, such as Flax's
    ``fp32_max_grad``) outside ``jit``, by elementwise max, as its rules add them under ``jit``.

    Autodiff adds the cotangents of a value's uses with ``add_any``. Inside ``jit`` an extended
    dtype's own rule lowers it; outside ``jit`` (``jax.grad`` of an eager function, or under
    ``jax.disable_jit()``) JAX looks the value's Python type up in ``ad_util.raw_jaxval_adders``,
    which has no entry for ``EArray`` (a ``KeyError`` in jax 0.10 to 0.12). The entry added here
    takes the max of the physical float32 data for ``dtype`` and defers to an entry JAX may have
    for any other extended dtype. Without those internals te_flax says so once; a layer
    applied twice then needs ``jit``.
    """
    if _ADDERS is None or _EARRAY is None or not hasattr(_EARRAY, "_data"):
        _degraded(
            "merging a reused layer's FP8 state by max outside jit",
            "jax._src.ad_util.raw_jaxval_adders or jax._src.earray.EArray",
        )
        return
    earlier = _ADDERS.get(_EARRAY)
    if getattr(earlier, "te_flax_dtype", None) == dtype:
        return

    def add(x: Any, y: Any) -> Any:
        if x.aval.dtype != dtype:
            if earlier is None:
                raise TypeError(f"JAX cannot add cotangents of dtype {x.aval.dtype} outside jit")
            return earlier(x, y)
        return _EARRAY(x.aval, jax.numpy.maximum(x._data, y._data))

    add.te_flax_dtype = dtype  # type: ignore[attr-defined]
    _ADDERS[_EARRAY] = add
