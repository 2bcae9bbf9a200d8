"""Recipes: which low-precision formats to use and how their scales are chosen.

Per-tensor recipes (``DelayedScaling``, ``Float8CurrentScaling``) give each GEMM operand one
float32 scale; block-scaled recipes (``Float8BlockScaling``, ``MXFP8BlockScaling``,
``NVFP4BlockScaling``) give every block of consecutive elements along a GEMM's contraction its
own scale.

Every recipe has TransformerEngine 2.20's fields, in its order and with its defaults. A field
te_flax cannot honour accepts TransformerEngine's default and refuses any other value with an
error that says why. Unlike TransformerEngine, te_flax reads no ``NVTE_*`` environment
variables: a default is the value written here, whatever the environment.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
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
        _check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)

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


# DelayedScaling's largest margin: e4m3's maximum (448, about 2**8.8) divided by 2**14 is still
# above its smallest normal number (2**-6); past it the largest value of a tensor is not.
MAX_MARGIN = 14
_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")


class _RecipeKind:
    """TransformerEngine's recipe-kind predicates, as class methods of every recipe."""

    @classmethod
    def delayed(cls) -> bool:
        """Whether the recipe is delayed scaling."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """Whether the recipe is (per-tensor) current scaling."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """Whether the recipe scales per tensor (delayed or current scaling)."""
        return issubclass(cls, DelayedScaling | Float8CurrentScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        """Whether the recipe is MXFP8 block scaling."""
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        """Whether the recipe is NVFP4 block scaling."""
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """Whether the recipe is blockwise FP8 scaling (``Float8BlockScaling``)."""
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        """Whether the recipe is TransformerEngine's ``CustomRecipe`` (te_flax has none)."""
        return False


def _check_bool(recipe_name: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{recipe_name}({field}=...) must be a bool, got {value!r}")


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


def _check_attention(
    recipe_name: str, fp8_dpa: object, fp8_mha: object, dpa_supported: bool = False
) -> None:
    """``fp8_dpa``: FP8 dot-product attention, built for the per-tensor recipes
    (``dpa_supported``); ``fp8_mha`` (no casts at the attention's boundaries) is not built."""
    _check_bool(recipe_name, "fp8_dpa", fp8_dpa)
    _check_bool(recipe_name, "fp8_mha", fp8_mha)
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


def _check_backward_override(recipe_name: str, backward_override: object) -> None:
    """``backward_override``: TransformerEngine's values; only None is implemented."""
    if backward_override not in _BACKWARD_OVERRIDES:
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


_GEMM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def _check_gemm_params(recipe_name: str, recipe: object) -> None:
    """The recipe's ``fp8_gemm_*`` fields are ``MMParams``."""
    for field in _GEMM_FIELDS:
        if not isinstance(getattr(recipe, field), MMParams):
            raise TypeError(
                f"{recipe_name}({field}=...) must be a te_flax.quantize.MMParams, got "
                f"{getattr(recipe, field)!r}; e.g. MMParams(use_split_accumulator=True)"
            )


def _check_hashable(recipe_name: str, field: str, value: object) -> None:
    """Recipes are static configuration (part of jit's cache key), so they must hash."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{recipe_name}({field}=...) must be hashable, as recipes are static configuration "
            f"(part of jax.jit's cache key), got an unhashable {type(value).__name__}; pass a "
            "plain function or a functools.partial of one"
        ) from None


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_RecipeKind):
    """Per-tensor scaling from a history of past amax values (TransformerEngine's default recipe).

    The tensor of step ``t`` is quantized with ``scale_inv`` computed at the end of step ``t - 1``
    from the newest ``amax_history_len`` amax values: ``scale_inv = amax * 2**margin / fp8_max``,
    where ``amax`` is the maximum of the history (``"max"``) or its newest entry
    (``"most_recent"``). Each quantized tensor keeps this state (``scale_inv`` and
    ``amax_history``) between steps.

    Args:
      margin: powers of two of headroom left below the format's maximum (default 0), from 0
        to ``MAX_MARGIN`` (14: beyond it the largest value lands below e4m3's normal range).
      fp8_format: the formats to use (default ``Format.HYBRID``).
      amax_history_len: how many steps of amax the history keeps (default 1024, at least 1).
      amax_compute_algo: ``"max"`` (default), ``"most_recent"``, or a function
        ``amax_compute_algo(amax_history) -> amax`` of the float32 ``[amax_history_len]``
        history (newest entry first) returning a float32 scalar.
      scaling_factor_compute_algo: None (default: the formula above), or a function
        ``scaling_factor_compute_algo(amax, old_scaling_factor, fp8_max, recipe) ->
        new_scaling_factor`` with TransformerEngine's meaning: the scaling factor is the
        *quantization* scale ``1 / scale_inv``, and ``amax``, ``old_scaling_factor`` and
        ``fp8_max`` are float32 scalars. The new ``scale_inv`` is ``1 / new_scaling_factor``;
        where that is not a positive finite number the previous ``scale_inv`` is kept.
      reduce_amax: True (default): the amax is taken over the whole tensor, across every
        device it is sharded over, so all devices share one scale (te_flax's state is one value
        per tensor). False (TransformerEngine: one amax and scale per device) is refused.
      fp8_dpa: FP8 dot-product attention (default False): True quantizes the attention's
        queries, keys, values and probabilities (e4m3) and its output and score gradients
        (e5m2 under ``Format.HYBRID``) with this recipe's scaling; see docs/attention.md.
      fp8_mha: FP8 multi-head attention (default False); True is refused (not built).
      backward_override: None (default). TransformerEngine allows only None for delayed
        scaling, and so does te_flax.

    Functions given as ``amax_compute_algo`` or ``scaling_factor_compute_algo`` run inside the
    traced backward pass (jax.numpy on float32 scalars), and must be hashable (a plain function
    or a ``functools.partial``): a recipe is static configuration.
    """

    margin: float = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[[Any], Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        _check_format("DelayedScaling", self.fp8_format)
        if not isinstance(self.margin, int | float) or not math.isfinite(self.margin):
            raise ValueError(
                f"DelayedScaling(margin=...) must be a finite number, got {self.margin!r}"
            )
        if not 0 <= self.margin <= MAX_MARGIN:
            raise ValueError(
                f"DelayedScaling(margin={self.margin!r}) cannot work: the margin is how many "
                "powers of two of headroom the largest value keeps below the format's maximum "
                f"(scale_inv = amax * 2**margin / fp8_max), so it must be from 0 to {MAX_MARGIN}. "
                "Below 0 the largest values are above the maximum and saturate; above "
                f"{MAX_MARGIN} even the largest value of a tensor falls below e4m3's smallest "
                "normal number (2**-6) and the rest underflow to 0. The default, 0, is "
                "TransformerEngine's; 1 or 2 leave room for a tensor that grows between steps"
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
        if callable(self.amax_compute_algo):
            _check_hashable("DelayedScaling", "amax_compute_algo", self.amax_compute_algo)
        elif self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                'DelayedScaling(amax_compute_algo=...) must be "max" or "most_recent", or a '
                f"function of the amax history, got {self.amax_compute_algo!r}"
            )
        if self.scaling_factor_compute_algo is not None:
            if not callable(self.scaling_factor_compute_algo):
                raise TypeError(
                    "DelayedScaling(scaling_factor_compute_algo=...) must be None or a function "
                    "(amax, old_scaling_factor, fp8_max, recipe) -> new_scaling_factor, got "
                    f"{self.scaling_factor_compute_algo!r}"
                )
            _check_hashable(
                "DelayedScaling", "scaling_factor_compute_algo", self.scaling_factor_compute_algo
            )
        _check_bool("DelayedScaling", "reduce_amax", self.reduce_amax)
        if not self.reduce_amax:
            raise ValueError(
                "DelayedScaling(reduce_amax=False) keeps a separate amax and scale on every "
                "device, but te_flax's FP8 state is one value per tensor: under jax.jit the amax "
                "of a sharded tensor is its global amax, and inside shard_map the state must "
                "stay the same on every device (it is returned as one replicated variable). "
                "TransformerEngine's JAX layers require reduce_amax=True as well; leave it True"
            )
        _check_attention("DelayedScaling", self.fp8_dpa, self.fp8_mha, dpa_supported=True)
        if self.backward_override not in _BACKWARD_OVERRIDES:
            _check_backward_override("DelayedScaling", self.backward_override)
        if self.backward_override is not None:
            raise ValueError(
                f"DelayedScaling(backward_override={self.backward_override!r}): delayed scaling "
                "only supports backward_override=None (as in TransformerEngine)"
            )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_RecipeKind):
    """Per-tensor scaling from the tensor's own amax, computed at every use (no state).

    ``scale_inv = amax(x) / fp8_max``. It costs one extra reduction over each tensor before it is
    quantized, and keeps no variables.

    Args:
      use_power_2_scales: round every scale to a power of two (default False), as
        TransformerEngine's kernels do: the quantization scale ``fp8_max / amax`` is rounded
        *down* to a power of two (its float32 mantissa dropped), so ``scale_inv`` is the
        power of two at or above ``amax / fp8_max`` and no element saturates.
      fp8_format: the formats to use (default ``Format.HYBRID``).
      fp8_gemm_fprop: the forward GEMM's options (default
        ``MMParams(use_split_accumulator=False)``: fast accumulation, whose error is far below
        e4m3's rounding).
      fp8_gemm_dgrad: the data-gradient GEMM's options (default
        ``MMParams(use_split_accumulator=True)``: gradients are summed over many terms).
      fp8_gemm_wgrad: the weight-gradient GEMM's options (default
        ``MMParams(use_split_accumulator=True)``: a sum over every token).
      fp8_dpa: FP8 dot-product attention (default False): True quantizes the attention's
        queries, keys, values and probabilities (e4m3) and its output and score gradients
        (e5m2 under ``Format.HYBRID``) with this recipe's scaling; see docs/attention.md.
      fp8_mha: FP8 multi-head attention (default False); True is refused (not built).
      backward_override: None (default); ``"high_precision"`` and ``"dequantized"`` are
        refused (not implemented).

    ``fp8_quant_fwd_inp``, ``fp8_quant_fwd_weight`` and ``fp8_quant_bwd_grad`` report the
    ``QParams`` each tensor is quantized with; in TransformerEngine they are class attributes
    that follow an environment variable, here they follow ``use_power_2_scales``.
    """

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        _check_bool("Float8CurrentScaling", "use_power_2_scales", self.use_power_2_scales)
        _check_format("Float8CurrentScaling", self.fp8_format)
        _check_gemm_params("Float8CurrentScaling", self)
        _check_attention("Float8CurrentScaling", self.fp8_dpa, self.fp8_mha, dpa_supported=True)
        _check_backward_override("Float8CurrentScaling", self.backward_override)

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        """How GEMM inputs are quantized."""
        return QParams(power_2_scale=self.use_power_2_scales)

    @property
    def fp8_quant_fwd_weight(self) -> QParams:
        """How kernels are quantized."""
        return QParams(power_2_scale=self.use_power_2_scales)

    @property
    def fp8_quant_bwd_grad(self) -> QParams:
        """How gradients are quantized."""
        return QParams(power_2_scale=self.use_power_2_scales)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(_RecipeKind):
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
      margin: 0 (default). TransformerEngine has the field but uses it for no MXFP8 scale
        (its JAX and PyTorch MXFP8 quantizers ignore it); te_flax refuses any other value
        rather than ignore it.
      fp8_format: ``Format.E4M3`` (default, as in TransformerEngine: e4m3 everywhere) or
        ``Format.HYBRID`` (e5m2 gradients).
      fp8_dpa: FP8 dot-product attention (default False); True is refused: FP8 attention
        is built for DelayedScaling and Float8CurrentScaling only.
      fp8_mha: FP8 multi-head attention (default False); True is refused (not built).
      backward_override: None (default); ``"high_precision"`` and ``"dequantized"`` are
        refused (not implemented).
      enable_2d_quantization: False (default): kernels are scaled in 1x32 blocks like every
        other tensor. True (TransformerEngine: 2D blocks for kernels) is refused.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        if self.margin != 0 or isinstance(self.margin, bool):
            raise ValueError(
                f"MXFP8BlockScaling(margin={self.margin!r}): MXFP8 scales are the powers of two "
                "just above each block's amax / fp8_max and take no margin (TransformerEngine "
                "ignores the field for MXFP8); leave margin=0"
            )
        _check_format("MXFP8BlockScaling", self.fp8_format)
        _check_attention("MXFP8BlockScaling", self.fp8_dpa, self.fp8_mha)
        _check_backward_override("MXFP8BlockScaling", self.backward_override)
        _check_bool("MXFP8BlockScaling", "enable_2d_quantization", self.enable_2d_quantization)
        if self.enable_2d_quantization:
            raise ValueError(
                "MXFP8BlockScaling(enable_2d_quantization=True) asks for 2D-block kernel scales, "
                "which te_flax does not implement: it scales kernels in 1x32 blocks along each "
                "GEMM's contraction, like every other tensor; leave it False"
            )


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(_RecipeKind):
    """NVFP4: float4 (e2m1) data with an e4m3 scale per 16 elements and one float32 scale.

    Each GEMM operand gets a tensor scale ``amax(x) / (6 * 448)`` and, for every 16 consecutive
    elements along the GEMM's contraction, an ``float8_e4m3fn`` block scale
    ``amax(block) / 6`` relative to it; the data is ``x / (block scale * tensor scale)`` rounded
    to ``float4_e2m1fn`` (the values 0, 0.5, 1, 1.5, 2, 3, 4 and 6). As for MXFP8, each tensor is
    quantized once per contraction layout, so contractions must be multiples of 16. All GEMMs of
    a training step, the backward ones included, use NVFP4 operands.

    The gradients (both backward GEMMs' gradient operands) are rounded stochastically by
    default, as in TransformerEngine, which keeps their rounding unbiased. That needs an RNG
    key at every call: modules draw one from the ``"sr_rng"`` stream (Linen:
    ``apply(..., rngs={"sr_rng": key})`` with a new key each step; NNX:
    ``rngs=nnx.Rngs(0, sr_rng=1)`` at construction), ``QuantizerFactory.create_set`` takes
    ``sr_key=``. ``disable_stochastic_rounding=True`` rounds to nearest and needs no key.

    As in TransformerEngine, two more techniques are on by default. The operands of the
    weight-gradient GEMM (the GEMM input and the output gradient, in the layout that contracts
    the tokens) go through a random Hadamard transform before they are quantized: every 16
    consecutive tokens are multiplied by TransformerEngine's fixed 16x16 matrix
    ``diag(signs) @ H16 / 4`` (``block_scaling.rht_matrix()``), which spreads outliers over
    the block and cancels in the product because the matrix is orthogonal; that layout gets a
    tensor scale of its own from the transformed amax. And each kernel gets one scale per 16x16
    tile, rounded to nearest, so that the forward GEMM and dgrad use the same quantized
    weight, one the transpose of the other. ``disable_rht=True`` and
    ``disable_2d_quantization=True`` quantize without them (1x16 kernel blocks along each
    GEMM's contraction, each layout from high precision). The kernel's features must be
    multiples of 16 for its tiles. Where TransformerEngine 2.20's JAX code with
    ``disable_2d_quantization=True`` would also transform the kernel's forward layout (and then
    refuse the GEMM), te_flax transforms only the two weight-gradient operands, as the
    recipe's ``fp4_quant_fwd_weight`` says.

    Args:
      disable_rht: skip the random Hadamard transform of the weight-gradient operands (default
        False: transform them).
      disable_stochastic_rounding: round the gradients to nearest instead of stochastically
        (default False: stochastic).
      disable_2d_quantization: 1x16 kernel blocks along each GEMM's contraction instead of
        16x16 tiles (default False: tiles).
      row_scaled_activation: False (default); True (one tensor scale per row of the forward
        activations) is refused, not implemented.
      nvfp4_4over6: ``"none"`` (default); TransformerEngine's adaptive 4-over-6 block scaling
        (``"weights"``, ``"activations"``, ``"all"``) is refused, not implemented.
      nvfp4_4over6_e4m3_use_256: which 4-over-6 tensors bound their scales by 256 (default
        ``"all"``); validated, and without effect while ``nvfp4_4over6="none"``.
      nvfp4_4over6_err_mode: ``"MAE"`` (default) or ``"MSE"``; validated, and without effect
        while ``nvfp4_4over6="none"``.
      fp4_format: ``Format.E2M1`` (default, the only float4 format).
      fp8_format: ``Format.E4M3`` (default, the only format of the block scales).
      fp8_dpa: FP8 dot-product attention (default False); True is refused: FP8 attention
        is built for DelayedScaling and Float8CurrentScaling only.
      fp8_mha: FP8 multi-head attention (default False); True is refused (not built).
      backward_override: None (default); ``"high_precision"`` and ``"dequantized"`` are
        refused (not implemented).
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        name = "NVFP4BlockScaling"
        for field in (
            "disable_rht",
            "disable_stochastic_rounding",
            "disable_2d_quantization",
            "row_scaled_activation",
        ):
            _check_bool(name, field, getattr(self, field))
        if self.row_scaled_activation:
            raise ValueError(
                f"{name}(row_scaled_activation=True) asks for one tensor scale per row of the "
                "forward activations, which te_flax does not implement (one float32 scale per "
                "tensor); leave it False"
            )
        for field, allowed in (
            ("nvfp4_4over6", _NVFP4_4OVER6_SCOPES),
            ("nvfp4_4over6_e4m3_use_256", _NVFP4_4OVER6_SCOPES),
            ("nvfp4_4over6_err_mode", _NVFP4_4OVER6_ERR_MODES),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"{name}({field}=...) must be one of {', '.join(map(repr, allowed))}, got "
                    f"{getattr(self, field)!r}"
                )
        if self.nvfp4_4over6 != "none":
            raise ValueError(
                f"{name}(nvfp4_4over6={self.nvfp4_4over6!r}) asks for TransformerEngine's "
                "adaptive 4-over-6 block scaling, which te_flax does not implement; leave "
                "nvfp4_4over6='none'"
            )
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"{name}(fp4_format=...) must be Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"{name}(fp8_format=...) is the format of the block scales and must be "
                f"Format.E4M3 (as in TransformerEngine), got {self.fp8_format!r}"
            )
        _check_attention(name, self.fp8_dpa, self.fp8_mha)
        _check_backward_override(name, self.backward_override)

    @property
    def stochastic_rounding(self) -> bool:
        """Whether gradients are rounded stochastically, ``not disable_stochastic_rounding``."""
        return not self.disable_stochastic_rounding

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        """How GEMM inputs are quantized (TE's ``QParams``), with the Hadamard transform of
        their weight-gradient layout unless ``disable_rht``."""
        return QParams(random_hadamard_transform=not self.disable_rht)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        """How kernels are quantized (TE's ``QParams``), in 16x16 tiles unless
        ``disable_2d_quantization``."""
        return QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        """How gradients are quantized (TE's ``QParams``), rounded stochastically unless
        ``disable_stochastic_rounding`` and with the Hadamard transform of their weight-gradient
        layout unless ``disable_rht``."""
        return QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=self.stochastic_rounding,
        )


FP8_BLOCK_SIZE = 128  # Float8BlockScaling's block: 1x128 tiles and 128x128 blocks


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_RecipeKind):
    """Blockwise FP8 (DeepSeek-V3's recipe): a float32 scale per 1x128 tile or 128x128 block.

    GEMM inputs and output gradients get one scale per 128 consecutive elements along each
    GEMM's contraction (1x128 tiles); kernels one scale per 128x128 block. A scale is the block's
    own ``amax / fp8_max`` (no state, no amax reduction across blocks or devices), rounded up to
    a power of two by default. A tile-scaled tensor that two GEMMs contract along different
    axes (x in the forward and weight-gradient GEMMs, the output gradient in dgrad and wgrad) is
    quantized once for each, from high precision, never from its own float8 copy; a
    block-scaled kernel is quantized once, and its transpose (for dgrad) is the same float8
    blocks with the transposed scale grid. Every GEMM splits K into 128-wide chunks, multiplies
    each chunk in FP8 and sums the chunks' products in float32 with their two scales applied
    (TransformerEngine's split accumulation, which the recipe requires). Contracted sizes, and
    both sizes of a 128x128-scaled tensor, must be multiples of 128.

    Args:
      use_f32_scales: keep each scale as the exact float32 ``amax / fp8_max`` (default False:
        round it up to a power of two, so that scaling is exact). TransformerEngine takes the
        default from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``; te_flax reads no environment.
      fp8_format: ``Format.E4M3`` (default: e4m3 everywhere) or ``Format.HYBRID`` (e5m2
        gradients); ``Format.E5M2`` is refused.
      x_block_scaling_dim: 1 (default, 1x128 tiles) or 2 (128x128 blocks) for GEMM inputs.
      w_block_scaling_dim: 2 (default, 128x128 blocks) or 1 (1x128 tiles) for kernels.
      grad_block_scaling_dim: 1 (default) or 2 for output gradients. No GEMM may have two
        operands with 128x128 blocks (as in TransformerEngine).
      fp8_gemm_fprop: the forward GEMM's options; ``use_split_accumulator`` must be True
        (default ``MMParams(use_split_accumulator=True)``): the float32 sum over K's chunks.
      fp8_gemm_dgrad: the data-gradient GEMM's options, as ``fp8_gemm_fprop``.
      fp8_gemm_wgrad: the weight-gradient GEMM's options, as ``fp8_gemm_fprop``.
      fp8_dpa: FP8 dot-product attention (default False); True is refused, as in
        TransformerEngine.
      fp8_mha: FP8 multi-head attention (default False); True is refused (not built).
      backward_override: None (default); ``"high_precision"`` and ``"dequantized"`` are
        refused (not implemented).

    Example usage::

      >>> from te_flax.quantize import Float8BlockScaling
      >>> recipe = Float8BlockScaling()
      >>> recipe.float8_block_scaling(), recipe.w_block_scaling_dim
      (True, 2)
      >>> recipe.fp8_quant_fwd_inp.power_2_scale
      True
    """

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        name = "Float8BlockScaling"
        _check_bool(name, "use_f32_scales", self.use_f32_scales)
        _check_format(name, self.fp8_format)
        dims = {
            "x": self.x_block_scaling_dim,
            "w": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }
        for role, dim in dims.items():
            if dim not in (1, 2) or isinstance(dim, bool):
                raise ValueError(
                    f"{name}({role}_block_scaling_dim={dim!r}) must be 1 (1x{FP8_BLOCK_SIZE} "
                    f"tiles) or 2 ({FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE} blocks)"
                )
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 == dims[b]:
                raise ValueError(
                    f"{name}({a}_block_scaling_dim=2, {b}_block_scaling_dim=2) would multiply "
                    f"two {FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE}-block operands in one GEMM, which "
                    "TransformerEngine's blockwise GEMM does not support; give one of them 1"
                )
        _check_gemm_params(name, self)
        for field in _GEMM_FIELDS:
            if not getattr(self, field).use_split_accumulator:
                raise ValueError(
                    f"{name}({field}=MMParams(use_split_accumulator=False)): blockwise FP8 "
                    f"sums each {FP8_BLOCK_SIZE}-wide chunk of K in float32 with its scales "
                    "(split accumulation), which the recipe requires (as in TransformerEngine); "
                    "leave use_split_accumulator=True"
                )
        _check_attention(name, self.fp8_dpa, self.fp8_mha)
        _check_backward_override(name, self.backward_override)

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        """How GEMM inputs are quantized (TE's ``QParams``)."""
        return QParams(power_2_scale=not self.use_f32_scales)

    @property
    def fp8_quant_fwd_weight(self) -> QParams:
        """How kernels are quantized (TE's ``QParams``)."""
        return QParams(power_2_scale=not self.use_f32_scales)

    @property
    def fp8_quant_bwd_grad(self) -> QParams:
        """How gradients are quantized (TE's ``QParams``)."""
        return QParams(power_2_scale=not self.use_f32_scales)


Recipe = (
    DelayedScaling
    | Float8CurrentScaling
    | Float8BlockScaling
    | MXFP8BlockScaling
    | NVFP4BlockScaling
)
RECIPE_TYPES = (
    DelayedScaling,
    Float8CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
BLOCK_RECIPE_TYPES = (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def check_recipe(recipe: object, argument: str = "fp8_recipe") -> None:
    """Raises a TypeError naming the known recipes when ``recipe`` is not one of them."""
    if not isinstance(recipe, RECIPE_TYPES):
        names = ", ".join(cls.__name__ for cls in RECIPE_TYPES)
        raise TypeError(
            f"{argument} must be a te_flax.quantize recipe ({names}) or None, got {recipe!r}"
        )
