"""``layernorm_mlp``: a norm, two GEMMs and the (gated) activation between them, fused.

Built from the stages of ``layernorm_dense`` and ``dense`` (normalize, quantize an operand, GEMM,
bias) and the activation stage; it writes none of them again. The intermediate dropout (its mask
drawn inside the op from a key, applied before the second GEMM's quantization and drawn again
from the same key in the backward), low-rank adaptation of both GEMMs and the norm output are
part of the op, so that every configuration of ``LayerNormMLP`` runs this one path.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from te_flax._base import checks as check
from te_flax._layers.lora import lora_delta
from te_flax._ops.activations import (
    ClampedSwigluParams,
    activation_backward,
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax._ops.kernels import traced_in_scan
from te_flax._ops.stages import (
    GradOperand,
    NormSpec,
    NormStats,
    activation_grad,
    activation_operand,
    activation_output,
    apply_norm,
    constrained,
    dense_backward,
    dense_forward,
    input_uses,
    kernel_operand,
    norm_operand,
    normalize,
    normalize_backward,
    one_pass_layouts,
    run_op,
    saved_operand,
)
from te_flax.collective import CollectiveOpSet, check_collective_op_set, noop_collective_op_set
from te_flax.quantize import (
    LEADING,
    TRAILING,
    GemmOperand,
    Quantizer,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    float32_state,
    noop_quantizer_set,
    quantize_operand,
)
from te_flax.sharding import (
    LogicalAxes,
    Specs,
    explicit_specs,
    vary_like,
    with_explicit_specs,
    with_logical_constraint,
)

__all__ = ["layernorm_mlp", "layernorm_mlp_with_norm_output"]

# Low-rank adaptation of both GEMMs: (A_1 [hidden, n_act, r], B_1 [n_act, r, intermediate],
# A_2 [intermediate, r], B_2 [r, hidden]), TransformerEngine's wi_lora_* and wo_lora_* kernels.
LoraKernels = tuple[Array, Array, Array, Array]


@dataclasses.dataclass(frozen=True)
class _Config:
    norm: NormSpec
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
    kernels_in_scan: tuple[bool, bool] = (False, False)  # see _stages.kernel_operand
    # The shardings of x, gamma, beta, the kernels and the biases under Explicit mesh axes.
    grad_specs: Specs = None


class _Residuals(NamedTuple):
    x: Array
    stats: NormStats
    gamma: Array
    beta: Array | None
    # FP8: the quantized operands of both GEMMs as the backward GEMMs contract them (per-tensor:
    # the forward GEMMs' own). Without FP8 the norm output and the activation output are
    # recomputed (from x and the statistics, from the pre-activation), so that no
    # high-precision [tokens, hidden] or [tokens, intermediate] copy waits for the backward.
    ln_operand: GemmOperand | None
    kernel_1_operand: GemmOperand | Array
    pre_activation: Array  # [batch..., n_act, intermediate], named ffn1_ckpt_name for remat
    activation_operand: GemmOperand | None
    kernel_2_operand: GemmOperand | Array
    quantizer_sets: tuple[QuantizerSet, QuantizerSet]  # x and kernel already updated
    # The dropout key (the backward draws the same mask again: no mask is saved) and the
    # low-rank kernels, or None.
    dropout_rng: Array | None
    lora_kernels: LoraKernels | None


# The output: [batch..., hidden], and the norm output too with return_norm_output.
_Output = Array | tuple[Array, Array]


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


def _dropped(config: _Config, values: Array, rng: Array | None) -> Array:
    """``values`` after the intermediate dropout drawn from ``rng`` (unchanged without it)."""
    if config.dropout_rate == 0.0:
        return values
    assert rng is not None, "checked by layernorm_mlp"
    mask = dropout_mask(values.shape, config.dropout_rate, config.dropout_dims, rng)
    return apply_dropout(values, mask, config.dropout_rate)


def _lora(config: _Config, x: Array, a: Array, b: Array) -> Array:
    """``x . A . B * alpha / rank`` in x's dtype."""
    return lora_delta(x, a, b, 1, a.shape[-1], config.lora_alpha).astype(x.dtype)


def _norm_output(
    config: _Config, x: Array, stats: NormStats, gamma: Array, beta: Array | None
) -> Array:
    """The norm output in x's dtype, as the unquantized GEMM operand would hold it."""
    return apply_norm(x, stats, gamma, beta, config.norm).astype(x.dtype)


def _activation_output(
    config: _Config, pre_activation: Array, rng: Array | None, quantized: bool
) -> Array:
    """``[batch..., n_act, intermediate]`` -> the activation after dropout, GEMM 2's input
    (``quantized``: an FP8 input, see ``activation_output``)."""
    activated = activation_output(
        pre_activation, config.activation_type, config.activation_params, quantized
    )
    return _dropped(config, activated, rng)


def _activation_operand(
    activated: Array,
    config: _Config,
    quantizer: Quantizer | None,
    dtype: DTypeLike,
    uses: tuple[str, ...],
) -> tuple[GemmOperand, Quantizer | None]:
    # The dropout mask is already applied: the quantization (and its amax) sees the dropped
    # and rescaled values that GEMM 2 multiplies.
    quantized = quantize_operand(activated, quantizer, dtype, activated.ndim - 1, uses)
    operand, new_quantizer = one_pass_layouts(quantized, uses)
    return constrained(operand, config.dot_2_input_axes), new_quantizer


def _forward(
    config: _Config,
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    quantizer_sets: tuple[QuantizerSet, QuantizerSet],
    dropout_rng: Array | None,
    lora_kernels: LoraKernels | None,
    for_backward: bool = True,
) -> tuple[_Output, _Residuals]:
    set_1, set_2 = quantizer_sets
    kernel_1, kernel_2 = kernels
    input_layouts = input_uses(for_backward)
    x = with_logical_constraint(x, config.norm_input_axes)
    _, stats = normalize(x, gamma, beta, config.norm)
    ln, x_1 = norm_operand(
        x,
        stats,
        gamma,
        beta,
        config.norm,
        set_1.x,
        config.dot_1_input_axes,
        input_layouts,
        source_axes=config.norm_input_axes,
    )
    # Kernels are [inputs, outputs...]: the forward contracts the leading axis.
    k_1, kernel_q_1 = kernel_operand(
        kernel_1, set_1.kernel, x.dtype, 1, for_backward, config.kernel_1_axes,
        config.kernels_in_scan[0],
    )  # fmt: skip
    fp8 = not (set_1.is_noop and set_2.is_noop)
    norm_output = None
    if config.return_norm_output or lora_kernels is not None:
        # Without FP8 the GEMM operand is that very array; under FP8 a second cast of the
        # float32 norm output, which XLA computes in the same fusion.
        norm_output = (
            _norm_output(config, x, stats, gamma, beta) if fp8 else cast(ScaledTensor, ln).data
        )
    # [batch..., hidden] x [hidden, n_act, intermediate] -> [batch..., n_act, intermediate]
    pre_activation = dense_forward(ln, k_1, 1, x.dtype, biases[0], set_1.precision)
    if lora_kernels is not None:
        assert norm_output is not None
        pre_activation = pre_activation + _lora(config, norm_output, *lora_kernels[:2])
    if isinstance(k_1, ScaledTensor) and k_1.scale_inv is not None:
        # XLA's GEMM rewriter fuses a tanh GELU into the GEMM as an epilogue, with the
        # pre-activation as an auxiliary output when anything else reads it (the backward
        # does), and then fails to emit an FP8 cuBLASLt GEMM with an auxiliary output. The
        # barrier (no copy) keeps the activation out of the FP8 GEMM.
        pre_activation = lax.optimization_barrier(pre_activation)
    pre_activation = checkpoint_name(pre_activation, config.ffn1_ckpt_name)
    # [batch..., n_act, intermediate] -> [batch..., intermediate]
    dropped: Array | None = None
    if config.dropout_rate == 0.0 and lora_kernels is None:
        # The activation straight to GEMM 2's operand (one pass on GPUs under per-tensor FP8).
        activated, x_2 = activation_operand(
            pre_activation,
            config.activation_type,
            config.activation_params,
            set_2.x,
            x.dtype,
            input_layouts,
        )
        activated = constrained(activated, config.dot_2_input_axes)
    else:
        dropped = _activation_output(config, pre_activation, dropout_rng, set_2.x is not None)
        activated, x_2 = _activation_operand(dropped, config, set_2.x, x.dtype, input_layouts)
    k_2, kernel_q_2 = kernel_operand(
        kernel_2, set_2.kernel, x.dtype, 1, for_backward, config.kernel_2_axes,
        config.kernels_in_scan[1],
    )  # fmt: skip
    # [batch..., intermediate] x [intermediate, hidden] -> [batch..., hidden]
    out = dense_forward(activated, k_2, 1, x.dtype, biases[1], set_2.precision)
    if lora_kernels is not None:
        assert dropped is not None
        out = out + _lora(config, dropped, *lora_kernels[2:])
    residuals = _Residuals(
        x=x,
        stats=stats,
        gamma=gamma,
        beta=beta,
        ln_operand=saved_operand(ln, LEADING, set_1.checkpoint_name) if fp8 else None,
        kernel_1_operand=saved_operand(k_1, TRAILING, set_1.checkpoint_name) if fp8 else kernel_1,
        pre_activation=pre_activation,
        activation_operand=saved_operand(activated, LEADING, set_2.checkpoint_name)
        if fp8
        else None,
        kernel_2_operand=saved_operand(k_2, TRAILING, set_2.checkpoint_name) if fp8 else kernel_2,
        quantizer_sets=(
            dataclasses.replace(set_1, x=x_1, kernel=kernel_q_1),
            dataclasses.replace(set_2, x=x_2, kernel=kernel_q_2),
        ),
        dropout_rng=dropout_rng,
        lora_kernels=lora_kernels,
    )
    if config.return_norm_output:
        assert norm_output is not None
        return (out, norm_output), residuals
    return out, residuals


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm_mlp(
    config: _Config,
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    quantizer_sets: tuple[QuantizerSet, QuantizerSet],
    dropout_rng: Array | None,
    lora_kernels: LoraKernels | None,
) -> _Output:
    # Not differentiated: no quantization for the backward GEMMs.
    args = (config, x, gamma, beta, kernels, biases, quantizer_sets, dropout_rng, lora_kernels)
    return _forward(*args, for_backward=False)[0]


def _gemm_operands(
    config: _Config, residuals: _Residuals, dtype: DTypeLike
) -> tuple[GemmOperand, GemmOperand, GemmOperand, GemmOperand]:
    """The four GEMM operands of the forward, recomputed where they were not saved."""
    if residuals.ln_operand is not None:
        # FP8: all four were saved as quantized operands.
        return (
            residuals.ln_operand,
            cast(GemmOperand, residuals.kernel_1_operand),
            cast(GemmOperand, residuals.activation_operand),
            cast(GemmOperand, residuals.kernel_2_operand),
        )
    ln, _ = norm_operand(
        residuals.x,
        residuals.stats,
        residuals.gamma,
        residuals.beta,
        config.norm,
        None,
        config.dot_1_input_axes,
        source_axes=config.norm_input_axes,
    )
    dropped = _activation_output(config, residuals.pre_activation, residuals.dropout_rng, False)
    activated, _ = _activation_operand(dropped, config, None, dtype, ())
    # Without FP8 the kernel residuals are the parameters themselves.
    kernel_1 = ScaledTensor(cast(Array, residuals.kernel_1_operand).astype(dtype))
    kernel_2 = ScaledTensor(cast(Array, residuals.kernel_2_operand).astype(dtype))
    return ln, kernel_1, activated, kernel_2


def _backward(
    config: _Config, residuals: _Residuals, grad: _Output
) -> tuple[
    Array,
    Array,
    Array | None,
    tuple[Array, Array],
    tuple[Array | None, Array | None],
    tuple[QuantizerSet, QuantizerSet],
    None,
    LoraKernels | None,
]:
    x, lora_kernels = residuals.x, residuals.lora_kernels
    out_grad, norm_output_grad = (
        cast(tuple[Array, Array], grad) if config.return_norm_output else (cast(Array, grad), None)
    )
    set_1, set_2 = residuals.quantizer_sets
    # TransformerEngine's assignment of the two gradient quantizers, so that TE's state names
    # mean the same tensors here: the first set's quantizes the layer's output gradient (GEMM
    # 2's), the second set's the activation gradient (GEMM 1's output gradient).
    output_grad_quantizer, activation_grad_quantizer = set_1.dgrad, set_2.dgrad
    ln, kernel_1, activated, kernel_2 = _gemm_operands(config, residuals, x.dtype)
    kernel_1_dtype, kernel_2_dtype = config.kernel_dtypes
    bias_1_dtype, bias_2_dtype = config.bias_dtypes
    # GEMM 2: [batch..., hidden] -> d activation [batch..., intermediate], d kernel_2. The
    # output is the residual stream, laid out as the norm input: its gradient is quantized on
    # those shards (gathered in float8 under sequence parallelism).
    grads_2 = dense_backward(
        out_grad,
        activated,
        kernel_2,
        output_grad_quantizer,
        1,
        x.dtype,
        kernel_2_dtype,
        bias_2_dtype,
        grad_axes=config.norm_input_axes,
        precision=set_2.precision,
    )
    d_dropped = grads_2.lhs
    lora_grads: list[Array] = []
    rng = residuals.dropout_rng
    if rng is not None:
        # A barrier (no copy) on the key: XLA would otherwise merge this draw with the
        # forward's and keep the random bits alive between them; drawing again costs no memory.
        rng = lax.optimization_barrier(rng)
    if lora_kernels is not None:
        # The adapter of GEMM 2 reads the (dropped) activation output in high precision.
        dropped = _activation_output(config, residuals.pre_activation, rng, set_2.x is not None)
        _, lora_2_vjp = jax.vjp(partial(_lora, config), dropped, *lora_kernels[2:])
        d_dropped_lora, *lora_grads = lora_2_vjp(out_grad)
        d_dropped = d_dropped + d_dropped_lora
    d_dropped = with_logical_constraint(d_dropped, config.dot_2_input_axes)
    # The dropout's backward: the same mask (drawn again from the key) and the same scale.
    d_activated = _dropped(config, d_dropped, rng)
    d_pre_activation: Array | GradOperand
    if lora_kernels is None:
        # On GPUs under per-tensor FP8, one kernel computes the activation's backward and
        # quantizes it for both GEMMs (see te_flax._ops.kernels); elsewhere the XLA stages.
        d_pre_activation = activation_grad(
            d_activated,
            residuals.pre_activation,
            config.activation_type,
            activation_grad_quantizer,
            bias_1_dtype,
            config.activation_params,
        )
        d_ln_lora = None
    else:
        # The adapter of GEMM 1 needs the pre-activation gradient in high precision: the XLA
        # stage, whose output GEMM 1's backward quantizes as any output gradient.
        d_pre_activation = activation_backward(
            d_activated, residuals.pre_activation, config.activation_type, config.activation_params
        )
        norm_output = _norm_output(config, x, residuals.stats, residuals.gamma, residuals.beta)
        _, lora_1_vjp = jax.vjp(partial(_lora, config), norm_output, *lora_kernels[:2])
        d_ln_lora, *lora_1_grads = lora_1_vjp(d_pre_activation)
        lora_grads = lora_1_grads + lora_grads
    # GEMM 1: d pre-activation [batch..., n_act, intermediate] -> d norm output, d kernel_1.
    extras = [extra for extra in (d_ln_lora, norm_output_grad) if extra is not None]
    grads_1 = dense_backward(
        d_pre_activation,
        ln,
        kernel_1,
        activation_grad_quantizer,
        1,
        x.dtype,
        kernel_1_dtype,
        bias_1_dtype,
        precision=set_1.precision,
        # The norm backward applies the dgrad's scale, unless other terms are added first.
        defer_dgrad_scale=not extras,
    )
    d_ln = sum(extras, grads_1.lhs)
    # The norm-output gradient returns to the norm input's layout (a reduce-scatter under
    # sequence parallelism).
    d_ln = with_logical_constraint(d_ln, config.norm_input_axes)
    d_x, d_gamma, d_beta = normalize_backward(
        d_ln, x, residuals.stats, residuals.gamma, residuals.beta, config.norm, grads_1.lhs_scale
    )
    d_kernels = (
        with_logical_constraint(grads_1.rhs, config.kernel_1_axes),
        with_logical_constraint(grads_2.rhs, config.kernel_2_axes),
    )
    new_sets = (
        dataclasses.replace(set_1, dgrad=grads_2.dgrad_quantizer),
        dataclasses.replace(set_2, dgrad=grads_1.dgrad_quantizer),
    )
    d_lora = None if lora_kernels is None else cast(LoraKernels, tuple(lora_grads))
    d_x, d_gamma, d_beta, d_kernels, d_biases = with_explicit_specs(
        (d_x, d_gamma, d_beta, d_kernels, (grads_1.bias, grads_2.bias)), config.grad_specs
    )
    return (
        d_x,
        d_gamma,
        d_beta,
        d_kernels,
        d_biases,
        as_cotangent(new_sets),
        None,  # the dropout key
        d_lora,
    )


_layernorm_mlp.defvjp(_forward, _backward)


# layernorm_mlp's arguments that TransformerEngine's signature has, in its order.
_POSITIONAL = (
    "x", "gamma", "beta", "kernels", "biases", "norm_type", "zero_centered_gamma", "epsilon",
    "transpose_batch_sequence", "norm_input_axes", "dot_1_input_axes", "dot_2_input_axes",
    "kernel_1_axes", "kernel_2_axes", "ffn1_ckpt_name", "ffn2_ckpt_name", "activation_type",
    "activation_params", "collective_op_sets", "quantizer_sets",
)  # fmt: skip


def _check_kernels_and_biases(x: Array, kernels: object, biases: object, n_act: int) -> None:
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


def _check_name(name: object, argument: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str (a jax.checkpoint name), got {name!r}")
    return name


def layernorm_mlp(
    x: Array,
    gamma: Array,
    beta: Array | None,
    kernels: Sequence[Array],
    biases: Sequence[Array | None],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: LogicalAxes = None,
    dot_1_input_axes: LogicalAxes = None,
    dot_2_input_axes: LogicalAxes = None,
    kernel_1_axes: LogicalAxes = None,
    kernel_2_axes: LogicalAxes = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str] = ("gelu",),
    activation_params: dict[str, float] | None = None,
    collective_op_sets: tuple[CollectiveOpSet, CollectiveOpSet] = (
        noop_collective_op_set,
        noop_collective_op_set,
    ),
    quantizer_sets: tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
    *,
    intermediate_dropout_rate: float = 0.0,
    intermediate_dropout_rng: Array | None = None,
    intermediate_dropout_dims: Sequence[int] = (),
    low_rank_adaptation_kernels: Sequence[Array] | None = None,
    low_rank_adaptation_alpha: float | None = None,
) -> Array:
    """Norm, GEMM 1 (+ bias 1), activation, dropout, GEMM 2 (+ bias 2), as one differentiable op.

    ``y = norm(x)``; ``h = y . kernels[0] + biases[0]`` (``[..., n_act, intermediate]``);
    ``a = act(h[..., 0, :])`` (times ``h[..., 1, :]`` for a gated pair);
    ``d = dropout(a)``; ``out = d . kernels[1] + biases[1]``. The norm runs in float32, the
    activation in x's dtype (quantized for an FP8 GEMM 2: computed in float32 and rounded once
    to x's dtype, as TransformerEngine's activation kernels compute it).
    With FP8 quantizer sets, the norm output, kernel 1, the activation output and kernel 2 are
    quantized directly to float8 for the forward GEMMs, and the two output gradients for the
    backward GEMMs: all six GEMMs of a training step are FP8. As in TransformerEngine's fused
    op, ``quantizer_sets[0]``'s gradient quantizer takes the layer's output gradient (GEMM 2's)
    and ``quantizer_sets[1]``'s the activation gradient (GEMM 1's output gradient), so the
    state named ``grad_0_*`` / ``grad_1_*`` holds the same tensors' history as in TE. The new
    state of both sets comes back as the gradient of ``quantizer_sets``.

    Args:
      x: ``[batch..., hidden]`` input.
      gamma: ``[hidden]`` norm scale.
      beta: ``[hidden]`` norm shift for layernorm; None for rmsnorm.
      kernels: ``[kernel_1 [hidden, n_act, intermediate], kernel_2 [intermediate, hidden]]``.
      biases: ``[bias_1 [n_act, intermediate] or None, bias_2 [hidden] or None]``.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: multiply by ``1 + gamma`` instead of ``gamma`` (default False).
      epsilon: added to the variance (or mean square) before the square root (default 1e-6).
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (default False). It changes
        no math; the layout that sharding sees is given by the ``*_axes`` arguments.
      norm_input_axes: logical axes of x (and of the norm-input gradient), and of the output
        gradient, whose layout the output (the residual stream) shares.
      dot_1_input_axes: logical axes of GEMM 1's input, the (quantized) norm output.
      dot_2_input_axes: logical axes of GEMM 2's input, the (quantized) activation output.
      kernel_1_axes: logical axes of kernel 1 and its gradient, e.g. ``("embed", "act", "mlp")``.
      kernel_2_axes: logical axes of kernel 2 and its gradient, e.g. ``("mlp", "embed")``.
      ffn1_ckpt_name: ``jax.checkpoint`` name of the pre-activation (default ``"ffn1"``).
      ffn2_ckpt_name: ``jax.checkpoint`` name of the output (default ``"ffn2"``).
      activation_type: ``("gelu",)`` (default), any of ``gelu``, ``gelu_exact``, ``silu``,
        ``relu``, ``quick_gelu``, ``squared_relu``, ``linear``, or a gated pair of one of them
        with ``"linear"`` (``("silu", "linear")`` is SwiGLU; the order within the pair does not
        matter), or ``("clamped_silu", "clamped_linear")``, TransformerEngine's clamped SwiGLU
        (gpt-oss): ``a = min(h0, limit) * sigmoid(alpha * min(h0, limit)) * (clip(h1, -limit,
        limit) + glu_linear_offset)``.
      activation_params: the clamped SwiGLU's parameters as TE's dict, keys ``limit`` (default
        7.0), ``alpha`` (1.702) and ``glu_linear_offset`` (1.0); None (default) for TE's
        defaults. Any other activation takes none.
      collective_op_sets: TransformerEngine's collective GEMMs, one set per GEMM; only the
        default (``noop_collective_op_set`` twice): XLA places the collectives that logical
        axis rules ask for (``te_flax.collective``).
      quantizer_sets: one ``QuantizerSet`` per GEMM (default: no FP8).
      intermediate_dropout_rate: dropout probability of the activation output (default 0.0:
        none). The mask is drawn inside the op from ``intermediate_dropout_rng`` exactly as
        ``flax.linen.Dropout`` draws it from that key, applied before GEMM 2's quantization,
        and drawn again from the key in the backward (no mask is saved).
      intermediate_dropout_rng: the dropout's PRNG key; required when the rate is above 0.
      intermediate_dropout_dims: axes of the activation output that share one mask value.
      low_rank_adaptation_kernels: None (default) or TransformerEngine's four LoRA kernels
        ``(A_1 [hidden, n_act, r], B_1 [n_act, r, intermediate], A_2 [intermediate, r], B_2 [r,
        hidden])``: GEMM 1's output gains ``norm(x) . A_1 . B_1 * alpha / r`` and GEMM 2's
        ``d . A_2 . B_2 * alpha / r``, both in high precision.
      low_rank_adaptation_alpha: the LoRA ``alpha``; None (default) scales by 1.

    Returns:
      ``[batch..., hidden]`` in ``x.dtype``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm_mlp import layernorm_mlp
      >>> from te_flax.quantize import DelayedScaling, QuantizerFactory
      >>> x = jnp.ones((2, 8, 16), jnp.bfloat16)
      >>> kernels = [jnp.ones((16, 2, 64)) / 16, jnp.ones((64, 16)) / 64]
      >>> sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling())
      >>> out = layernorm_mlp(x, jnp.ones(16), None, kernels, [None, None], "rmsnorm",
      ...                     activation_type=("silu", "linear"), quantizer_sets=sets)
      >>> out.shape, out.dtype
      ((2, 8, 16), dtype(bfloat16))
    """
    return cast(Array, _apply(locals(), return_norm_output=False))


def layernorm_mlp_with_norm_output(*args: Any, **kwargs: Any) -> tuple[Array, Array]:
    """``layernorm_mlp`` (the same arguments) that also returns the norm output,
    ``(out, norm(x))``.

    The norm output (in x's dtype) is differentiable: its gradient joins GEMM 1's in the norm
    backward. The modules use it for ``return_layernorm_output``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.layernorm_mlp import layernorm_mlp_with_norm_output
      >>> kernels = [jnp.ones((8, 1, 32)) / 8, jnp.ones((32, 8)) / 32]
      >>> out, ln = layernorm_mlp_with_norm_output(
      ...     jnp.ones((2, 8)), jnp.ones(8), None, kernels, [None, None], "rmsnorm")
      >>> out.shape, ln.shape
      ((2, 8), (2, 8))
    """
    arguments = inspect.signature(layernorm_mlp).bind(*args, **kwargs)
    arguments.apply_defaults()
    return cast(tuple[Array, Array], _apply(arguments.arguments, return_norm_output=True))


def _check_lora(kernels: object, x: Array, n_act: int, intermediate: int) -> LoraKernels | None:
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


def _check_dropout(
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


def _check_collective_op_sets(collective_op_sets: object) -> None:
    if not isinstance(collective_op_sets, Sequence) or len(collective_op_sets) != 2:
        raise TypeError(
            "collective_op_sets must be a pair of CollectiveOpSet (one per GEMM), got "
            f"{collective_op_sets!r}; leave the default (no collective GEMMs)"
        )
    for index, collective_op_set in enumerate(collective_op_sets):
        check_collective_op_set(collective_op_set, f"collective_op_sets[{index}]")


def _apply(arguments: dict[str, Any], return_norm_output: bool) -> _Output:
    """Checks ``layernorm_mlp``'s arguments and runs the op."""
    (
        x, gamma, beta, kernels, biases, norm_type, zero_centered_gamma, epsilon,
        transpose_batch_sequence, norm_input_axes, dot_1_input_axes, dot_2_input_axes,
        kernel_1_axes, kernel_2_axes, ffn1_ckpt_name, ffn2_ckpt_name, activation_type,
        activation_params, collective_op_sets, quantizer_sets,
    ) = (arguments[name] for name in _POSITIONAL)  # fmt: skip
    _check_collective_op_sets(collective_op_sets)
    check.check_floating(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one axis (the hidden axis it is normalized over)")
    activation_type = canonical_activation_type(activation_type)
    checked_params = canonical_activation_params(activation_type, activation_params)
    _check_kernels_and_biases(x, kernels, biases, len(activation_type))
    norm = check.check_norm(x, gamma, beta, norm_type, zero_centered_gamma, epsilon)
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    if not isinstance(quantizer_sets, Sequence) or len(quantizer_sets) != 2:
        raise TypeError(
            "quantizer_sets must be a pair of QuantizerSets, one per GEMM, e.g. "
            f"QuantizerFactory.create_set(2, fp8_recipe=...); got {quantizer_sets!r}"
        )
    set_1, set_2 = (
        check.check_quantizer_set(qs, f"quantizer_sets[{i}]") for i, qs in enumerate(quantizer_sets)
    )
    kernel_1, kernel_2 = kernels
    bias_1, bias_2 = biases
    dropout_rng = arguments["intermediate_dropout_rng"]
    dropout_rate, dropout_dims = _check_dropout(
        arguments["intermediate_dropout_rate"],
        dropout_rng,
        arguments["intermediate_dropout_dims"],
        x.ndim,
    )
    if dropout_rate == 0.0:
        dropout_rng = None
    lora_kernels = _check_lora(
        arguments["low_rank_adaptation_kernels"], x, len(activation_type), kernel_1.shape[2]
    )
    alpha = arguments["low_rank_adaptation_alpha"]
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)):
        raise TypeError(f"low_rank_adaptation_alpha must be a number or None, got {alpha!r}")
    config = _Config(
        norm=norm,
        activation_type=activation_type,
        activation_params=checked_params,
        norm_input_axes=check.check_axes(norm_input_axes, x.ndim, "norm_input_axes", "x"),
        dot_1_input_axes=check.check_axes(dot_1_input_axes, x.ndim, "dot_1_input_axes", "x"),
        dot_2_input_axes=check.check_axes(
            dot_2_input_axes, x.ndim, "dot_2_input_axes", "the activation output"
        ),
        kernel_1_axes=check.check_axes(kernel_1_axes, 3, "kernel_1_axes", "kernels[0]"),
        kernel_2_axes=check.check_axes(kernel_2_axes, 2, "kernel_2_axes", "kernels[1]"),
        ffn1_ckpt_name=_check_name(ffn1_ckpt_name, "ffn1_ckpt_name"),
        ffn2_ckpt_name=_check_name(ffn2_ckpt_name, "ffn2_ckpt_name"),
        kernel_dtypes=(kernel_1.dtype, kernel_2.dtype),
        bias_dtypes=(
            None if bias_1 is None else bias_1.dtype,
            None if bias_2 is None else bias_2.dtype,
        ),
        dropout_rate=dropout_rate,
        dropout_dims=dropout_dims,
        lora_alpha=arguments["low_rank_adaptation_alpha"],
        return_norm_output=return_norm_output,
        kernels_in_scan=(traced_in_scan(kernel_1), traced_in_scan(kernel_2)),
        grad_specs=explicit_specs((x, gamma, beta, tuple(kernels), tuple(biases))),
    )
    gamma, beta, kernels, biases = vary_like(x, (gamma, beta, tuple(kernels), tuple(biases)))
    if lora_kernels is not None:
        lora_kernels = vary_like(x, lora_kernels)
    sets = float32_state((set_1, set_2))
    operands = (x, gamma, beta, kernels, biases, sets, dropout_rng, lora_kernels)
    block_scaled = set_1.block_scaled or set_2.block_scaled
    output = run_op(
        _layernorm_mlp, config, operands, kernels[-1], block_scaled,
        norm_output=return_norm_output,
    )  # fmt: skip
    # Named outside the custom_vjp, where remat policies see the op's output as a value.
    if return_norm_output:
        out, norm_output = cast(tuple[Array, Array], output)
        return checkpoint_name(out, config.ffn2_ckpt_name), norm_output
    out = cast(Array, output)
    return checkpoint_name(out, config.ffn2_ckpt_name)
