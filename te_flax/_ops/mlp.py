"""``layernorm_mlp``'s records (its static configuration and its operands) and the checks of
its arguments that build them (each error names the argument, what was received, and how to fix
it), and the op's stages besides the shared ones: the activation between its GEMMs, forward
(the activation output as GEMM 2's operand, quantized in one pass on GPUs) and backward (its
gradient as GEMM 1's output gradient), and the intermediate dropout (the same draw as
``flax.linen.Dropout``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from te_flax._base import checks as check
from te_flax._ops.activations import (
    ClampedSwigluParams,
    activation_backward,
    activation_forward,
)
from te_flax._ops.arguments import check_quantizer_set
from te_flax._ops.gemm_operands import constrained, grad_operand, one_pass_layouts
from te_flax._ops.kernels import GradOperand, activation_grad_operand, activation_quantize_operand
from te_flax._ops.norm import NormConfig
from te_flax.collective import check_collective_op_set
from te_flax.quantize import GemmOperand, Quantizer, QuantizerSet, quantize_operand
from te_flax.sharding import Specs

__all__ = [
    "LoraKernels",
    "MlpConfig",
    "MlpOperands",
    "activation_gemm_operand",
    "activation_grad",
    "activation_operand",
    "activation_output",
    "apply_dropout",
    "check_collective_op_sets",
    "check_dropout",
    "check_kernels_and_biases",
    "check_lora",
    "check_lora_alpha",
    "check_name",
    "check_quantizer_sets",
    "dropout_mask",
    "dropped_activation",
    "with_dropout",
]

# Low-rank adaptation of both GEMMs: (A_1 [hidden, n_act, r], B_1 [n_act, r, intermediate],
# A_2 [intermediate, r], B_2 [r, hidden]), TransformerEngine's wi_lora_* and wo_lora_* kernels.
LoraKernels = tuple[Array, Array, Array, Array]


def dropout_mask(shape: tuple[int, ...], rate: float, dims: Sequence[int], rng: Array) -> Array:
    """The keep mask of a dropout of ``rate``, one value per position of ``shape`` outside
    ``dims`` (broadcast over them): ``flax.linen.Dropout``'s draw from the key ``rng``."""
    mask_shape = list(shape)
    for dim in dims:
        mask_shape[dim] = 1
    mask = jax.random.bernoulli(rng, p=1.0 - rate, shape=mask_shape)
    return jnp.broadcast_to(mask, shape)


def apply_dropout(values: Array, mask: Array, rate: float) -> Array:
    """``values`` with the dropped ones zeroed and the kept ones scaled by ``1 / (1 - rate)``
    in ``values``' dtype: the operations of ``flax.linen.Dropout``, so the values are the same.
    The dropout's backward is the same function of the gradient."""
    return lax.select(mask, values / (1.0 - rate), jnp.zeros_like(values))


def check_kernels_and_biases(x: Array, kernels: object, biases: object, n_act: int) -> None:
    if not isinstance(kernels, Sequence) or len(kernels) != 2:
        raise TypeError(
            "kernels must be a pair [kernel_1 [hidden, n_act, intermediate], kernel_2 "
            f"[intermediate, hidden]], got {type(kernels).__name__}"
        )
    kernel_1, kernel_2 = kernels
    check.check_floating(kernel_1, "kernels[0]")
    check.check_floating(kernel_2, "kernels[1]")
    hidden = x.shape[-1]
    if kernel_1.ndim != 3 or kernel_1.shape[0] != hidden or kernel_1.shape[1] != n_act:
        raise ValueError(
            f"kernels[0] has shape {tuple(kernel_1.shape)} but must be [hidden, n_act, "
            f"intermediate] = [{hidden}, {n_act}, intermediate]: hidden is x.shape[-1] and n_act "
            "is len(activation_type) (2 for a gated pair such as ('silu', 'linear'))"
        )
    intermediate = kernel_1.shape[2]
    check.check_shape(
        kernel_2,
        (intermediate, hidden),
        "kernels[1]",
        "it maps the intermediate size of kernels[0] back to x's hidden size",
    )
    if not isinstance(biases, Sequence) or len(biases) != 2:
        raise TypeError(
            "biases must be a pair [bias_1 [n_act, intermediate] or None, bias_2 [hidden] or "
            f"None], got {biases!r}"
        )
    for index, (bias, shape, what) in enumerate(
        zip(
            biases,
            ((n_act, intermediate), (hidden,)),
            ("kernels[0]'s output axes", "the hidden size"),
            strict=True,
        )
    ):
        if bias is not None:
            check.check_floating(bias, f"biases[{index}]")
            check.check_shape(bias, shape, f"biases[{index}]", f"it matches {what}")


def check_name(name: object, argument: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str (a jax.checkpoint name), got {name!r}")
    return name


def check_lora(kernels: object, x: Array, n_act: int, intermediate: int) -> LoraKernels | None:
    if kernels is None:
        return None
    if not isinstance(kernels, Sequence) or len(kernels) != 4:
        raise TypeError(
            "low_rank_adaptation_kernels must be None or the four kernels (A_1 [hidden, n_act, "
            f"rank], B_1 [n_act, rank, intermediate], A_2 [intermediate, rank], B_2 [rank, "
            f"hidden]), got {type(kernels).__name__}"
        )
    for index, kernel in enumerate(kernels):
        check.check_floating(kernel, f"low_rank_adaptation_kernels[{index}]")
    hidden, rank = x.shape[-1], kernels[0].shape[-1]
    shapes = (
        (hidden, n_act, rank),
        (n_act, rank, intermediate),
        (intermediate, rank),
        (rank, hidden),
    )
    for index, (kernel, shape) in enumerate(zip(kernels, shapes, strict=True)):
        check.check_shape(
            kernel,
            shape,
            f"low_rank_adaptation_kernels[{index}]",
            "TransformerEngine's LoRA layout with the rank of A_1's last axis",
        )
    return cast(LoraKernels, tuple(kernels))


def check_dropout(
    rate: object, rng: Array | None, dims: object, ndim: int
) -> tuple[float, tuple[int, ...]]:
    rate = check.check_rate(rate, "intermediate_dropout_rate")
    if rate > 0 and rng is None:
        raise ValueError(
            f"intermediate_dropout_rate={rate} needs intermediate_dropout_rng, the key the "
            "mask is drawn from; pass a jax.random.key, or rate 0.0 for no dropout"
        )
    if isinstance(dims, int) or not isinstance(dims, Sequence):
        raise TypeError(f"intermediate_dropout_dims must be a tuple of axes, got {dims!r}")
    canonical = []
    for dim in dims:
        if not isinstance(dim, int) or not -ndim <= dim < ndim:
            raise ValueError(
                f"intermediate_dropout_dims={tuple(dims)!r}: each must be an axis of the "
                f"activation output, which has {ndim} axes"
            )
        canonical.append(dim % ndim)
    return rate, tuple(canonical)


def check_collective_op_sets(collective_op_sets: object) -> None:
    if not isinstance(collective_op_sets, Sequence) or len(collective_op_sets) != 2:
        raise TypeError(
            "collective_op_sets must be a pair of CollectiveOpSet (one per GEMM), got "
            f"{collective_op_sets!r}; leave the default (no collective GEMMs)"
        )
    for index, collective_op_set in enumerate(collective_op_sets):
        check_collective_op_set(collective_op_set, f"collective_op_sets[{index}]")


def check_quantizer_sets(quantizer_sets: object) -> tuple[QuantizerSet, QuantizerSet]:
    if not isinstance(quantizer_sets, Sequence) or len(quantizer_sets) != 2:
        raise TypeError(
            "quantizer_sets must be a pair of QuantizerSets, one per GEMM, e.g. "
            f"QuantizerFactory.create_set(2, fp8_recipe=...); got {quantizer_sets!r}"
        )
    set_1, set_2 = (
        check_quantizer_set(qs, f"quantizer_sets[{i}]") for i, qs in enumerate(quantizer_sets)
    )
    return set_1, set_2


def check_lora_alpha(alpha: object) -> float | None:
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)):
        raise TypeError(f"low_rank_adaptation_alpha must be a number or None, got {alpha!r}")
    return cast(float | None, alpha)


class MlpOperands(NamedTuple):
    """``layernorm_mlp``'s differentiable arguments, checked: what its ``custom_vjp`` takes."""

    x: Array  # [batch..., hidden]
    gamma: Array  # [hidden]
    beta: Array | None  # [hidden], None for rmsnorm
    kernels: tuple[Array, Array]  # [hidden, n_act, intermediate], [intermediate, hidden]
    biases: tuple[Array | None, Array | None]  # [n_act, intermediate], [hidden]
    quantizer_sets: tuple[QuantizerSet, QuantizerSet]
    dropout_rng: Array | None  # the intermediate dropout's key; None without dropout
    lora_kernels: LoraKernels | None


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """``layernorm_mlp``'s static arguments, checked."""

    norm: NormConfig
    activation_type: tuple[str, ...]
    activation_params: ClampedSwigluParams | None
    norm_input_axes: tuple[str | None, ...] | None
    dot_1_input_axes: tuple[str | None, ...] | None
    dot_2_input_axes: tuple[str | None, ...] | None
    kernel_1_axes: tuple[str | None, ...] | None
    kernel_2_axes: tuple[str | None, ...] | None
    ffn1_ckpt_name: str
    ffn2_ckpt_name: str
    kernel_dtypes: tuple[Any, Any]
    bias_dtypes: tuple[Any, Any]  # None for a missing bias
    # Dropout of the activation output: its rate (0: off) and the axes one mask value covers.
    dropout_rate: float = 0.0
    dropout_dims: tuple[int, ...] = ()
    # Low-rank adaptation's alpha (the update is scaled by alpha / rank; None: by 1).
    lora_alpha: float | None = None
    # Also return the norm output (in x's dtype), for return_layernorm_output.
    return_norm_output: bool = False
    kernels_in_scan: tuple[bool, bool] = (False, False)  # see gemm_operands.kernel_operand
    # The shardings of x, gamma, beta, the kernels and the biases under Explicit mesh axes.
    grad_specs: Specs = None


def with_dropout(config: MlpConfig, values: Array, rng: Array | None) -> Array:
    """``values`` after the intermediate dropout drawn from ``rng`` (unchanged without it)."""
    if config.dropout_rate == 0.0:
        return values
    assert rng is not None, "checked by layernorm_mlp"
    mask = dropout_mask(values.shape, config.dropout_rate, config.dropout_dims, rng)
    return apply_dropout(values, mask, config.dropout_rate)


def dropped_activation(
    config: MlpConfig, pre_activation: Array, rng: Array | None, quantized: bool
) -> Array:
    """``[batch..., n_act, intermediate]`` -> the activation after dropout, GEMM 2's input
    (``quantized``: an FP8 input, see ``activation_output``)."""
    activated = activation_output(
        pre_activation, config.activation_type, config.activation_params, quantized
    )
    return with_dropout(config, activated, rng)


def activation_gemm_operand(
    activated: Array,
    config: MlpConfig,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None]:
    # The dropout mask is already applied: the quantization (and its amax) sees the dropped
    # and rescaled values that GEMM 2 multiplies.
    quantized = quantize_operand(activated, quantizer, dtype, activated.ndim - 1, uses)
    operand, new_quantizer = one_pass_layouts(quantized, uses)
    return constrained(operand, config.dot_2_input_axes), new_quantizer


def activation_operand(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    activation_params: ClampedSwigluParams | None,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None]:
    """``activation_forward``'s ``[batch..., intermediate]`` output as a GEMM input (see
    ``input_uses``): quantized by ``quantizer`` (the activation computed in float32 and
    rounded once to the pre-activation's dtype), or cast to ``dtype``.

    Per-tensor FP8 on GPUs: one kernel reads the pre-activation once and writes the float8
    activation in the layouts of both GEMMs that read it, and the amax; the activation in high
    precision is never written (see te_flax._ops.kernels). Elsewhere the XLA stage.
    """

    def xla_stage() -> tuple[GemmOperand, Quantizer | None]:
        activated = activation_output(
            pre_activation, activation_type, activation_params, quantizer is not None
        )
        operand = quantize_operand(activated, quantizer, dtype, activated.ndim - 1, uses)
        return one_pass_layouts(operand, uses)

    return activation_quantize_operand(pre_activation, activation_type, quantizer, uses, xla_stage)


def activation_output(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    activation_params: ClampedSwigluParams | None,
    quantized: bool,
) -> Array:
    """``activation_forward(pre_activation)`` in the pre-activation's dtype. For a quantized
    GEMM input (``quantized``) computed in float32 and rounded once to that dtype, as the
    activation kernel (and TransformerEngine's activation kernels) compute it."""
    if not quantized:
        return activation_forward(pre_activation, activation_type, activation_params)
    pre32 = pre_activation.astype(jnp.float32)
    activated = activation_forward(pre32, activation_type, activation_params)
    return activated.astype(pre_activation.dtype)


def activation_grad(
    grad: Array,
    pre_activation: Array,
    activation_type: tuple[str, ...],
    grad_quantizer: Quantizer | None,
    bias_dtype: DTypeLike | None,
    activation_params: ClampedSwigluParams | None = None,
) -> Array | GradOperand:
    """The gradient of ``activation_forward``'s ``[batch..., n_act, intermediate]`` input, as
    ``dense_backward`` takes its output gradient: in high precision (the XLA stage), or
    prepared with ``grad_quantizer`` and ``bias_dtype`` by the kernel that fuses the
    activation's backward with the quantization (on GPUs, per-tensor FP8). The kernel takes
    no activation parameters: the clamped SwiGLU always runs the XLA stage."""

    def xla_stage() -> Array:
        # The barrier (no copy) keeps XLA from sharing the float32 backward's first operations
        # with the forward's activation when both are in one program: it would write the
        # shared float32 values from the forward and read them back here, and give up fusing
        # this backward into the gradient's quantization.
        pre = lax.optimization_barrier(pre_activation)
        return activation_backward(grad, pre, activation_type, activation_params)

    def prepare(d_pre_activation: Array) -> GradOperand:
        return grad_operand(d_pre_activation, grad_quantizer, 2, bias_dtype)

    return activation_grad_operand(
        grad, pre_activation, activation_type, grad_quantizer, bias_dtype, xla_stage, prepare
    )
