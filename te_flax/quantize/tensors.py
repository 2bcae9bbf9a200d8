"""Quantized tensors: the operands a GEMM takes, as pytrees.

Per-tensor quantizers turn a tensor into one ``ScaledTensor``, which every GEMM that uses the
tensor shares. Block-scaled quantizers need to know how the tensor is contracted: the tensor is
``[leading..., trailing...]`` with ``split`` leading axes, and each use, ``TRAILING`` (a GEMM
contracts the trailing axes) and/or ``LEADING``, is quantized from high precision into its own
``BlockScaledTensor``, held together in a ``BlockOperand``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from te_flax.quantize import block_scaling

__all__ = [
    "LEADING",
    "TRAILING",
    "BlockOperand",
    "BlockScaledTensor",
    "GemmOperand",
    "ScaledTensor",
    "static_field",
]

TRAILING = "trailing"  # a GEMM contracts the tensor's axes from ``split`` on
LEADING = "leading"  # a GEMM contracts the tensor's first ``split`` axes


class ScaledTensor(NamedTuple):
    """A GEMM operand: ``data`` (float8, or high precision when ``scale_inv`` is None).

    ``transposed``, when present, holds the same values as ``data`` with its leading axes moved
    after its trailing ones (``[trailing..., leading...]``): the layout of a GEMM that
    contracts the leading axes, written by the quantize kernel in the same pass as ``data`` so
    that XLA need not transpose the float8 data. The GEMM stage picks whichever layout has the
    contracted axes last; the values are the same.
    """

    data: Array
    scale_inv: Array | None = None
    transposed: Array | None = None

    def keep(self, use: str) -> ScaledTensor:
        """The operand for one use only. A per-tensor operand serves every use from ``data``;
        the ``transposed`` copy is kept only for a GEMM that contracts the leading axes."""
        return self if use == LEADING else self._replace(transposed=None)


def static_field(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is static pytree metadata (part of the treedef, not a leaf)."""
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaledTensor:
    """A block-scaled GEMM operand as a matrix whose last axis is the contraction.

    Attributes:
      data: ``[rows, K]`` float8 or float4 values.
      scale_inv: ``[rows, K // block]`` block scales (e8m0 or e4m3).
      tensor_scale_inv: float32 scalar applied to the whole tensor (NVFP4), or None.
      row_shape: the shape the ``rows`` axis unflattens to in a GEMM's output (static).
      has_rht_applied: the data is of the values after ``block_scaling.random_hadamard_transform``
        along K (static): a GEMM must multiply it with an operand transformed the same way.
    """

    data: Array
    scale_inv: Array
    tensor_scale_inv: Array | None
    row_shape: tuple[int, ...] = static_field()
    has_rht_applied: bool = static_field(False)

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Array:
        """The ``[rows, K]`` values the operand stands for (the Hadamard transform undone)."""
        values = block_scaling.dequantize_blocks(
            self.data, self.scale_inv, self.tensor_scale_inv, jnp.float32
        )
        if self.has_rht_applied:
            values = block_scaling.random_hadamard_transform(values, inverse=True)
        return values.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockOperand:
    """One tensor ``[leading..., trailing...]`` quantized for each way a GEMM contracts it.

    Attributes:
      trailing: the tensor as ``[prod(leading), prod(trailing)]``, for a GEMM that contracts its
        trailing axes (None when not prepared).
      leading: the tensor as ``[prod(trailing), prod(leading)]``, for a GEMM that contracts its
        leading axes (None when not prepared).
      shape: the tensor's shape (static).
      split: how many leading axes it has (static).
    """

    trailing: BlockScaledTensor | None
    leading: BlockScaledTensor | None
    shape: tuple[int, ...] = static_field()
    split: int = static_field()

    def keep(self, use: str) -> BlockOperand:
        """The operand with only ``use`` (``TRAILING`` or ``LEADING``) prepared."""
        return dataclasses.replace(
            self,
            trailing=self.trailing if use == TRAILING else None,
            leading=self.leading if use == LEADING else None,
        )

    def for_contraction(self, axes: tuple[int, ...]) -> BlockScaledTensor:
        """The prepared quantization of a GEMM that contracts ``axes`` of the tensor."""
        ndim = len(self.shape)
        if tuple(axes) == tuple(range(self.split, ndim)):
            use, operand = TRAILING, self.trailing
        elif tuple(axes) == tuple(range(self.split)):
            use, operand = LEADING, self.leading
        else:
            raise AssertionError(f"contraction {axes} of a block operand split at {self.split}")
        assert operand is not None, f"the {use} quantization was not prepared"
        return operand


GemmOperand = ScaledTensor | BlockOperand
