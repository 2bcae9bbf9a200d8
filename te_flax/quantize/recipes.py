"""FP8 recipes: which float8 formats to use and how their scales are chosen."""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp

__all__ = ["DelayedScaling", "Float8CurrentScaling", "Format", "Recipe"]


class Format(enum.Enum):
    """The float8 formats of a recipe, as ``(forward dtype, gradient dtype)``.

    ``HYBRID`` (the default) quantizes activations and kernels to ``float8_e4m3fn`` (more mantissa)
    and gradients to ``float8_e5m2`` (more range). ``E4M3`` uses ``float8_e4m3fn`` everywhere.
    ``E5M2`` exists for completeness but cannot be used for training: every GEMM would multiply two
    e5m2 operands, which cuBLASLt does not support, so recipes refuse it.
    """

    E4M3 = (jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    E5M2 = (jnp.float8_e5m2, jnp.float8_e5m2)
    HYBRID = (jnp.float8_e4m3fn, jnp.float8_e5m2)

    @property
    def forward_dtype(self):
        """The float8 dtype of activations and kernels."""
        return self.value[0]

    @property
    def backward_dtype(self):
        """The float8 dtype of gradients."""
        return self.value[1]


def _check_format(recipe_name: str, fp8_format: object) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(
            f"{recipe_name}(fp8_format=...) must be a te_flax.quantize.Format, got {fp8_format!r}; "
            "use Format.HYBRID (e4m3 forward, e5m2 gradients) or Format.E4M3"
        )
    if fp8_format is Format.E5M2:
        raise ValueError(
            f"{recipe_name}(fp8_format=Format.E5M2) would make every GEMM multiply two e5m2 "
            "operands, which cuBLASLt cannot do; use Format.HYBRID (e5m2 only for gradients) "
            "or Format.E4M3"
        )


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scaling from a history of past amax values (TransformerEngine's default recipe).

    The tensor of step ``t`` is quantized with ``scale_inv`` computed at the end of step ``t - 1``
    from the newest ``amax_history_len`` amax values: ``scale_inv = amax * 2**margin / fp8_max``,
    where ``amax`` is the maximum of the history (``"max"``) or its newest entry
    (``"most_recent"``). Each quantized tensor keeps this state (``scale_inv`` and
    ``amax_history``) between steps.

    Args:
      margin: powers of two of headroom left below the format's maximum (default 0).
      fp8_format: the formats to use (default ``Format.HYBRID``).
      amax_history_len: how many steps of amax the history keeps (default 1024, at least 1).
      amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
    """

    margin: float = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        _check_format("DelayedScaling", self.fp8_format)
        if not isinstance(self.margin, int | float) or not math.isfinite(self.margin):
            raise ValueError(
                f"DelayedScaling(margin=...) must be a finite number, got {self.margin!r}"
            )
        if (
            not isinstance(self.amax_history_len, int)
            or isinstance(self.amax_history_len, bool)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                "DelayedScaling(amax_history_len=...) must be an int >= 1, got "
                f"{self.amax_history_len!r}; 1 keeps only the newest amax"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                'DelayedScaling(amax_compute_algo=...) must be "max" or "most_recent", got '
                f"{self.amax_compute_algo!r}"
            )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor scaling from the tensor's own amax, computed at every use (no state).

    ``scale_inv = amax(x) / fp8_max``. It costs one extra reduction over each tensor before it is
    quantized, and keeps no variables.

    Args:
      fp8_format: the formats to use (default ``Format.HYBRID``).
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        _check_format("Float8CurrentScaling", self.fp8_format)


Recipe = DelayedScaling | Float8CurrentScaling
RECIPE_TYPES = (DelayedScaling, Float8CurrentScaling)


def check_recipe(recipe: object, argument: str = "fp8_recipe") -> None:
    """Raises a TypeError naming the known recipes when ``recipe`` is not one of them."""
    if not isinstance(recipe, RECIPE_TYPES):
        names = ", ".join(cls.__name__ for cls in RECIPE_TYPES)
        raise TypeError(
            f"{argument} must be a te_flax.quantize recipe ({names}) or None, got {recipe!r}"
        )
