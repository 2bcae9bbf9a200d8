"""The block-scaled recipes: ``MXFP8BlockScaling``, ``NVFP4BlockScaling`` and
``Float8BlockScaling`` give every block of consecutive elements along a GEMM's contraction its own
scale (importable from ``te_flax.quantize`` and ``te_flax.quantize.recipes``)."""

from __future__ import annotations

import dataclasses

from te_flax.quantize import _recipe_fields as fields
from te_flax.quantize._recipe_fields import Format, MMParams, QParams, RecipeKind

__all__ = ["FP8_BLOCK_SIZE", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"]

_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(RecipeKind, kinds=("mxfp8",)):
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
        fields.check_format("MXFP8BlockScaling", self.fp8_format)
        fields.check_attention("MXFP8BlockScaling", self.fp8_dpa, self.fp8_mha)
        fields.check_backward_override("MXFP8BlockScaling", self.backward_override)
        fields.check_bool(
            "MXFP8BlockScaling", "enable_2d_quantization", self.enable_2d_quantization
        )
        if self.enable_2d_quantization:
            raise ValueError(
                "MXFP8BlockScaling(enable_2d_quantization=True) asks for 2D-block kernel scales, "
                "which te_flax does not implement: it scales kernels in 1x32 blocks along each "
                "GEMM's contraction, like every other tensor; leave it False"
            )


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(RecipeKind, kinds=("nvfp4",)):
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
            fields.check_bool(name, field, getattr(self, field))
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
        fields.check_attention(name, self.fp8_dpa, self.fp8_mha)
        fields.check_backward_override(name, self.backward_override)

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
class Float8BlockScaling(RecipeKind, kinds=("float8_block_scaling",)):
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
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)  # noqa: RUF009 (frozen)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)  # noqa: RUF009 (frozen)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)  # noqa: RUF009 (frozen)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        name = "Float8BlockScaling"
        fields.check_bool(name, "use_f32_scales", self.use_f32_scales)
        fields.check_format(name, self.fp8_format)
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
        fields.check_gemm_params(name, self)
        for field in fields.GEMM_FIELDS:
            if not getattr(self, field).use_split_accumulator:
                raise ValueError(
                    f"{name}({field}=MMParams(use_split_accumulator=False)): blockwise FP8 "
                    f"sums each {FP8_BLOCK_SIZE}-wide chunk of K in float32 with its scales "
                    "(split accumulation), which the recipe requires (as in TransformerEngine); "
                    "leave use_split_accumulator=True"
                )
        fields.check_attention(name, self.fp8_dpa, self.fp8_mha)
        fields.check_backward_override(name, self.backward_override)

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
