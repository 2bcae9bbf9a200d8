"""``dense``: a GEMM of ``x``'s trailing axes with a kernel's leading axes, FP8 or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from te_flax._base import checks as check
from te_flax._ops import grouped as _grouped
from te_flax._ops.activations import rounded_once_activation
from te_flax._ops.arguments import check_quantizer_set
from te_flax._ops.custom_op import fused_op
from te_flax._ops.gemm import dense_backward, forward_contracting, gemm, gemm_out_specs
from te_flax._ops.gemm_operands import (
    constrained,
    input_uses,
    kernel_operand,
    saved_gemm_operands,
    unquantized_operand,
)
from te_flax._ops.grouped_activation import fuses
from te_flax._ops.kernels import traced_in_scan
from te_flax.collective import CollectiveOpSet, check_collective_op_set, noop_collective_op_set
from te_flax.quantize import (
    GemmOperand,
    QuantizerSet,
    ScaledTensor,
    as_cotangent,
    float32_state,
    inspection,
    noop_quantizer_set,
    quantize_operand,
    scaling,
)
from te_flax.quantize.quantizer_set import ungrouped_quantizer_set
from te_flax.sharding import (
    LogicalAxes,
    Specs,
    explicit_specs,
    vary_like,
    with_explicit_specs,
    with_logical_constraint,
)

__all__ = [
    "Fp8AtBf16RateWarning",
    "RaggedOnGpuWarning",
    "dense",
    "grouped_dense",
    "grouped_quantizer_set",
]

grouped_quantizer_set = _grouped.grouped_quantizer_set
RaggedOnGpuWarning = _grouped.RaggedOnGpuWarning
Fp8AtBf16RateWarning = _grouped.Fp8AtBf16RateWarning


@dataclasses.dataclass(frozen=True)
class _Config:
    n_contract: int
    input_axes: tuple[str | None, ...] | None
    kernel_axes: tuple[str | None, ...] | None
    output_axes: tuple[str | None, ...] | None
    kernel_dtype: Any
    bias_dtype: Any  # None without a bias
    kernel_in_scan: bool = False  # traced in a scan body (gemm_operands.kernel_operand)
    # The shardings of x, kernel and bias under Explicit mesh axes (their gradients'), or None.
    grad_specs: Specs = None


class _Operands(NamedTuple):
    """The op's differentiable arguments, checked."""

    x: Array  # [batch..., K...]
    kernel: Array  # [K..., features...]
    bias: Array | None  # [features...]
    quantizer_set: QuantizerSet


class _Residuals(NamedTuple):
    # FP8: the quantized operands as the backward GEMMs contract them (per-tensor: the forward
    # GEMM's own). Without FP8: x and the kernel themselves.
    lhs: GemmOperand | Array
    rhs: GemmOperand | Array
    quantizers: QuantizerSet  # x and kernel already updated by the forward


def _forward(config: _Config, operands: _Operands, for_backward: bool) -> tuple[Array, _Residuals]:
    x, kernel, bias, quantizer_set = operands
    # The forward GEMM contracts x's trailing axes and the kernel's leading ones; wgrad then
    # contracts x's leading (token) axes, dgrad the kernel's trailing (feature) axes.
    n_batch = x.ndim - config.n_contract
    x = with_logical_constraint(x, config.input_axes)
    lhs, x_quantizer = quantize_operand(
        x, quantizer_set.x, x.dtype, n_batch, input_uses(for_backward)
    )
    lhs = constrained(lhs, config.input_axes)
    rhs, kernel_quantizer = kernel_operand(
        kernel,
        quantizer_set.kernel,
        x.dtype,
        config.n_contract,
        for_backward,
        config.kernel_axes,
        config.kernel_in_scan,
    )
    # [batch..., K...] x [K..., features...] -> [batch..., features...], by default with fast
    # accumulation (the recipe's fp8_gemm_fprop can ask for split accumulation).
    contracting = forward_contracting(lhs, config.n_contract)
    out, _ = gemm(lhs, rhs, contracting, x.dtype, quantizer_set.precision.fprop, bias=bias)
    out = with_logical_constraint(out, config.output_axes)
    quantizers = dataclasses.replace(quantizer_set, x=x_quantizer, kernel=kernel_quantizer)
    if quantizer_set.is_noop:
        # Without FP8 the residuals are x and the kernel themselves.
        return out, _Residuals(x, kernel, quantizers)
    return out, _Residuals(*saved_gemm_operands(lhs, rhs, quantizer_set), quantizers)


def _backward(config: _Config, residuals: _Residuals, grad: Array) -> _Operands:
    quantizers = residuals.quantizers
    grad = with_logical_constraint(grad, config.output_axes)
    lhs: GemmOperand
    rhs: GemmOperand
    if quantizers.is_noop:
        x = cast(Array, residuals.lhs)
        lhs, rhs = ScaledTensor(x), unquantized_operand(residuals.rhs, x.dtype)
    else:
        lhs, rhs = cast(GemmOperand, residuals.lhs), cast(GemmOperand, residuals.rhs)
    compute_dtype = grad.dtype
    grads = dense_backward(
        grad,
        lhs,
        rhs,
        quantizers.dgrad,
        config.n_contract,
        compute_dtype,
        config.kernel_dtype,
        config.bias_dtype,
        grad_axes=config.output_axes,
        precision=quantizers.precision,
    )
    d_x = with_logical_constraint(grads.lhs, config.input_axes)
    d_kernel = with_logical_constraint(grads.rhs, config.kernel_axes)
    new_state = dataclasses.replace(quantizers, dgrad=grads.dgrad_quantizer)
    d_x, d_kernel, d_bias = with_explicit_specs((d_x, d_kernel, grads.bias), config.grad_specs)
    return _Operands(d_x, d_kernel, d_bias, as_cotangent(new_state))


def _out_specs(config: _Config, operands: _Operands) -> Any:
    return gemm_out_specs(operands.x, operands.kernel, config.n_contract)


_dense = fused_op(_forward, _backward, _out_specs)


class _LastAxis(tuple):  # type: ignore[type-arg]
    """``dense``'s default ``contracting_dims``: TransformerEngine's ``((1,), (0,))`` (how it
    reads in the signature), meaning x's last axis with the kernel's first. For a 2-D x that is
    TE's meaning; for more axes TE refuses its own default, and te_flax contracts the last."""


LAST_AXIS = _LastAxis(((1,), (0,)))


def _contraction_size(
    x: Array, kernel: Array, contracting_dims: tuple[Sequence[int], Sequence[int]] | None
) -> int:
    """How many trailing axes of x contract with as many leading axes of kernel."""
    if contracting_dims is None or contracting_dims is LAST_AXIS:
        contracting_dims = ((x.ndim - 1,), (0,))
    x_dims: tuple[int, ...] | None
    kernel_dims: tuple[int, ...] | None
    try:
        x_dims, kernel_dims = (tuple(dims) for dims in contracting_dims)
    except (TypeError, ValueError):
        x_dims = kernel_dims = None
    if (
        x_dims is None
        or kernel_dims is None
        or not all(
            isinstance(d, int | np.integer) and not isinstance(d, bool)
            for d in x_dims + kernel_dims
        )
    ):
        raise TypeError(
            "contracting_dims must be a pair of tuples of ints, e.g. ((x.ndim - 1,), (0,)); "
            f"got {contracting_dims!r}"
        )
    for dims, array, name in ((x_dims, x, "x"), (kernel_dims, kernel, "kernel")):
        for d in dims:
            if not -array.ndim <= d < array.ndim:
                raise ValueError(
                    f"contracting_dims axis {d} is out of range for {name} with {array.ndim} "
                    f"dimensions (shape {array.shape})"
                )
    x_dims = tuple(int(d) % x.ndim for d in x_dims)
    kernel_dims = tuple(int(d) % kernel.ndim for d in kernel_dims)
    n = len(x_dims)
    trailing = tuple(range(x.ndim - n, x.ndim))
    leading = tuple(range(n))
    if n == 0 or len(kernel_dims) != n or x_dims != trailing or kernel_dims != leading:
        raise ValueError(
            f"contracting_dims={contracting_dims!r} is not supported for x of shape {x.shape} "
            f"and kernel of shape {kernel.shape}: x must contract its trailing axes and kernel "
            f"its leading axes, in order, e.g. contracting_dims=(({x.ndim - 1},), (0,))"
        )
    x_sizes, kernel_sizes = x.shape[x.ndim - n :], kernel.shape[:n]
    if x_sizes != kernel_sizes:
        raise ValueError(
            f"kernel has {kernel_sizes} input features but x has {x_sizes} "
            f"(x.shape[{x.ndim - n}:]); check the kernel's leading axes or contracting_dims"
        )
    if kernel.ndim == n:
        raise ValueError(
            f"kernel of shape {kernel.shape} has no output axes; it must be [K..., features...]"
        )
    return n


def dense(
    x: Array,
    kernel: Array,
    bias: Array | None = None,
    contracting_dims: tuple[Sequence[int], Sequence[int]] | None = LAST_AXIS,
    transpose_batch_sequence: bool = False,
    input_axes: LogicalAxes = None,
    kernel_axes: LogicalAxes = None,
    output_axes: LogicalAxes = None,
    collective_op_set: CollectiveOpSet = noop_collective_op_set,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> Array:
    """``x . kernel + bias``, contracting x's trailing axes with the kernel's leading axes.

    With an FP8 ``quantizer_set`` x and the kernel are quantized directly to float8 for the
    forward GEMM and the output gradient for the two backward GEMMs; the new quantizer state
    comes back as the gradient of ``quantizer_set``. Block-scaled sets (MXFP8, NVFP4) quantize
    each tensor once per GEMM that contracts it, so the contracted sizes must be multiples of
    the block (input and output features; the tokens when differentiated).

    Args:
      x: ``[batch..., K...]``.
      kernel: ``[K..., features...]``.
      bias: ``[features...]`` or None (default).
      contracting_dims: ``(x_dims, kernel_dims)``. The default, TransformerEngine's
        ``((1,), (0,))``, and None contract x's last axis with kernel axis 0 (for a 2-D x that
        is axis 1; TE refuses its default for more axes). x's dims must be its trailing axes
        and the kernel's its leading ones.
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (default False). It changes
        no math; the layout that sharding sees is given by the ``*_axes`` arguments.
      input_axes: logical axes of x (and of its gradient).
      kernel_axes: logical axes of the (quantized) kernel and of its gradient.
      output_axes: logical axes of the output (and of the incoming gradient).
      collective_op_set: TransformerEngine's collective GEMM; only ``noop_collective_op_set``
        (the default): XLA places the collectives that logical axis rules ask for
        (``te_flax.collective``).
      quantizer_set: the GEMM's quantizers (default ``noop_quantizer_set``: no FP8).

    Returns:
      ``[batch..., features...]`` in ``x.dtype``.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.dense import dense
      >>> dense(jnp.ones((2, 5, 8)), jnp.ones((8, 4)), bias=jnp.ones(4))[0, 0]
      Array([9., 9., 9., 9.], dtype=float32)
    """
    check.check_input(x, "x")
    check.check_floating(kernel, "kernel")
    n_contract = _contraction_size(x, kernel, contracting_dims)
    if bias is not None:
        check.check_floating(bias, "bias")
        check.check_shape(
            bias, kernel.shape[n_contract:], "bias", "it matches the kernel's output axes"
        )
    check.check_bool(transpose_batch_sequence, "transpose_batch_sequence")
    check_collective_op_set(collective_op_set)
    out_ndim = x.ndim - n_contract + kernel.ndim - n_contract
    config = _Config(
        n_contract=n_contract,
        input_axes=check.check_axes(input_axes, x.ndim, "input_axes", "x"),
        kernel_axes=check.check_axes(kernel_axes, kernel.ndim, "kernel_axes", "kernel"),
        output_axes=check.check_axes(output_axes, out_ndim, "output_axes", "the output"),
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        kernel_in_scan=traced_in_scan(kernel),
        grad_specs=explicit_specs((x, kernel, bias)),
    )
    kernel, bias = vary_like(x, (kernel, bias))
    quantizer_set = float32_state(check_quantizer_set(quantizer_set))
    return cast(Array, _dense(config, _Operands(x, kernel, bias, quantizer_set)))


# ----------------------------------------------------------------------------- grouped_dense

LOWERINGS = ("auto", "ragged", "capacity")


def _check_group_sizes(group_sizes: object, n_groups: int, rows: int) -> Array:
    dtype = getattr(group_sizes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            "group_sizes must be an integer array (int32) holding the number of rows of x in "
            f"each group, got {dtype if dtype is not None else type(group_sizes).__name__}; "
            "e.g. jnp.bincount(expert_ids, length=n_groups).astype(jnp.int32)"
        )
    group_sizes = cast(Array, group_sizes)
    if group_sizes.shape != (n_groups,):
        raise ValueError(
            f"group_sizes has shape {tuple(group_sizes.shape)} but the kernel holds {n_groups} "
            f"groups (kernel.shape[0]); pass one size per group, shape ({n_groups},)"
        )
    try:
        sizes = np.asarray(group_sizes)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        # Traced: the values are not known here. Negative sizes count as 0 and the groups are
        # cut at x's last row, so that no GEMM reads past x.
        ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), rows)
        return jnp.diff(ends, prepend=0)
    if (sizes < 0).any():
        raise ValueError(
            f"group_sizes must be >= 0, got {sizes.tolist()}; each entry counts the rows of x "
            "in one group"
        )
    if int(sizes.sum()) > rows:
        raise ValueError(
            f"group_sizes sum to {int(sizes.sum())} but x has only {rows} rows (x.shape[0]); "
            "the groups' rows must fit in x (rows past the sum are allowed and give zeros)"
        )
    return group_sizes.astype(jnp.int32)


def _check_grouped_shapes(
    x: Array, kernel: Array, contracting_dims: object, bias: Array | None
) -> None:
    check.check_floating(x, "x")
    check.check_floating(kernel, "kernel")
    if x.ndim != 2 or kernel.ndim != 3:
        raise ValueError(
            f"grouped_dense takes x as [M, K] and kernel as [G, K, N], got x of shape "
            f"{x.shape} and kernel of shape {kernel.shape}; flatten the tokens of x to rows "
            "sorted by group"
        )
    try:
        dims = tuple(tuple(int(d) for d in side) for side in cast(Any, contracting_dims))
    except (TypeError, ValueError):
        dims = ()
    if dims not in (((1,), (1,)), ((-1,), (1,)), ((1,), (-2,)), ((-1,), (-2,))):
        raise ValueError(
            f"grouped_dense supports only contracting_dims=((1,), (1,)) (x [M, K] with kernel "
            f"[G, K, N]), as TransformerEngine does; got {contracting_dims!r}"
        )
    if x.shape[1] != kernel.shape[1]:
        raise ValueError(
            f"kernel has {kernel.shape[1]} input features (kernel.shape[1]) but x has "
            f"{x.shape[1]} (x.shape[1]); the kernel must be [G, K, N] with K = x.shape[1]"
        )
    if bias is not None:
        check.check_floating(bias, "bias")
        n_groups, features = kernel.shape[0], kernel.shape[2]
        check.check_shape(
            bias, (n_groups, features), "bias", "one bias per group: [G, N] like the kernel's"
        )


def _lowering(lowering: object, capacity: object) -> str:
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    if capacity is not None:
        check.check_positive_int(capacity, "capacity", "the rows per group, or None")
    if lowering == "auto":
        return "capacity" if capacity is not None else "ragged"
    return str(lowering)


def grouped_dense(
    x: Array,
    kernel: Array,
    group_sizes: Array,
    contracting_dims: tuple[Sequence[int], Sequence[int]] = ((1,), (1,)),
    bias: Array | None = None,
    precision: lax.Precision | None = lax.Precision.DEFAULT,
    preferred_element_type: Any = None,
    group_offset: Array | None = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    kernel_fsdp_info: tuple[str | None, int] | None = (None, -1),
    *,
    lowering: str = "auto",
    capacity: int | None = None,
) -> Array:
    """A grouped GEMM: the rows of each group of ``x`` times that group's kernel, plus its bias.

    ``out[m] = x[m] . kernel[g] + bias[g]`` for the rows ``m`` of group ``g``: x's rows are
    sorted by group, the first ``group_sizes[0]`` rows in group 0, and so on (the experts of a
    mixture of experts after the tokens were permuted). With an FP8 ``quantizer_set`` each group
    is quantized with its own scale (x, kernel and the output gradient), so one expert's
    outlier does not cost the others precision; delayed-scaling state then holds one scale per
    group (``QuantizerFactory.create_set(..., n_groups=G)``: ``scale_inv [G, 1]``,
    ``amax_history [G, L]``), and its new value comes back as the gradient of ``quantizer_set``
    as for ``dense``. Block-scaled recipes (MXFP8, NVFP4) scale blocks along each contraction;
    on the ragged lowering a block of wgrad's rows may span two groups.

    Args:
      x: ``[M, K]``, rows sorted by group.
      kernel: ``[G, K, N]``.
      group_sizes: int32 ``[G]``, the rows of each group; they sum to at most ``M`` (the rows
        past the sum belong to no group: their output is zero).
      contracting_dims: ``((1,), (1,))`` (default, the only one supported, as in TE).
      bias: ``[G, N]`` or None (default).
      precision: ``lax.Precision`` of the ragged lowering's GEMMs without FP8 (default
        ``Precision.DEFAULT``, TE's; None is the same; the capacity lowering runs ``dense``'s);
        FP8 GEMMs take the quantizer set's ``precision``.
      preferred_element_type: the output dtype (default None: x's dtype).
      group_offset: not supported (None), as in TransformerEngine.
      quantizer_set: the GEMMs' quantizers (default ``noop_quantizer_set``: no FP8).
      kernel_fsdp_info: ``(None, -1)`` (default, TE's) or None: no gather inside the op; shard
        the kernel with sharding constraints instead.
      lowering: ``"ragged"``: x as it is (exact, no padding), on te_flax's grouped GEMM
        kernels on a GPU (per-expert scales in their epilogue) and ``lax.ragged_dot_general``
        elsewhere (on a GPU where a kernel cannot take the operands, with a
        ``RaggedOnGpuWarning``: XLA expands it over every group); ``"capacity"``: each group's
        rows padded to ``capacity`` and one batched GEMM over groups; ``"auto"`` (default):
        ``"capacity"`` when a capacity is given, else ``"ragged"``. See docs/moe.md for which
        is faster where.
      capacity: rows per group of the capacity lowering (default None: ``M``, which never drops
        a row). A group with more rows keeps its first ``capacity``; the others get zero output
        and no gradient (token dropping).

    Returns:
      ``[M, N]`` in ``preferred_element_type`` (x's dtype by default).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.dense import grouped_dense
      >>> x, kernel = jnp.ones((5, 4)), jnp.stack([jnp.ones((4, 2)), 2 * jnp.ones((4, 2))])
      >>> grouped_dense(x, kernel, jnp.array([2, 3], jnp.int32))[:, 0]
      Array([4., 4., 8., 8., 8.], dtype=float32)
    """
    return _grouped_dense(
        x, kernel, group_sizes, contracting_dims, bias, precision, preferred_element_type,
        group_offset, quantizer_set, kernel_fsdp_info, lowering, capacity,
    )  # fmt: skip


def _grouped_dense(
    x: Array, kernel: Array, group_sizes: Array, contracting_dims: Any, bias: Array | None,
    precision: Any, preferred_element_type: Any, group_offset: Array | None,
    quantizer_set: QuantizerSet, kernel_fsdp_info: Any, lowering: str, capacity: int | None,
    activation: tuple[str, ...] | None = None,
) -> Array:  # fmt: skip
    """``grouped_dense``'s checks and lowerings; ``activation``: a gated activation the ragged
    op applies to its output (``grouped_dense_activated``)."""
    _check_grouped_shapes(x, kernel, contracting_dims, bias)
    n_groups = kernel.shape[0]
    group_sizes = _check_group_sizes(group_sizes, n_groups, x.shape[0])
    if group_offset is not None:
        raise NotImplementedError(
            "group_offset is not supported by grouped_dense (TransformerEngine does not "
            "implement it either); pass None and give x only the rows of the local groups"
        )
    if kernel_fsdp_info is not None and kernel_fsdp_info != (None, -1):
        raise NotImplementedError(
            f"kernel_fsdp_info={kernel_fsdp_info!r}: grouped_dense does not gather an "
            "FSDP-sharded kernel itself (TransformerEngine does not either); pass None and "
            "shard the kernel with logical axes, which XLA gathers"
        )
    if precision is not None and not isinstance(precision, lax.Precision):
        raise TypeError(f"precision must be a jax.lax.Precision or None, got {precision!r}")
    out_dtype = x.dtype if preferred_element_type is None else preferred_element_type
    out_dtype = check.check_dtype(out_dtype, "preferred_element_type")
    quantizer_set = check_quantizer_set(ungrouped_quantizer_set(quantizer_set))
    _grouped.check_grouped_set(quantizer_set, n_groups)
    path = _lowering(lowering, capacity)
    kernel, bias = vary_like(x, (kernel, bias))
    quantizer_set = float32_state(quantizer_set)
    config = _grouped.GroupedConfig(
        n_groups=n_groups,
        x_dtype=x.dtype,
        out_dtype=out_dtype,
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        precision=precision,
        distinct_axes=scaling.distinct_axes(),
        activation=activation,
    )
    if path == "ragged":
        operands = _grouped.GroupedOperands(x, kernel, group_sizes, bias, quantizer_set)
        return cast(Array, _grouped.ragged_grouped_dense(config, operands))
    rows = x.shape[0]
    capacity = rows if capacity is None else int(capacity)
    packed = _grouped.pack_rows(x, group_sizes, capacity)  # [G, C, K]
    if _grouped.capacity_on_kernels(x, kernel, capacity, quantizer_set):
        # The packed rows as groups of C rows on the grouped GEMM kernels (a GPU).
        full = jnp.full((n_groups,), capacity, jnp.int32)
        flat = packed.reshape(n_groups * capacity, x.shape[1])
        operands = _grouped.GroupedOperands(flat, kernel, full, bias, quantizer_set)
        out = _grouped.ragged_grouped_dense(config, operands)
        return _grouped.unpack_rows(out.reshape(n_groups, capacity, -1), group_sizes, rows)
    # Capacity: dense's own op under vmap over groups, so each GEMM becomes one batched GEMM
    # and each per-tensor quantizer one scale per group.
    dense_config = _Config(
        n_contract=1,
        input_axes=None,
        kernel_axes=None,
        output_axes=None,
        kernel_dtype=kernel.dtype,
        bias_dtype=None if bias is None else bias.dtype,
    )
    state_axes = jax.tree.map(lambda _: 0, quantizer_set)
    per_group = jax.vmap(
        partial(_dense.with_statistics, dense_config),
        in_axes=(_Operands(0, 0, 0, state_axes),),  # type: ignore[arg-type]
    )
    out, statistics = per_group(_Operands(packed, kernel, bias, quantizer_set))  # [G, C, N]
    inspection.deliver((quantizer_set,), statistics)  # te_flax.inspect_fp8(): [G] per group
    return _grouped.unpack_rows(out, group_sizes, rows).astype(out_dtype)


def grouped_dense_activated(
    x: Array,
    kernel: Array,
    group_sizes: Array,
    activation_type: tuple[str, ...],
    activation_params: Any = None,
    *,
    bias: Array | None = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    lowering: str = "auto",
    capacity: int | None = None,
) -> Array:
    """``activation(grouped_dense(x, kernel, ...))``: ``MoEBlock``'s first expert GEMM and its
    gated activation, ``[M, K] x [G, K, n_act * F] -> [M, F]`` (the slices side by side in the
    kernel's features, ``activation_type`` canonical).

    The activation is computed in float32 and rounded once, and its backward reads the
    pre-activation alone (``activations.rounded_once_activation``). Where a GPU runs the
    backward on te_flax's kernels (dropless, per-tensor delayed scaling, no bias, 16-bit rows
    and an ``F`` that are multiples of 64, jax 0.11 on), the activation is inside the grouped
    GEMM's op, whose backward quantizes the activation's gradient group by group in one pass
    (``_ops/grouped_activation.py``); elsewhere the two run apart, with the same results.
    """
    n_act = len(activation_type)
    dgrad = ungrouped_quantizer_set(quantizer_set).dgrad
    features = kernel.shape[-1] if kernel.ndim == 3 else 0
    if (
        bias is None
        and _lowering(lowering, capacity) == "ragged"
        and fuses(x, features, activation_type, activation_params, dgrad)
    ):
        return _grouped_dense(
            x, kernel, group_sizes, ((1,), (1,)), None, lax.Precision.DEFAULT, None, None,
            quantizer_set, (None, -1), "ragged", None, activation_type,
        )  # fmt: skip
    pre_activation = grouped_dense(
        x,
        kernel,
        group_sizes,
        bias=bias,
        quantizer_set=quantizer_set,
        lowering=lowering,
        capacity=capacity,
    )
    pre_activation = pre_activation.reshape(x.shape[0], n_act, -1)
    return rounded_once_activation(pre_activation, activation_type, activation_params)
