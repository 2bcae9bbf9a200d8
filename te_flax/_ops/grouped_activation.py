"""The activation stage of ``MoEBlock``'s first expert GEMM: a gated activation applied to the
grouped GEMM's output, and in the backward its gradient quantized group by group.

On a GPU with te_flax's kernels, ``grouped_dense_activated`` (``te_flax.dense``) runs the ragged
grouped GEMM with this stage inside the op, so its backward reads the pre-activation and the
incoming gradient once and writes the float8 gradient and each group's amax
(``kernels/activation_grad_rows_mosaic.py``): XLA would write the activation's gradient in
high precision and read it back for the quantization (docs/moe.md). Its XLA stage,
``grouped.activation_grad_by_xla``, is the arithmetic of the path every other program keeps
(the op and the activation apart).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.kernels.activation_grad import KERNEL_ACTIVATIONS
from te_flax._ops.kernels.activation_grad_rows_mosaic import activation_grad_rows
from te_flax._ops.kernels.first_use import Probe, random_operand
from te_flax._ops.kernels.mosaic import tileable
from te_flax._ops.kernels.partition import mesh_partitioned
from te_flax._ops.kernels.switch import dispatch, takes_kernel
from te_flax.quantize import DelayedScaleQuantizer

__all__ = ["activation_grad_quantized", "fuses"]

_NAME = "activation_grad_rows"


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


def activation_grad_quantized(
    operands: tuple[Array, Array, Array, Array],
    activation_type: tuple[str, ...],
    q_dtype: DTypeLike,
    by_xla: Callable[..., tuple[Array, Array]],
) -> tuple[Array, Array]:
    """From ``operands``, the pre-activation ``[M, n_act * F]``, the gradient of the
    activation's output ``[M, F]``, the group sizes ``[G]`` and the groups' ``scale_inv [G]``:
    the pre-activation's float8 gradient, each group's rows quantized with its scale, and each
    group's amax; by the kernel where the switch takes it (checked on its first use on a GPU),
    else by ``by_xla(*operands, activation_type, q_dtype)`` (``grouped.activation_grad_by_xla``,
    whose module imports this one)."""

    def kernel(
        pre: Array, grad: Array, sizes: Array, scale_inv: Array, *, interpret: bool
    ) -> tuple[Array, Array]:
        return activation_grad_rows(
            pre, grad, sizes, scale_inv, activation_type, q_dtype, interpret=interpret
        )

    def xla(pre: Array, grad: Array, sizes: Array, scale_inv: Array) -> tuple[Array, Array]:
        return by_xla(pre, grad, sizes, scale_inv, activation_type, q_dtype)

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
