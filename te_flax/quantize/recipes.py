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
import math
from collections.abc import Callable
from typing import Any

from te_flax.quantize import _recipe_fields as fields
from te_flax.quantize._block_recipes import (
    FP8_BLOCK_SIZE,  # noqa: F401 (importable from this module, as before the split)
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from te_flax.quantize._recipe_fields import Format, MMParams, QParams, RecipeKind

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


# DelayedScaling's largest margin: e4m3's maximum (448, about 2**8.8) divided by 2**14 is still
# above its smallest normal number (2**-6); past it the largest value of a tensor is not.
MAX_MARGIN = 14

# DelayedScaling's longest amax history: 64 times TransformerEngine's default (1024). A history
# is one float32 per step for every quantized tensor (three per GEMM, in every layer), rewritten
# at every step and saved in every checkpoint: at this bound one tensor's history is 256 KiB and
# a 32-layer transformer's 384 histories (four GEMMs a layer) 96 MiB, where the default keeps
# 1.5 MiB. A longer window only ties each scale to amaxes more than 65536 steps old.
MAX_AMAX_HISTORY_LEN = 2**16


@dataclasses.dataclass(frozen=True)
class DelayedScaling(RecipeKind, kinds=("delayed", "float8_per_tensor_scaling")):
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
      amax_history_len: how many steps of amax the history keeps (default 1024), from 1 to
        ``MAX_AMAX_HISTORY_LEN`` (65536: a history is one float32 per step for every quantized
        tensor, rewritten at every step and saved in every checkpoint).
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

    Example usage::

      >>> from te_flax.quantize import DelayedScaling, Format
      >>> recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
      >>> recipe.delayed(), recipe.float8_per_tensor_scaling(), recipe.mxfp8()
      (True, True, False)
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
        fields.check_format("DelayedScaling", self.fp8_format)
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
        if self.amax_history_len > MAX_AMAX_HISTORY_LEN:
            size = self.amax_history_len * 4 / 2**20
            raise ValueError(
                f"DelayedScaling(amax_history_len={self.amax_history_len}) is longer than "
                f"te_flax allows ({MAX_AMAX_HISTORY_LEN}): the history keeps one float32 per "
                "step for every quantized tensor (three per GEMM, in every layer), rewritten at "
                f"every step and saved in every checkpoint, {size:.1f} MiB per tensor here. "
                f"Use at most {MAX_AMAX_HISTORY_LEN} (TransformerEngine's default is 1024)"
            )
        if callable(self.amax_compute_algo):
            fields.check_hashable("DelayedScaling", "amax_compute_algo", self.amax_compute_algo)
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
            fields.check_hashable(
                "DelayedScaling", "scaling_factor_compute_algo", self.scaling_factor_compute_algo
            )
        fields.check_bool("DelayedScaling", "reduce_amax", self.reduce_amax)
        if not self.reduce_amax:
            raise ValueError(
                "DelayedScaling(reduce_amax=False) keeps a separate amax and scale on every "
                "device, but te_flax's FP8 state is one value per tensor: under jax.jit the amax "
                "of a sharded tensor is its global amax, and inside shard_map the state must "
                "stay the same on every device (it is returned as one replicated variable). "
                "TransformerEngine's JAX layers require reduce_amax=True as well; leave it True"
            )
        fields.check_attention("DelayedScaling", self.fp8_dpa, self.fp8_mha, dpa_supported=True)
        if self.backward_override not in fields.BACKWARD_OVERRIDES:
            fields.check_backward_override("DelayedScaling", self.backward_override)
        if self.backward_override is not None:
            raise ValueError(
                f"DelayedScaling(backward_override={self.backward_override!r}): delayed scaling "
                "only supports backward_override=None (as in TransformerEngine)"
            )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(
    RecipeKind, kinds=("float8_current_scaling", "float8_per_tensor_scaling")
):
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
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)  # noqa: RUF009 (frozen)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)  # noqa: RUF009 (frozen)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)  # noqa: RUF009 (frozen)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        fields.check_bool("Float8CurrentScaling", "use_power_2_scales", self.use_power_2_scales)
        fields.check_format("Float8CurrentScaling", self.fp8_format)
        fields.check_gemm_params("Float8CurrentScaling", self)
        fields.check_attention(
            "Float8CurrentScaling", self.fp8_dpa, self.fp8_mha, dpa_supported=True
        )
        fields.check_backward_override("Float8CurrentScaling", self.backward_override)

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


def check_recipe(recipe: object, argument: str = "fp8_recipe") -> None:
    """Raises a TypeError naming the known recipes when ``recipe`` is not one of them."""
    if not isinstance(recipe, RECIPE_TYPES):
        names = ", ".join(cls.__name__ for cls in RECIPE_TYPES)
        raise TypeError(
            f"{argument} must be a te_flax.quantize recipe ({names}) or None, got {recipe!r}"
        )
