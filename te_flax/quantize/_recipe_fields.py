"""What every recipe is built from: the formats, TransformerEngine's ``MMParams`` and ``QParams``,
the recipe-kind predicates, and the checks of the fields recipes share."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

__all__ = [
    "BACKWARD_OVERRIDES",
    "GEMM_FIELDS",
    "Format",
    "MMParams",
    "QParams",
    "RecipeKind",
    "check_attention",
    "check_backward_override",
    "check_bool",
    "check_format",
    "check_gemm_params",
    "check_hashable",
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


@dataclasses.dataclass(frozen=True)
class MMParams:
    """Options of one FP8 GEMM (TransformerEngine's ``MMParams``).

    Args:
      use_split_accumulator: accumulate in full float32 precision (default True); False lets
        Hopper and Ada GPUs use FP8 fast accumulation (cuBLASLt's
        ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``). te_flax gives the GEMM ``lax.Precision.HIGHEST``
        for True and ``lax.Precision.DEFAULT`` for False, the precisions XLA's GEMM rewriter maps
        to those two cuBLASLt settings.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)

    @property
    def precision(self) -> jax.lax.Precision:
        """The ``lax.dot_general`` precision of a GEMM with these options."""
        return lax.Precision.HIGHEST if self.use_split_accumulator else lax.Precision.DEFAULT


@dataclasses.dataclass(frozen=True)
class QParams:
    """How one tensor role is quantized (TransformerEngine's ``QParams``), as recipes report it.

    Read-only: recipes derive these from their own fields (``fp8_quant_fwd_inp`` and the like
    are properties, not constructor arguments).
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class _KindPredicate:
    """A recipe-kind predicate such as ``recipe.delayed()``: called on a recipe class or on an
    instance, it says whether the class (or a base) names the attribute's name among its kinds."""

    def __init__(self, summary: str) -> None:
        self.__doc__ = summary
        self.kind = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.kind = name

    def __get__(self, instance: object, owner: type[RecipeKind]) -> Callable[[], bool]:
        kind, kinds = self.kind, owner.kinds

        def predicate() -> bool:
            return kind in kinds

        predicate.__doc__ = self.__doc__
        return predicate


class RecipeKind:
    """TransformerEngine's recipe-kind predicates, as class methods of every recipe.

    A recipe names its kinds where it is defined, ``class DelayedScaling(RecipeKind,
    kinds=("delayed", "float8_per_tensor_scaling"))``; a subclass keeps its bases' kinds.
    """

    kinds: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, kinds: tuple[str, ...] = (), **options: Any) -> None:
        super().__init_subclass__(**options)
        cls.kinds = cls.kinds | frozenset(kinds)

    delayed = _KindPredicate("Whether the recipe is delayed scaling.")
    float8_current_scaling = _KindPredicate("Whether the recipe is (per-tensor) current scaling.")
    float8_per_tensor_scaling = _KindPredicate(
        "Whether the recipe scales per tensor (delayed or current scaling)."
    )
    mxfp8 = _KindPredicate("Whether the recipe is MXFP8 block scaling.")
    nvfp4 = _KindPredicate("Whether the recipe is NVFP4 block scaling.")
    float8_block_scaling = _KindPredicate(
        "Whether the recipe is blockwise FP8 scaling (``Float8BlockScaling``)."
    )
    custom = _KindPredicate(
        "Whether the recipe is TransformerEngine's ``CustomRecipe`` (te_flax has none)."
    )


def check_bool(recipe_name: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{recipe_name}({field}=...) must be a bool, got {value!r}")


def check_format(recipe_name: str, fp8_format: object) -> None:
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


def check_attention(
    recipe_name: str, fp8_dpa: object, fp8_mha: object, dpa_supported: bool = False
) -> None:
    """``fp8_dpa``: FP8 dot-product attention, built for the per-tensor recipes
    (``dpa_supported``); ``fp8_mha`` (no casts at the attention's boundaries) is not built."""
    check_bool(recipe_name, "fp8_dpa", fp8_dpa)
    check_bool(recipe_name, "fp8_mha", fp8_mha)
    if fp8_dpa and not dpa_supported:
        raise ValueError(
            f"{recipe_name}(fp8_dpa=True) asks for FP8 attention, which te_flax builds with "
            "per-tensor scaling only (DelayedScaling or Float8CurrentScaling with "
            "fp8_dpa=True); under this recipe the attention runs in high precision (its "
            "inputs' dtype) while the recipe still quantizes the projections' GEMMs; leave "
            "fp8_dpa=False, or use DelayedScaling(fp8_dpa=True)"
        )
    if fp8_mha:
        raise ValueError(
            f"{recipe_name}(fp8_mha=True) asks for FP8 multi-head attention (float8 tensors "
            "passed between the projections and the attention without casts), which te_flax "
            "does not have: the projections return and the attention takes high-precision "
            "tensors. Leave fp8_mha=False; fp8_dpa=True (DelayedScaling or "
            "Float8CurrentScaling) quantizes the attention's own GEMMs"
        )


def check_backward_override(recipe_name: str, backward_override: object) -> None:
    """``backward_override``: TransformerEngine's values; only None is implemented."""
    if backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"{recipe_name}(backward_override=...) must be None, 'high_precision' or "
            f"'dequantized', got {backward_override!r}"
        )
    if backward_override is not None:
        raise ValueError(
            f"{recipe_name}(backward_override={backward_override!r}) is not implemented in "
            "te_flax: its backward GEMMs always multiply the operands the forward quantized with "
            "the quantized output gradient (TransformerEngine's backward_override=None). "
            "TransformerEngine's JAX layers ignore this field; for a high-precision backward "
            "leave the layer unquantized (recipe=None)"
        )


GEMM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def check_gemm_params(recipe_name: str, recipe: object) -> None:
    """The recipe's ``fp8_gemm_*`` fields are ``MMParams``."""
    for field in GEMM_FIELDS:
        if not isinstance(getattr(recipe, field), MMParams):
            raise TypeError(
                f"{recipe_name}({field}=...) must be a te_flax.quantize.MMParams, got "
                f"{getattr(recipe, field)!r}; e.g. MMParams(use_split_accumulator=True)"
            )


def check_hashable(recipe_name: str, field: str, value: object) -> None:
    """Recipes are static configuration (part of jit's cache key), so they must hash."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{recipe_name}({field}=...) must be hashable, as recipes are static configuration "
            f"(part of jax.jit's cache key), got an unhashable {type(value).__name__}; pass a "
            "plain function or a functools.partial of one"
        ) from None
