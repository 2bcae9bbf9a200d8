"""The scale math of per-tensor FP8 quantization, as small pure functions.

Scales are stored as *dequantization* scales, ``scale_inv``: ``x ~= q * scale_inv`` with
``q = clip(x / scale_inv, -fp8_max, fp8_max)`` cast to float8.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import ArrayLike, DTypeLike

from te_flax._base.settings import ScopedSetting

__all__ = [
    "amax",
    "amax_axes",
    "amax_or_nan",
    "compute_scale_inv",
    "dequantize",
    "distinct_axes",
    "distinct_over",
    "flag_nonfinite",
    "fp8_max",
    "max_over_devices",
    "push_amax",
    "quantize",
    "reduce_history",
    "scale_inv_from_scaling_factor",
    "where",
]

_F32 = jnp.finfo(jnp.float32)


# The scale math below is written with lax primitives, not jnp functions: it runs once per
# quantizer (or state variable) per step, and each jnp function is a traced call of a jitted
# helper (a 12-layer model's unrolled delayed step traces 144 quantizers), where a primitive is
# one equation. The arithmetic is the same, except that a scale is now computed in float32 from a
# bfloat16 amax too (the block-scaled recipes' block amax), as TransformerEngine computes it.


def _full(value: ArrayLike, dtype: DTypeLike, shape: tuple[int, ...]) -> Array:
    """``value`` (a Python scalar or an array broadcastable to ``shape``) as ``dtype[shape]``."""
    array = lax.convert_element_type(value, dtype)
    if array.shape == shape:
        return array
    leading = len(shape) - array.ndim
    return lax.broadcast_in_dim(array, shape, tuple(range(leading, len(shape))))


def where(condition: Array, x: ArrayLike, y: ArrayLike) -> Array:
    """``jnp.where`` as one ``select`` in the program, not a call of a jitted helper: the FP8
    state math runs once per quantizer (or state variable) per step, and each call is one more
    function to trace, lower and compile (the 12-layer example's unrolled delayed step had
    576)."""
    dtype = jnp.result_type(x, y)
    shape = jnp.broadcast_shapes(jnp.shape(condition), jnp.shape(x), jnp.shape(y))
    return lax.select(_full(condition, bool, shape), _full(x, dtype, shape), _full(y, dtype, shape))


def _clip_normal(x: Array) -> Array:
    """``jnp.clip(x, tiny, max)`` of float32 (NaN stays NaN)."""
    return lax.min(
        _full(_F32.max, x.dtype, x.shape), lax.max(_full(_F32.tiny, x.dtype, x.shape), x)
    )


def _finite_positive(x: Array) -> Array:
    """``isfinite(x) & (x > 0)`` of a float array."""
    return lax.bitwise_and(lax.is_finite(x), lax.gt(x, _full(0, x.dtype, x.shape)))


def fp8_max(dtype: DTypeLike) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


# Manual mesh axes over which the tensors being quantized are different tensors, not blocks of
# one: under expert parallelism each device holds other experts, whose amaxes must not mix.
_DISTINCT_AXES: ScopedSetting[frozenset[str]] = ScopedSetting("distinct_over", frozenset())


@contextlib.contextmanager
def distinct_over(axes: Iterable[str]) -> Iterator[None]:
    """Inside ``shard_map``: amaxes are not combined over ``axes`` while this is active."""
    with _DISTINCT_AXES.scope(frozenset(axes)):
        yield


def distinct_axes() -> frozenset[str]:
    """The axes of the active ``distinct_over`` (ops that quantize again in their backward keep
    this value from the forward)."""
    return _DISTINCT_AXES.value


def amax_axes(distinct: frozenset[str] | None = None) -> tuple[str, ...]:
    """The manual mesh axes an amax is combined over (``pmax``): all but the distinct ones."""
    distinct = distinct_axes() if distinct is None else distinct
    return tuple(sorted(set(jax.sharding.get_abstract_mesh().manual_axes) - distinct))


def max_over_devices(value: Array, distinct: frozenset[str] | None = None) -> Array:
    """``value`` (a per-device amax) combined with ``pmax`` over the manual mesh axes of
    ``amax_axes``.

    Where JAX tracks the value's varying axes (``shard_map``'s ``check_vma``) the ``pmax`` runs
    over those only: over an axis it does not vary over (a replicated kernel's amax) every device
    holds the same value, which is its own max, and newer JAX refuses a ``pmax`` that mixes such
    axes with varying ones. Where it tracks none (``check_vma=False``, or a value invariant over
    every axis) it runs over all of them, which is the global max either way."""
    manual = amax_axes(distinct)
    state = getattr(jax.typeof(value), "mat", None)
    varying = frozenset(getattr(state, "varying", ()))
    if varying:
        manual = tuple(axis for axis in manual if axis in varying)
    return lax.pmax(value, manual) if manual else value


def amax(x: Array) -> Array:
    """``max(|x|)`` over the whole (global) tensor, as a float32 scalar.

    Under ``jit`` with sharded arrays the reduction is already global. Inside ``shard_map`` each
    device holds a block, so the block maxima are combined with ``pmax`` over the manual mesh
    axes: every device then quantizes with the same scale, the one a single device would use.
    """
    # Reduce in float32: a bfloat16 maximum is exact, but the scale math that follows is not.
    # An empty tensor (a batch of 0 tokens) has amax 0, as TransformerEngine's amax kernel
    # gives it: delayed scaling keeps its scale, and nothing is quantized with it.
    initial = 0 if x.size == 0 else None
    value = lax.convert_element_type(jnp.max(lax.abs(x), initial=initial), jnp.float32)
    return max_over_devices(value)


def amax_or_nan(x: Array) -> Array:
    """``amax(x)``, and NaN when ``x`` holds a NaN or an infinity. XLA:CPU's max reduction can
    skip a NaN; a sum cannot (``0 * x`` is NaN exactly where ``x`` is not finite). For formats
    that cannot hold a NaN themselves (NVFP4's e2m1), where the amax is all that can carry it."""
    probe = lax.convert_element_type(jnp.sum(lax.mul(x, _full(0, x.dtype, x.shape))), jnp.float32)
    return lax.add(amax(x), probe)


def compute_scale_inv(
    amax_value: Array,
    dtype: DTypeLike,
    margin: float,
    previous_scale_inv: Array,
    power_2_scale: bool = False,
) -> Array:
    """``amax * 2**margin / fp8_max``, keeping ``previous_scale_inv`` where amax is 0, NaN or inf.

    With ``power_2_scale`` the scale is a power of two, rounded as TransformerEngine's kernels
    round it: the quantization scale ``fp8_max / amax`` (float32 division; float32's maximum
    where it overflows) loses its mantissa, i.e. is rounded *down* to a power of two, and
    ``scale_inv`` is its exact reciprocal (``margin`` must then be 0, as in current scaling).

    The result is clipped to the normal float32 range, so it is never 0, inf or NaN as long as
    ``previous_scale_inv`` is not.
    """
    if power_2_scale:
        assert margin == 0, "power-of-two scales take no margin"
        scale = jnp.float32(fp8_max(dtype)) / amax_value.astype(jnp.float32)
        scale = where(jnp.isinf(scale), _F32.max, scale)
        # Dropping the mantissa bits rounds a positive float32 down to a power of two.
        bits = lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
        scale_inv = 1.0 / lax.bitcast_convert_type(bits, jnp.float32)
    else:
        amax_value = lax.convert_element_type(amax_value, jnp.float32)
        factor = _full(2.0**margin / fp8_max(dtype), jnp.float32, amax_value.shape)
        scale_inv = lax.mul(amax_value, factor)
    scale_inv = where(_finite_positive(amax_value), scale_inv, previous_scale_inv)
    # A denormal amax would underflow to 0 and a huge one overflow to inf; both break the next
    # quantization, so keep the scale inside float32's normal range.
    return _clip_normal(lax.convert_element_type(scale_inv, jnp.float32))


def scale_inv_from_scaling_factor(
    scaling_factor_compute_algo: Callable[..., Any],
    amax_value: Array,
    dtype: DTypeLike,
    previous_scale_inv: Array,
    recipe: object,
) -> Array:
    """``1 / scaling_factor_compute_algo(amax, 1 / previous_scale_inv, fp8_max, recipe)``.

    TransformerEngine's custom scaling-factor function works on the *quantization* scale, the
    reciprocal of te_flax's ``scale_inv``; its arguments are float32 scalars. Where the new
    scale is not a positive finite number the previous ``scale_inv`` is kept, and the result
    is clipped to float32's normal range, as ``compute_scale_inv`` does.
    """
    previous = previous_scale_inv.astype(jnp.float32).reshape(())
    new_scale = scaling_factor_compute_algo(
        amax_value.astype(jnp.float32).reshape(()),
        1.0 / previous,
        jnp.float32(fp8_max(dtype)),
        recipe,
    )
    new_scale = jnp.asarray(new_scale, jnp.float32).reshape(())
    valid = jnp.isfinite(new_scale) & (new_scale > 0)
    scale_inv = jnp.where(valid, 1.0 / jnp.where(valid, new_scale, 1.0), previous)
    return jnp.clip(scale_inv, _F32.tiny, _F32.max).astype(jnp.float32)


def push_amax(history: Array, amax_value: Array) -> Array:
    """The history with ``amax_value`` as its newest entry (index 0); the oldest entry drops out.

    A NaN or infinite amax is recorded as 0 ("no information"), so one bad step cannot pin the
    scale for the next ``len(history)`` steps; the scale of that step stays as it was.
    """
    recorded = where(lax.is_finite(amax_value), amax_value, 0.0)
    recorded = lax.convert_element_type(recorded, history.dtype).reshape(1)
    return lax.concatenate([recorded, lax.slice_in_dim(history, 0, history.shape[0] - 1)], 0)


def reduce_history(history: Array, amax_compute_algo: str | Callable[[Array], Array]) -> Array:
    """The amax a scale is computed from: the history's maximum, its newest entry, or
    ``amax_compute_algo(history)`` (a float32 scalar) for a function."""
    if callable(amax_compute_algo):
        return jnp.asarray(amax_compute_algo(history), jnp.float32).reshape(())
    if amax_compute_algo == "max":
        return lax.reduce_max(history, tuple(range(history.ndim)))
    return lax.index_in_dim(history, 0, keepdims=False)


def flag_nonfinite(scale_inv: Array, amax_value: Array) -> Array:
    """``scale_inv`` where the tensor's amax is finite, NaN where it is not: for a format that
    cannot hold a NaN itself (NVFP4's e2m1), whose GEMMs then give NaN through the scale as
    ``quantize`` makes them give NaN through the data for float8. The stored state is not
    touched (``compute_scale_inv`` keeps the previous scale for such an amax)."""
    return where(lax.is_finite(amax_value), scale_inv, jnp.float32(jnp.nan))


def quantize(x: Array, dtype: DTypeLike, scale_inv: Array) -> Array:
    """``clip(x / scale_inv, -fp8_max, fp8_max)`` cast to ``dtype``, a NaN or an infinity of
    ``x`` as NaN.

    The division runs in float32 whatever ``x``'s dtype is, so the scale is not rounded to
    bfloat16 first. The clip saturates a finite value instead of producing NaN (e4m3fn has no
    infinity), and ``convert(clamp(divide(x, scale)))`` is the form XLA's fusions and
    collective quantizer recognise, so an FSDP all-gather of a quantized kernel moves float8.
    An infinity would saturate too, and the step that saw it would give finite products that
    look normal to ``skip_nonfinite``, ``optax.apply_if_finite`` and any finiteness check; it
    becomes NaN, which float8 keeps, so every GEMM that reads it gives NaN. Both stay inside
    that form: the dividend is ``x - (x - x)``, which is ``x`` for a finite value (a negative
    zero too) and NaN for an infinity, and a NaN passes the clamp because XLA's ``min`` and
    ``max`` propagate NaN. A ``select`` on ``is_finite(x)`` around the clamp gives the same
    values but broke the form: XLA then wrote a float32 copy of each large operand and its
    finiteness mask to memory and read them back for the transposed layout, and the XLA
    stages' FP8 step of two hidden-8192 layers moved 1.64x the BF16 step's bytes instead of
    1.23x (``bench/RESULTS_xla_stages.md``). Elementwise, so a GEMM never waits for a
    reduction (an amax's all-reduce under data parallelism) it did not need.
    """
    limit = fp8_max(dtype)
    x32 = lax.convert_element_type(x, jnp.float32)
    # x - x: NaN exactly where x is not finite, 0 elsewhere, sharded as x is (on Explicit
    # mesh axes too); subtracted rather than added so that -0.0 stays -0.0.
    kept = lax.sub(x32, lax.sub(x32, x32))
    scaled = lax.div(kept, _full(scale_inv, jnp.float32, x32.shape))
    clipped = lax.min(
        _full(limit, jnp.float32, x.shape), lax.max(_full(-limit, jnp.float32, x.shape), scaled)
    )
    return lax.convert_element_type(clipped, dtype)


def dequantize(q: Array, scale_inv: Array, dtype: DTypeLike = jnp.float32) -> Array:
    """``q * scale_inv`` in ``dtype``."""
    return (q.astype(jnp.float32) * scale_inv.astype(jnp.float32)).astype(dtype)
