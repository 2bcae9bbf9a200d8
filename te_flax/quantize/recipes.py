"""Recipes: which low-precision formats to use and how their scales are chosen.

Per-tensor recipes (``DelayedScaling``, ``Float8CurrentScaling``) give each GEMM operand one
float32 scale; block-scaled recipes (``MXFP8BlockScaling``, ``NVFP4BlockScaling``) give every
block of consecutive elements along a GEMM's contraction its own scale.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp
from jax.typing import DTypeLike

__all__ = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
]


class Format(enum.Enum):
    """The float8 formats of a recipe, as ``(forward dtype, gradient dtype)``.

    ``HYBRID`` (the default) quantizes activations and kernels to ``float8_e4m3fn`` (more mantissa)
    and gradients to ``float8_e5m2`` (more range). ``E4M3`` uses ``float8_e4m3fn`` everywhere.
    ``E5M2`` exists for completeness but cannot be used for training: every GEMM would multiply two
    e5m2 operands, which cuBLASLt does not support, so recipes refuse it. ``E2M1``
    (``float4_e2m1fn``) is the data format of ``NVFP4BlockScaling`` only.
    """

    E4M3 = (jnp.float8_e4m3fn, jnp.float8_e4m3fn)
    E5M2 = (jnp.float8_e5m2, jnp.float8_e5m2)
    HYBRID = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    E2M1 = (jnp.float4_e2m1fn, jnp.float4_e2m1fn)

    @property
    def forward_dtype(self) -> DTypeLike:
        """The float8 dtype of activations and kernels."""
        return self.value[0]

    @property
    def backward_dtype(self) -> DTypeLike:
        """The float8 dtype of gradients."""
        return self.value[1]


def _check_format(recipe_name: str, fp8_format: object) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(
            f"{recipe_name}(fp8_format=...) must be a te_flax.quantize.Format, got {fp8_format!r}; "
            "use Format.HYBRID (e4m3 forward, e5m2 gradients) or Format.E4M3"
        )
    if fp8_format is Format.E2M1:
        raise ValueError(
            f"{recipe_name}(fp8_format=Format.E2M1) is a float4 format; use Format.HYBRID or "
            "Format.E4M3, or NVFP4BlockScaling() for float4"
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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        _check_format("Float8CurrentScaling", self.fp8_format)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
    """MXFP8: float8 data with one power-of-two scale per 32 elements (no state).

    Every GEMM operand is quantized in blocks of 32 consecutive elements along that GEMM's
    contraction, each with a ``float8_e8m0fnu`` scale: ``amax(block) / fp8_max`` rounded *up* to
    a power of two, so that no element of the block overflows. A tensor that two GEMMs contract
    along different axes (x in the forward and weight-gradient GEMMs, the kernel in the forward
    and data-gradient GEMMs, the output gradient in both backward GEMMs) is quantized once for
    each, from high precision. Every contraction must therefore be a multiple of 32 elements:
    the features, and for training also the tokens (batch x sequence). Blackwell GPUs run the
    GEMMs natively; elsewhere XLA dequantizes the blocks and runs a high-precision GEMM.

    Args:
      fp8_format: ``Format.E4M3`` (default, as in TransformerEngine: e4m3 everywhere) or
        ``Format.HYBRID`` (e5m2 gradients).
    """

    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        _check_format("MXFP8BlockScaling", self.fp8_format)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling:
    """NVFP4: float4 (e2m1) data with an e4m3 scale per 16 elements and one float32 scale.

    Each GEMM operand gets a tensor scale ``amax(x) / (6 * 448)`` and, for every 16 consecutive
    elements along the GEMM's contraction, an ``float8_e4m3fn`` block scale
    ``amax(block) / 6`` relative to it; the data is ``x / (block scale * tensor scale)`` rounded
    to ``float4_e2m1fn`` (the values 0, 0.5, 1, 1.5, 2, 3, 4 and 6). As for MXFP8, each tensor is
    quantized once per contraction layout, so contractions must be multiples of 16. All GEMMs of
    a training step, the backward ones included, use NVFP4 operands.

    Args:
      fp4_format: ``Format.E2M1`` (default, the only float4 format).
      stochastic_rounding: round the gradients (the backward GEMMs' gradient operands)
        stochastically instead of to nearest (default False), which keeps their rounding
        unbiased. It needs an RNG key: modules draw one from the ``"sr_rng"`` stream
        (Linen ``rngs={"sr_rng": key}``; NNX ``rngs=nnx.Rngs(sr_rng=...)`` at construction),
        ``QuantizerFactory.create_set`` takes ``sr_key=``. TransformerEngine's
        ``disable_stochastic_rounding=False`` is ``stochastic_rounding=True`` here.

    TransformerEngine's random Hadamard transform and 16x16 kernel blocks are not implemented.
    """

    fp4_format: Format = Format.E2M1
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if self.fp4_format is not Format.E2M1:
            raise ValueError(
                f"NVFP4BlockScaling(fp4_format=...) must be Format.E2M1, got {self.fp4_format!r}"
            )
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(
                "NVFP4BlockScaling(stochastic_rounding=...) must be a bool, got "
                f"{self.stochastic_rounding!r}"
            )


Recipe = DelayedScaling | Float8CurrentScaling | MXFP8BlockScaling | NVFP4BlockScaling
RECIPE_TYPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling)
BLOCK_RECIPE_TYPES = (MXFP8BlockScaling, NVFP4BlockScaling)


def check_recipe(recipe: object, argument: str = "fp8_recipe") -> None:
    """Raises a TypeError naming the known recipes when ``recipe`` is not one of them."""
    if not isinstance(recipe, RECIPE_TYPES):
        names = ", ".join(cls.__name__ for cls in RECIPE_TYPES)
        raise TypeError(
            f"{argument} must be a te_flax.quantize recipe ({names}) or None, got {recipe!r}"
        )
