"""The activation stage of ``MoEBlock``'s first expert GEMM: a gated activation applied to the
grouped GEMM's output, and in the backward its gradient quantized group by group.

On a GPU with te_flax's kernels, ``grouped_dense_activated`` (``te_flax.dense``) runs the ragged
grouped GEMM with this stage inside the op, so its backward reads the pre-activation and the
incoming gradient once and writes the float8 gradient and each group's amax
(``kernels/activation_grad_rows_mosaic.py``): XLA would write the activation's gradient in
high precision and read it back for the quantization (docs/moe.md). The XLA stage below is that
kernel's arithmetic, and the path every other program keeps (the op and the activation apart).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.activations import activation_backward, activation_forward
from te_flax._ops.kernels.activation_grad import KERNEL_ACTIVATIONS
from te_flax._ops.kernels.activation_grad_rows_mosaic import activation_grad_rows
from te_flax._ops.kernels.first_use import Probe, random_operand
from te_flax._ops.kernels.mosaic import tileable
from te_flax._ops.kernels.partition import mesh_partitioned
from te_flax._ops.kernels.switch import dispatch, takes_kernel
from te_flax.quantize import DelayedScaleQuantizer, scaling

__all__ = ["activated", "activation_grad_by_xla", "activation_grad_quantized", "fuses"]

_NAME = "activation_grad_rows"


def activated(pre: Array, activation_type: tuple[str, ...]) -> Array:
    """``[M, n_act * F]`` -> ``[M, F]``: the activation of the slices side by side, computed in
    float32 and rounded once (``activations.rounded_once_activation``'s forward)."""
    slices = pre.reshape(pre.shape[0], len(activation_type), -1).astype(jnp.float32)
    return activation_forward(slices, activation_type).astype(pre.dtype)


def fuses(
    x: Any, features: int, activation_type: tuple[str, ...], params: Any, quantizer: Any
) -> bool:
    """Whether the ragged grouped GEMM of ``x [M, K]`` into ``features`` (``n_act * F``)
    columns takes the activation into its op: where this program's backward runs the kernel
    (a GPU's, or every platform's under ``pallas_kernels("1")``). Per-tensor delayed scaling
    with its scale ahead of the step, a kernel activation without parameters, 16-bit rows
    whose count and ``F`` are multiples of 64, and Mosaic GPU (jax 0.11 on); not in a program
    Shardy partitions over a mesh (the kernel has no partitioning rule; inside ``shard_map``
    it works on each device's rows)."""
    n_act = len(activation_type)
    supported = (
        mosaic_gpu_interpreted()
        and params is None
        and set(activation_type) <= KERNEL_ACTIVATIONS
        and isinstance(quantizer, DelayedScaleQuantizer)
        and not quantizer.just_in_time
        and jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and features % n_act == 0
        and tileable(x.shape[0], features // n_act)
        and not mesh_partitioned()
    )
    return takes_kernel(_NAME, x, supported=supported)


def activation_grad_by_xla(
    pre: Array,
    grad: Array,
    group_sizes: Array,
    scale_inv: Array,
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike,
) -> tuple[Array, Array]:
    """The kernel's results by XLA: the activation's gradient quantized with each row's group
    scale (1 past the groups) and each group's amax (``grouped.quantize_rows``'s arithmetic)."""
    rows, n_groups = grad.shape[0], group_sizes.shape[0]
    slices = pre.reshape(rows, len(activation_type), -1)
    d = activation_backward(grad, slices, activation_type).reshape(rows, -1)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    ids = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")
    row_amax = jnp.max(jnp.abs(d), axis=1).astype(jnp.float32)
    amax = jnp.maximum(jax.ops.segment_max(row_amax, ids, num_segments=n_groups), 0.0)
    row_scale_inv = jnp.take(scale_inv, ids, mode="fill", fill_value=1.0)
    return scaling.quantize(d, q_dtype, row_scale_inv[:, None]), amax


def activation_grad_quantized(
    operands: tuple[Array, Array, Array, Array],
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike,
) -> tuple[Array, Array]:
    """From ``operands``, the pre-activation ``[M, n_act * F]``, the gradient of the
    activation's output ``[M, F]``, the group sizes ``[G]`` and the groups' ``scale_inv [G]``:
    the pre-activation's float8 gradient, each group's rows quantized with its scale, and each
    group's amax; by the kernel where the switch takes it (checked on its first use on a GPU),
    else by XLA."""

    def kernel(
        pre: Array, grad: Array, sizes: Array, scale_inv: Array, *, interpret: bool
    ) -> tuple[Array, Array]:
        return activation_grad_rows(
            pre, grad, sizes, scale_inv, activation_type, q_dtype, interpret=interpret
        )

    def xla(pre: Array, grad: Array, sizes: Array, scale_inv: Array) -> tuple[Array, Array]:
        return activation_grad_by_xla(pre, grad, sizes, scale_inv, activation_type, q_dtype)

    probe = _probe(kernel, xla, operands[0].dtype, activation_type, q_dtype)
    return dispatch(_NAME, kernel, xla, *operands, probe=probe)


def _probe(
    kernel: Any, xla: Any, dtype: DTypeLike, activation_type: tuple[str, ...], q_dtype: DTypeLike
) -> Probe:
    """The kernel's check on 192 rows in three groups (one empty, a tile shared by two, rows
    past the groups), 128 columns per slice, scales that make some values saturate."""
    n_act = len(activation_type)

    def operands() -> tuple[Any, ...]:
        pre = random_operand(0, (192, n_act * 128), dtype)
        grad = random_operand(1, (192, 128), dtype, 100.0)
        sizes = np.array([70, 0, 100], np.int32)
        return pre, grad, sizes, np.array([2.0**-7, 1.0, 2.0**-5], np.float32)

    names = " -> ".join(jnp.dtype(t).name for t in (dtype, q_dtype))
    return Probe(f"{'-'.join(activation_type)} {names}", operands, kernel, xla)
