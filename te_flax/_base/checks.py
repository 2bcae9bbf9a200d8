"""Input checks shared by every layer of te_flax: each error names the argument, what was
received, and how to fix it.

The checks of values (ints, dtypes, axes, rates, shapes) live here, below everything else, so
that any module can use them. Checks that need a type of a higher layer live beside it and are
built on these: ``te_flax._ops.arguments`` (a norm's arguments, a quantizer set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = [
    "canonical_norm_type",
    "check_axes",
    "check_bool",
    "check_broadcastable",
    "check_dtype",
    "check_floating",
    "check_input",
    "check_positive_int",
    "check_rate",
    "check_shape",
    "check_sizes",
]

_NORM_TYPES = ("layernorm", "rmsnorm")


def check_floating(array: object, name: str) -> None:
    """``array`` must be a floating-point array of a compute dtype (not float8)."""
    dtype = getattr(array, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        variable = name if name.isidentifier() else "x"  # "DenseGeneral's input": x
        raise TypeError(
            f"{name} must be a floating-point array, got "
            f"{dtype if dtype is not None else type(array).__name__}; cast it, e.g. "
            f"{variable}.astype(jnp.bfloat16)"
        )
    if jnp.finfo(dtype).bits < 16:
        raise TypeError(
            f"{name} has dtype {dtype}; pass high-precision values (float32, bfloat16 or "
            "float16) and let a quantizer_set do the float8 conversion"
        )


def check_input(x: object, name: str, feature_axes: int = 1) -> None:
    """``x`` must be a floating-point array with its features on its last ``feature_axes`` axes.

    The one check of the input that every layer and op shares: a layer normalizes or contracts
    the trailing axes of ``[batch..., features]``, so a scalar (or an array with fewer axes than
    the layer contracts) has no features to read. A batch of size 0 is an input like any other.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax._base.checks import check_input
      >>> check_input(jnp.ones((2, 8)), "x")
      >>> check_input(jnp.float32(1.0), "x")
      Traceback (most recent call last):
      ...
      ValueError: x has shape () but needs at least one axis: its last axis holds the \
features, [batch..., features]; add the missing axes, e.g. x.reshape(1, -1) for one example
    """
    check_floating(x, name)
    shape = tuple(cast(Array, x).shape)
    if len(shape) < feature_axes:
        if feature_axes == 1:
            rule, fix = "one axis: its last axis holds", "x.reshape(1, -1)"
        else:
            rule, fix = f"{feature_axes} axes: its last {feature_axes} hold", "x[None]"
        raise ValueError(
            f"{name} has shape {shape} but needs at least {rule} the features, "
            f"[batch..., features]; add the missing axes, e.g. {fix} for one example"
        )


def check_shape(array: Array, expected: tuple[int, ...], name: str, hint: str) -> None:
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(array.shape)} but must be {expected}; {hint}")


def canonical_norm_type(norm_type: object, name: str = "norm_type") -> str:
    """``"layernorm"`` or ``"rmsnorm"``; TE's spellings (``"LayerNorm"``, ``"rms_norm"``) too."""
    if isinstance(norm_type, str):
        canonical = norm_type.lower().replace("_", "").replace("-", "")
        if canonical in _NORM_TYPES:
            return canonical
    raise ValueError(f'{name} must be "layernorm" or "rmsnorm", got {norm_type!r}')


def check_positive_int(value: object, name: str, fix: str = "pass an int >= 1") -> int:
    """``value`` as an int >= 1 (a numpy integer too; a bool is refused).

    Args:
      value: what the caller passed.
      name: the argument, as the error names it (``"num_microbatches"``, ``"DenseGeneral:
        n_groups"``).
      fix: how to fix a wrong value, appended to the error.

    Example usage::

      >>> from te_flax._base.checks import check_positive_int
      >>> check_positive_int(4, "num_microbatches")
      4
      >>> check_positive_int(0, "num_microbatches")
      Traceback (most recent call last):
      ...
      ValueError: num_microbatches must be a positive int, got 0; pass an int >= 1
    """
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; {fix}")
    return int(value)


def check_axes(
    axes: Sequence[str | None] | None, ndim: int, name: str, of: str
) -> tuple[str | None, ...] | None:
    """Logical axes as a tuple (or None), one name per dimension of the array they describe."""
    if axes is None:
        return None
    if isinstance(axes, str) or not isinstance(axes, Sequence):
        raise TypeError(
            f"{name} must be a tuple of logical axis names (or None), got {axes!r}; "
            f"e.g. {name}=('batch', 'embed')"
        )
    axes = tuple(axes)
    if not all(a is None or isinstance(a, str) for a in axes):
        raise TypeError(f"{name} must hold axis names (str) or None, got {axes!r}")
    if axes and len(axes) != ndim:
        raise ValueError(
            f"{name}={axes} names {len(axes)} dimensions but {of} has {ndim}; give one "
            "logical name (or None) per dimension"
        )
    return axes


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_dtype(dtype: object, name: str) -> Any:
    """``dtype`` as a floating-point numpy dtype of 16 bits or more (None passes through).

    For the modules' ``dtype`` (compute) and ``param_dtype`` (storage) attributes.
    """
    if dtype is None:
        return None
    try:
        resolved = jnp.dtype(cast(Any, dtype))
    except (TypeError, ValueError):
        raise TypeError(
            f"{name}={dtype!r} is not a dtype; use a floating-point dtype such as jnp.bfloat16 "
            "or jnp.float32"
        ) from None
    if not jnp.issubdtype(resolved, jnp.floating) or jnp.finfo(resolved).bits < 16:
        raise TypeError(
            f"{name}={dtype!r} is not a high-precision floating-point dtype; use jnp.float32, "
            "jnp.bfloat16 or jnp.float16 (the recipe does the float8 conversion)"
        )
    return resolved


def check_sizes(sizes: object, name: str) -> tuple[int, ...]:
    """``sizes`` (an int or a sequence of ints) as a tuple of positive ints."""
    values = (sizes,) if isinstance(sizes, int | np.integer) else sizes
    if isinstance(values, str) or not isinstance(values, Sequence):
        values = None
    if (
        not values
        or not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values)
        or min(values) < 1
    ):
        raise ValueError(
            f"{name} must be a positive int or a tuple of them, got {sizes!r}; e.g. "
            f"{name}=x.shape[-1]"
        )
    return tuple(int(v) for v in values)


def check_rate(rate: object, name: str) -> float:
    """A dropout probability: a number in [0, 1)."""
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 <= rate < 1:
        raise ValueError(
            f"{name} must be a probability in [0, 1), got {rate!r}; use 0.0 for no dropout"
        )
    return float(rate)


def check_broadcastable(array: Array, target: tuple[int, ...], name: str, layout: str) -> None:
    """``array`` must broadcast to ``target`` (each of its trailing dims 1 or the target's)."""
    shape = tuple(array.shape)
    fits = len(shape) <= len(target) and all(
        size in (1, want) for size, want in zip(shape[::-1], target[::-1], strict=False)
    )
    if not fits:
        raise ValueError(
            f"{name} has shape {shape}, which does not broadcast to {layout} = {target}; give "
            f"it that shape, with 1 for any axis it shares"
        )
