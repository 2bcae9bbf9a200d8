"""``MoEBlock``, NNX style: the mixture-of-experts block of ``te_flax._layers.moe``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from te_flax._layers.moe import MoEBlockDescription
from te_flax.nnx._shell import NnxShell

__all__ = ["MoEBlock"]


class MoEBlock(NnxShell, MoEBlockDescription):
    """A mixture of gated MLP experts (``te_flax.linen.MoEBlock``, NNX style).

    Returns ``(y, aux_loss)``. ``in_features`` is the hidden size. Each call writes what the
    router did into ``nnx.Intermediate`` variables, ``aux_loss``, ``tokens_per_expert`` (int32
    ``[E]``) and ``tokens_dropped`` (int32 ``[]``), which no optimizer touches. The FP8 state of the
    two grouped GEMMs holds one entry per expert (``[num_experts, ...]``).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> moe = te_nnx.MoEBlock(8, num_experts=4, intermediate_dim=16, rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(moe, nnx.Param)))
      {'gate_kernel': (8, 4), 'wi_kernel': (4, 8, 2, 16), 'wo_kernel': (4, 16, 8)}
      >>> y, aux_loss = moe(jnp.ones((2, 3, 8)))
      >>> y.shape
      (2, 3, 8)
    """

    def __init__(self, in_features: int, *, rngs: nnx.Rngs, **attributes: Any) -> None:
        self._setup((in_features,), rngs, attributes)
        self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
        self.tokens_per_expert = nnx.Intermediate(jnp.zeros((self.num_experts,), jnp.int32))
        self.tokens_dropped = nnx.Intermediate(jnp.zeros((), jnp.int32))
