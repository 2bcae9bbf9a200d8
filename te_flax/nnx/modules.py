"""The NNX modules: the Linen modules' layers, attributes and variable names, NNX style.

Each module is built with the input size it will see (``in_features``, or ``num_features`` for
``LayerNorm``), ``rngs=`` and, as keywords, the same attributes with the same defaults as its
Linen twin in ``te_flax.linen`` (which documents them). Parameters are ``nnx.Param`` with the
logical axes of the ``*_axes`` attributes as sharding metadata (``nnx.get_partition_spec``);
FP8 state is ``Fp8Meta`` variables named as in Linen. The recipe is read when the module is
built (its ``recipe`` attribute, else the active ``te_flax.autocast``) and again when called;
the two must agree. A module built for NVFP4 with stochastic rounding keeps a fork of ``rngs``'
``"sr_rng"`` stream (else its default stream) and draws a key from it at every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

from te_flax._base.checks import check_sizes
from te_flax._layers.linear import (
    DenseGeneralDescription,
    LayerNormDenseGeneralDescription,
    LayerNormDescription,
    LayerNormMLPDescription,
)
from te_flax.nnx._shell import NnxShell

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]


def _as_tuple(features: int | Sequence[int], name: str = "in_features") -> tuple[int, ...]:
    return check_sizes(features, name)


class LayerNorm(NnxShell, LayerNormDescription):
    """Layernorm or rmsnorm over the last axis (``te_flax.linen.LayerNorm``, NNX style).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> norm = te_nnx.LayerNorm(8, layernorm_type="rmsnorm", rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(norm, nnx.Param)))
      {'scale': (8,)}
      >>> norm(jnp.ones((2, 8))).shape
      (2, 8)
    """

    def __init__(self, num_features: int, *, rngs: nnx.Rngs, **attributes: Any) -> None:
        self._setup(_as_tuple(num_features, "num_features"), rngs, attributes)


class DenseGeneral(NnxShell, DenseGeneralDescription):
    """``x . kernel + bias`` over x's trailing axes (``te_flax.linen.DenseGeneral``, NNX style).

    ``in_features`` is the size of the contracted axes (a tuple for ``axis=(-2, -1)``).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax, te_flax.nnx as te_nnx
      >>> with te_flax.autocast(enabled=True):
      ...     layer = te_nnx.DenseGeneral(8, (2, 4), rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
      {'bias': (2, 4), 'kernel': (8, 2, 4)}
      >>> sorted(nnx.to_pure_dict(nnx.state(layer, te_nnx.Fp8Meta)))[:2]
      ['grad_amax_history', 'grad_scale_inv']
      >>> with te_flax.autocast(enabled=True):
      ...     y = layer(jnp.ones((3, 8)))
      >>> y.shape
      (3, 2, 4)
    """

    def __init__(
        self,
        in_features: int | tuple[int, ...],
        features: int | tuple[int, ...],
        *,
        rngs: nnx.Rngs,
        **attributes: Any,
    ) -> None:
        self._setup(_as_tuple(in_features), rngs, {**attributes, "features": features})


class LayerNormDenseGeneral(NnxShell, LayerNormDenseGeneralDescription):
    """A norm fused with the GEMM after it (``te_flax.linen.LayerNormDenseGeneral``, NNX style).

    Returns ``(y, ln_output or None)``.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> layer = te_nnx.LayerNormDenseGeneral(8, (3, 4), return_layernorm_output=True,
      ...                                      rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
      {'kernel': (8, 3, 4), 'ln_bias': (8,), 'scale': (8,)}
      >>> y, ln = layer(jnp.ones((2, 8)))
      >>> y.shape, ln.shape
      ((2, 3, 4), (2, 8))
    """

    def __init__(
        self,
        in_features: int,
        features: int | tuple[int, ...],
        *,
        rngs: nnx.Rngs,
        **attributes: Any,
    ) -> None:
        self._setup(_as_tuple(in_features), rngs, {**attributes, "features": features})


class LayerNormMLP(NnxShell, LayerNormMLPDescription):
    """Norm, two GEMMs, (gated) activation and dropout (``te_flax.linen.LayerNormMLP``, NNX).

    Returns ``(y, ln_output or None)``. ``in_features`` is the hidden size; the intermediate
    dropout draws from ``rngs``' ``intermediate_dropout_rng_name`` stream.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> mlp = te_nnx.LayerNormMLP(8, intermediate_dim=32, activations=("silu", "linear"),
      ...                           rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(mlp, nnx.Param)))
      {'ln_bias': (8,), 'scale': (8,), 'wi_kernel': (8, 2, 32), 'wo_kernel': (32, 8)}
      >>> mlp(jnp.ones((2, 4, 8)), deterministic=True)[0].shape
      (2, 4, 8)
    """

    def __init__(self, in_features: int, *, rngs: nnx.Rngs, **attributes: Any) -> None:
        self._setup(_as_tuple(in_features), rngs, attributes)
        # Assigned once: NNX fixes an attribute as static or data at its first assignment.
        self.dropout = (
            nnx.Dropout(
                self.intermediate_dropout_rate,
                broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                rng_collection=self.intermediate_dropout_rng_name,
                rngs=rngs,
            )
            if self.intermediate_dropout_rate > 0
            else None
        )

    @property
    def dropout_rngs(self) -> nnx.RngStream | None:
        """The stream the intermediate dropout draws from (None when it is off)."""
        return None if self.dropout is None else self.dropout.rngs
