"""The stages' entry points: the kernels wrapped into GEMM operands and quantizer updates.

The scale and state logic is the quantizers' own (``scale_inv``, ``update``,
``compute_scale_inv``); only the passes over the tensor move into the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, TypeVar

import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from te_flax._ops.kernels import probes
from te_flax._ops.kernels.activation_grad import KERNEL_ACTIVATIONS, activation_grad_tiles
from te_flax._ops.kernels.activation_grad_mosaic import (
    activation_grad_tiles as activation_grad_tiles_mosaic,
)
from te_flax._ops.kernels.activation_quantize import activation_quantize_tiles
from te_flax._ops.kernels.activation_quantize_mosaic import (
    activation_quantize_tiles as activation_quantize_tiles_mosaic,
)
from te_flax._ops.kernels.common import RowBlocks, row_blocks
from te_flax._ops.kernels.norm_backward import norm_backward
from te_flax._ops.kernels.norm_backward_mosaic import norm_backward as norm_backward_mosaic
from te_flax._ops.kernels.norm_quantize import norm_quantize
from te_flax._ops.kernels.partition import Reduction, mesh_partitioned, per_shard
from te_flax._ops.kernels.quantize import quantize_tiles
from te_flax._ops.kernels.quantize_mosaic import quantize_tiles as quantize_tiles_mosaic
from te_flax._ops.kernels.switch import MOSAIC, dispatch
from te_flax.quantize import scaling
from te_flax.quantize.quantizer import (
    LEADING,
    TRAILING,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    GemmOperand,
    Quantizer,
    ScaledTensor,
)

__all__ = [
    "GradOperand",
    "activation_grad_operand",
    "activation_quantize_operand",
    "norm_backward_grads",
    "norm_quantize_operand",
    "tiled_quantize_operand",
]

_Quantized = tuple[GemmOperand, Quantizer | None]


def _per_tensor(quantizer: Quantizer | None) -> bool:
    return isinstance(quantizer, DelayedScaleQuantizer | CurrentScaleQuantizer)


R = TypeVar("R")


def _row_blocks(rows: int, hidden: int) -> RowBlocks:
    """The row blocks of a device's block (it fits: the whole tensor's rows did)."""
    blocks = row_blocks(rows, hidden)
    assert blocks is not None
    return blocks


def _scaled_passes(
    quantizer: Quantizer, run: Callable[[Array, DTypeLike | None], tuple[R, Array]]
) -> tuple[R, Array, Quantizer]:
    """Runs a quantizing kernel as a per-tensor quantizer's scaling needs.

    ``run(scale_inv, q_dtype)`` quantizes with the f32 ``[1]`` ``scale_inv`` (computes the
    amax alone when ``q_dtype`` is None) and returns its outputs and the tile maxima. Delayed
    scaling takes one pass with the stored scale and records the amax; current scaling (and
    delayed scaling ``just_in_time``) needs the amax before it can quantize, so a first pass
    computes it. Returns the last pass's outputs, the scale they used (a scalar) and the
    quantizer after this step.
    """
    q_dtype = quantizer.q_dtype
    if isinstance(quantizer, DelayedScaleQuantizer) and not quantizer.just_in_time:
        outputs, partials = run(quantizer.scale_inv, q_dtype)
        return outputs, quantizer.scale_inv.reshape(()), quantizer.update(scaling.amax(partials))
    assert isinstance(quantizer, DelayedScaleQuantizer | CurrentScaleQuantizer), (
        "only per-tensor quantizers run kernels"
    )
    _, partials = run(jnp.ones((1,), jnp.float32), None)
    scale_inv, new_quantizer = quantizer.scale_and_update(scaling.amax(partials))
    outputs, _ = run(scale_inv.reshape(1), q_dtype)
    return outputs, scale_inv, new_quantizer


def norm_quantize_operand(
    x: Array,
    mean: Array | None,
    rsigma: Array,
    gamma: Array,
    beta: Array | None,
    quantizer: Quantizer | None,
    fallback: Callable[[], _Quantized],
) -> _Quantized:
    """``quantize(norm(x))`` as the stage ``norm_operand`` makes it, by kernel (1) or ``fallback``.

    Args:
      x: ``[batch..., hidden]``.
      mean: f32 ``[batch..., 1]`` or None (rmsnorm); rsigma: f32 ``[batch..., 1]``.
      gamma: f32 ``[hidden]``, the effective scale; beta: f32 ``[hidden]`` or None.
      quantizer: the operand's quantizer; only per-tensor FP8 quantizers use the kernel.
      fallback: the XLA stage, called without arguments.
    """
    hidden = x.shape[-1] if x.ndim else 0
    rows = math.prod(x.shape[:-1])
    blocks = row_blocks(rows, hidden) if _per_tensor(quantizer) and x.ndim else None

    def kernel(
        x: Array,
        mean: Array | None,
        rsigma: Array,
        gamma: Array,
        beta: Array | None,
        quantizer: Quantizer | None,
        *,
        interpret: bool,
    ) -> _Quantized:
        assert quantizer is not None
        batch = tuple(f"b{d}" for d in range(x.ndim - 1))  # the rows' factors
        stats = (*batch, "one")  # [batch..., 1]

        def run(scale_inv: Array, q_dtype: DTypeLike | None) -> tuple[Array | None, Array]:
            def local(
                x: Array, mean: Array | None, rsigma: Array, gamma: Array, beta: Array | None,
                scale_inv: Array,
            ) -> list[Array]:  # fmt: skip
                rows, hidden = math.prod(x.shape[:-1]), x.shape[-1]
                data, partials = norm_quantize(
                    x.reshape(rows, hidden), None if mean is None else mean.reshape(rows),
                    rsigma.reshape(rows), gamma, beta, scale_inv, q_dtype,
                    _row_blocks(rows, hidden), interpret=interpret,
                )  # fmt: skip
                amax = jnp.max(partials)  # of this block
                return [amax] if data is None else [data.reshape(x.shape), amax]

            results = ([] if q_dtype is None else [(*batch, "h")]) + [()]
            outputs = per_shard(
                local,
                (x, mean, rsigma, gamma, beta, scale_inv),
                ((*batch, "h"), stats, stats, ("h",), ("h",), None),
                results,
                [None] * (len(results) - 1) + ["max"],
                replicated=("h", "one"),  # the rows whole, as the norm statistics
            )
            return (outputs[0] if q_dtype is not None else None), outputs[-1]

        data, scale_inv, new_quantizer = _scaled_passes(quantizer, run)
        assert data is not None
        return ScaledTensor(data, scale_inv), new_quantizer

    def xla(*_: object) -> _Quantized:
        return fallback()

    return dispatch(
        "norm_quantize",
        kernel,
        xla,
        x,
        mean,
        rsigma,
        gamma,
        beta,
        quantizer,
        supported=blocks is not None,
    )


def _operand(
    data: Array | None, transposed: Array | None, scale_inv: Array, split: int
) -> ScaledTensor:
    """A quantizing kernel's layouts as an operand split after ``split`` axes: with the
    transposed layout alone, ``data`` is its transpose (which XLA drops unless read)."""
    if data is None:
        assert transposed is not None
        n_trailing = transposed.ndim - split
        data = jnp.transpose(transposed, (*range(n_trailing, transposed.ndim), *range(n_trailing)))
    return ScaledTensor(data, scale_inv, transposed)


def _with_transposed(split: int, wanted: bool) -> Callable[[_Quantized], _Quantized]:
    """An XLA stage's operand given the kernel's structure: the ``transposed`` layout (split
    after ``split`` axes) where the kernel writes one."""

    def with_transposed(result: _Quantized) -> _Quantized:
        operand, new_quantizer = result
        assert isinstance(operand, ScaledTensor)
        if not wanted:
            return result
        order = (*range(split, operand.data.ndim), *range(split))
        return operand._replace(transposed=jnp.transpose(operand.data, order)), new_quantizer

    return with_transposed


# The tiles of a kernel that writes a tensor's float8 layouts: (the tensor's block, its
# scale_inv, the float8 dtype or None for the amax alone, the layouts asked for, interpret) ->
# (data in the tensor's layout or None, the transposed layout or None, the amax partials).
_Tiles = Callable[
    [Array, Array, DTypeLike | None, tuple[bool, bool], bool],
    tuple[Array | None, Array | None, Array],
]


def _layouts_by_kernel(
    name: str,
    tensor: Array,
    quantizer: Quantizer | None,
    supported: bool,
    uses: tuple[str, ...],
    split: int,
    dims: tuple[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]],
    tiles: _Tiles,
    fallback: Callable[[], _Quantized],
    probe: Callable[[tuple[bool, bool]], probes.Probe | None],
    replicated: tuple[str, ...] = (),
) -> _Quantized:
    """A per-tensor float8 operand with ``split`` leading (token) axes, written in the layouts
    of ``uses`` by the kernel ``name`` running ``tiles`` on each device's block, or
    ``fallback`` (the XLA stage, called without arguments); ``probe(layouts)`` checks the
    kernel on its first use.

    ``dims``: the tensor's axis names, and those of the two layouts (``TRAILING``: the
    operand's ``data``; ``LEADING``: its ``transposed``), for ``per_shard``.
    """
    tensor_dims, layout_dims = dims
    layouts = (TRAILING in uses, LEADING in uses)
    # In a partitioned program the kernel writes the data alone and the GEMMs read it as the
    # XLA stage's, in the layout they need: a sharded tensor (an FSDP kernel) is then gathered
    # once in float8, not once per layout.
    one_layout = mesh_partitioned()

    def kernel(tensor: Array, quantizer: Quantizer | None, *, interpret: bool) -> _Quantized:
        assert quantizer is not None
        written = (True, False) if one_layout else layouts

        def run(
            scale_inv: Array, q_dtype: DTypeLike | None
        ) -> tuple[tuple[Array | None, Array | None], Array]:
            asked = written if q_dtype is not None else (False, False)

            def local(block: Array, scale_inv: Array) -> list[Array]:
                data, transposed, partials = tiles(block, scale_inv, q_dtype, asked, interpret)
                outputs = [layout for layout in (data, transposed) if layout is not None]
                return [*outputs, jnp.max(partials)]  # the block's amax last

            outputs = list(
                per_shard(
                    local,
                    (tensor, scale_inv),
                    (tensor_dims, None),
                    [d for d, on in zip(layout_dims, asked, strict=True) if on] + [()],
                    [None] * sum(asked) + ["max"],
                    replicated=replicated,
                )
            )
            results = [outputs.pop(0) if on else None for on in asked]
            return (results[0], results[1]), outputs[0]

        layouts_written, scale_inv, new_quantizer = _scaled_passes(quantizer, run)
        return _operand(*layouts_written, scale_inv, split), new_quantizer

    def xla(*_: object) -> _Quantized:
        return fallback()

    with_transposed = _with_transposed(split, layouts[1] and not one_layout)
    return dispatch(
        name, kernel, xla, tensor, quantizer, supported=supported, as_kernel_result=with_transposed,
        probe=probe((True, False) if one_layout else layouts),
    )  # fmt: skip


def tiled_quantize_operand(
    x: Array,
    quantizer: Quantizer | None,
    split: int,
    uses: tuple[str, ...],
    fallback: Callable[[], _Quantized],
) -> _Quantized:
    """``quantize_operand(x, quantizer, ..., split, uses)`` by kernel (2), or ``fallback``.

    The kernel takes ``x`` as the matrix ``[leading, trailing]`` (``split`` leading axes) and
    writes the layout of each use: ``TRAILING`` as the operand's ``data``, ``LEADING`` as its
    ``transposed`` (``[trailing..., leading...]``). With ``LEADING`` alone, ``data`` is the
    transpose of that result, which XLA drops unless something reads it.

    Args:
      x: the tensor, in its own dtype.
      quantizer: the tensor's quantizer; only per-tensor FP8 quantizers use the kernel.
      split: the number of leading axes.
      uses: the contractions to prepare (``TRAILING``, ``LEADING``).
      fallback: the XLA stage, called without arguments.
    """
    rows, columns = math.prod(x.shape[:split]), math.prod(x.shape[split:])
    supported = _per_tensor(quantizer) and 0 < split < x.ndim and rows * columns > 0
    # The Mosaic GPU version where this JAX has it (it quantizes what it does not tile by XLA).
    quantize = quantize_tiles_mosaic if "quantize" in MOSAIC else quantize_tiles
    dims = tuple(f"d{d}" for d in range(x.ndim))
    layout_dims = (dims, dims[split:] + dims[:split])  # [leading, trailing], transposed

    def tiles(
        x: Array, scale_inv: Array, q_dtype: DTypeLike | None, asked: tuple[bool, bool],
        interpret: bool,
    ) -> tuple[Array | None, Array | None, Array]:  # fmt: skip
        leading, trailing = x.shape[:split], x.shape[split:]
        matrix = x.reshape(math.prod(leading), math.prod(trailing))
        data, transposed, partials = quantize(
            matrix, scale_inv, q_dtype, asked, interpret=interpret
        )
        return (
            None if data is None else data.reshape(x.shape),
            None if transposed is None else transposed.reshape(trailing + leading),
            partials,
        )

    probe = partial(probes.quantize_probe, quantize, x.dtype, quantizer)
    return _layouts_by_kernel(
        "quantize", x, quantizer, supported, uses, split, (dims, layout_dims), tiles, fallback,
        probe,
    )  # fmt: skip


def activation_quantize_operand(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    quantizer: Quantizer | None,
    uses: tuple[str, ...],
    fallback: Callable[[], _Quantized],
) -> _Quantized:
    """``quantize_operand(activation_forward(pre_activation), quantizer, ...)`` by kernel (2),
    or ``fallback`` (the XLA stage).

    The activation ``[batch..., intermediate]`` is contracted along its features by the second
    GEMM (``TRAILING``: the operand's ``data``) and along its tokens by that GEMM's weight
    gradient (``LEADING``: its ``transposed``, ``[intermediate, batch...]``). The kernel reads
    the pre-activation once and writes the float8 layouts asked for and the amax.

    Args:
      pre_activation: ``[batch..., n_act, intermediate]``.
      activation_type: the canonical activation names.
      quantizer: the activation's quantizer; only per-tensor FP8 quantizers use the kernel.
      uses: the contractions to prepare (``TRAILING``, ``LEADING``).
      fallback: the XLA stage, called without arguments.
    """
    n_act = len(activation_type)
    shape = pre_activation.shape
    supported = (
        _per_tensor(quantizer)
        and set(activation_type) <= KERNEL_ACTIVATIONS
        and pre_activation.ndim > 2
        and shape[-2] == n_act
        and math.prod(shape) > 0
    )
    n_batch = pre_activation.ndim - 2
    batch = tuple(f"b{d}" for d in range(n_batch))
    dims = ((*batch, "act", "i"), ((*batch, "i"), ("i", *batch)))
    mosaic = "activation_quantize" in MOSAIC
    quantize = activation_quantize_tiles_mosaic if mosaic else activation_quantize_tiles

    def tiles(
        pre_activation: Array, scale_inv: Array, q_dtype: DTypeLike | None,
        asked: tuple[bool, bool], interpret: bool,
    ) -> tuple[Array | None, Array | None, Array]:  # fmt: skip
        tokens, intermediate = pre_activation.shape[:-2], pre_activation.shape[-1]
        data, transposed, partials = quantize(
            pre_activation.reshape(math.prod(tokens), -1), scale_inv, activation_type,
            q_dtype, asked, interpret=interpret,
        )  # fmt: skip
        return (
            None if data is None else data.reshape(*tokens, intermediate),
            None if transposed is None else transposed.reshape(intermediate, *tokens),
            partials,
        )

    probe = partial(probes.activation_quantize_probe, quantize, pre_activation.dtype)
    return _layouts_by_kernel(
        "activation_quantize", pre_activation, quantizer, supported, uses, n_batch, dims,
        tiles, fallback, partial(probe, activation_type, quantizer), replicated=("act",),
    )  # fmt: skip


# The activation-gradient kernel's float8 data, its transposed layout and the column sums.
_TileResults = tuple[Array | None, Array | None, Array | None]


class GradOperand(NamedTuple):
    """An output gradient prepared for both backward GEMMs: quantized once for dgrad and wgrad
    (or cast), with its quantizer after this step and the bias gradient (None without a bias).
    """

    operand: GemmOperand
    quantizer: Quantizer | None
    bias: Array | None


def activation_grad_operand(
    grad: Array,
    pre_activation: Array,
    activation_type: tuple[str, ...],
    quantizer: Quantizer | None,
    bias_dtype: DTypeLike | None,
    fallback: Callable[[], Array],
    prepare: Callable[[Array], GradOperand],
) -> Array | GradOperand:
    """The gradient of the pre-activation, by kernel (2) as a ``GradOperand``, or ``fallback``.

    ``fallback`` (the XLA stage) returns the gradient in high precision, which the GEMM stage
    quantizes as any output gradient (``prepare``). The kernel returns it prepared: quantized
    with ``quantizer`` in both layouts (``transposed`` is ``[n_act, intermediate, batch...]``),
    with the new quantizer and the bias gradient in ``bias_dtype``.

    Args:
      grad: ``[batch..., intermediate]``, the gradient of the activation's output.
      pre_activation: ``[batch..., n_act, intermediate]``.
      activation_type: the canonical activation names.
      quantizer: the gradient's quantizer; only per-tensor FP8 quantizers use the kernel.
      bias_dtype: the bias gradient's dtype, or None without a bias.
      fallback: the XLA stage, called without arguments.
      prepare: the GEMM stage's preparation of a high-precision gradient.
    """
    n_act, intermediate = len(activation_type), grad.shape[-1] if grad.ndim else 0
    rows = math.prod(grad.shape[:-1])
    supported = (
        _per_tensor(quantizer)
        and set(activation_type) <= KERNEL_ACTIVATIONS
        and grad.ndim > 1
        and rows * intermediate > 0
        and pre_activation.shape == (*grad.shape[:-1], n_act, intermediate)
    )
    with_bias = bias_dtype is not None
    mosaic = "activation_grad" in MOSAIC
    grad_tiles = activation_grad_tiles_mosaic if mosaic else activation_grad_tiles

    def kernel(
        grad: Array, pre_activation: Array, quantizer: Quantizer | None, *, interpret: bool
    ) -> Array | GradOperand:
        assert quantizer is not None
        batch = tuple(f"b{d}" for d in range(grad.ndim - 1))
        pre_dims = (*batch, "act", "i")  # [batch..., n_act, intermediate]

        def run(scale_inv: Array, q_dtype: DTypeLike | None) -> tuple[_TileResults, Array]:
            sums_asked = with_bias and q_dtype is not None

            def local(pre_activation: Array, grad: Array, scale_inv: Array) -> list[Array]:
                rows = math.prod(grad.shape[:-1])
                data, transposed, partials, sums = grad_tiles(
                    pre_activation.reshape(rows, -1), grad.reshape(rows, -1), scale_inv,
                    activation_type, q_dtype, sums_asked, interpret=interpret,
                )  # fmt: skip
                outputs = [jnp.max(partials)]  # the block's amax
                if data is not None and transposed is not None:
                    quantized_shape = pre_activation.shape[-2:] + pre_activation.shape[:-2]
                    outputs = [data.reshape(pre_activation.shape)]
                    outputs += [transposed.reshape(quantized_shape), jnp.max(partials)]
                if sums is not None:  # the block's column sums, [n_act, intermediate]
                    outputs.append(jnp.sum(sums, axis=0).reshape(pre_activation.shape[-2:]))
                return outputs

            quantized = [] if q_dtype is None else [pre_dims, pre_dims[-2:] + pre_dims[:-2]]
            results = [*quantized, ()] + ([pre_dims[-2:]] if sums_asked else [])
            reductions: list[Reduction] = [None] * len(quantized)
            reductions.append("max")
            if sums_asked:
                reductions.append("sum")
            outputs = list(
                per_shard(
                    local,
                    (pre_activation, grad, scale_inv),
                    (pre_dims, (*batch, "i"), None),
                    results,
                    reductions,
                    replicated=("act",),
                )
            )
            data, transposed = (outputs.pop(0), outputs.pop(0)) if quantized else (None, None)
            amax = outputs.pop(0)
            return (data, transposed, outputs[0] if sums_asked else None), amax

        (data, transposed, sums), scale_inv, new_quantizer = _scaled_passes(quantizer, run)
        assert data is not None and transposed is not None
        operand = ScaledTensor(data, scale_inv, transposed)
        bias = None if sums is None else sums.astype(bias_dtype)
        return GradOperand(operand, new_quantizer, bias)

    def xla(*_: object) -> Array | GradOperand:
        return fallback()

    def as_kernel_result(d_pre_activation: Array | GradOperand) -> Array | GradOperand:
        assert not isinstance(d_pre_activation, GradOperand)
        prepared = prepare(d_pre_activation)
        operand = prepared.operand
        assert isinstance(operand, ScaledTensor)
        n_batch = d_pre_activation.ndim - 2
        order = (*range(n_batch, d_pre_activation.ndim), *range(n_batch))
        transposed = jnp.transpose(operand.data, order)
        return prepared._replace(operand=operand._replace(transposed=transposed))

    dtypes = (pre_activation.dtype, grad.dtype)
    probe = probes.activation_grad_probe(grad_tiles, dtypes, activation_type, quantizer, with_bias)
    return dispatch(
        "activation_grad", kernel, xla, grad, pre_activation, quantizer, supported=supported,
        as_kernel_result=as_kernel_result, probe=probe,
    )  # fmt: skip


_NormGrads = tuple[Array, Array, Array | None]


def norm_backward_grads(
    d_out: Array,
    x: Array,
    mean: Array | None,
    rsigma: Array,
    gamma: Array,
    gamma_dtype: DTypeLike,
    beta_dtype: DTypeLike | None,
    fallback: Callable[[], _NormGrads],
    d_out_scale: Array | None = None,
) -> _NormGrads:
    """``(dx, dgamma, dbeta)`` of the norm, by kernel (3) or ``fallback`` (the XLA stage).

    Args:
      d_out: ``[batch..., hidden]``, the gradient of the norm output.
      x: ``[batch..., hidden]``; mean: f32 ``[batch..., 1]`` or None; rsigma: f32
        ``[batch..., 1]``.
      gamma: f32 ``[hidden]``, the effective scale.
      gamma_dtype: the dtype of ``dgamma``; beta_dtype: of ``dbeta``, None without beta.
      fallback: the XLA stage, called without arguments.
      d_out_scale: f32, a scale ``d_out`` still needs, or None. The gradients are linear in
        ``d_out``: the kernel takes it with ``gamma`` (dx) and on its float32 partial sums.
    """
    hidden = x.shape[-1] if x.ndim else 0
    rows = math.prod(x.shape[:-1])
    blocks = row_blocks(rows, hidden) if x.ndim and d_out.shape == x.shape else None
    # The Mosaic GPU version where this JAX has it (it computes what it does not take by XLA).
    backward = norm_backward_mosaic if "norm_backward" in MOSAIC else norm_backward

    def kernel(*operands: Array | None, interpret: bool) -> _NormGrads:
        """``operands``: ``(d_out, x, mean, rsigma, gamma, scale)``, as ``local`` takes them."""
        assert blocks is not None
        with_beta = beta_dtype is not None

        def local(
            d_out: Array,
            x: Array,
            mean: Array | None,
            rsigma: Array,
            gamma: Array,
            scale: Array | None,
        ) -> list[Array]:
            rows, hidden = math.prod(x.shape[:-1]), x.shape[-1]
            if scale is not None:  # dx = rsigma (gamma d_out - ...): linear in gamma
                gamma = gamma * scale
            d_x, d_gamma, d_beta = backward(
                d_out.reshape(rows, hidden), x.reshape(rows, hidden),
                None if mean is None else mean.reshape(rows), rsigma.reshape(rows), gamma,
                with_beta, x.dtype, _row_blocks(rows, hidden), interpret=interpret,
            )  # fmt: skip
            # The block's sums of the per-program partial sums.
            sums = [jnp.sum(d_gamma, axis=0)]
            if d_beta is not None:
                sums.append(jnp.sum(d_beta, axis=0))
            if scale is not None:
                sums = [s * scale for s in sums]
            return [d_x.reshape(x.shape), *sums]

        dims = (*(f"b{d}" for d in range(x.ndim - 1)), "h")  # [batch..., hidden]
        stats = (*dims[:-1], "one")
        # The scale meets gamma on each device, so that a partitioned program gathers the
        # same gamma as the forward's norm kernel.
        outputs = per_shard(
            local,
            operands,
            (dims, dims, stats, stats, ("h",), None),
            [dims] + [("h",)] * (1 + with_beta),
            [None] + ["sum"] * (1 + with_beta),
            replicated=("h", "one"),  # each row's sums over the hidden axis
        )
        d_gamma = outputs[1].astype(gamma_dtype)
        d_beta = outputs[2].astype(beta_dtype) if with_beta else None
        return outputs[0], d_gamma, d_beta

    def xla(*_: object) -> _NormGrads:
        return fallback()

    operands = (d_out, x, mean, rsigma, gamma, d_out_scale)
    dtypes, with_beta = (d_out.dtype, x.dtype), beta_dtype is not None
    probe = probes.norm_backward_probe(backward, dtypes, hidden, mean is not None, with_beta)
    return dispatch("norm_backward", kernel, xla, *operands, supported=blocks is not None,
                    probe=probe)  # fmt: skip
