"""The NNX variable type of FP8 state."""

from __future__ import annotations

from typing import Any

from flax import nnx

from te_flax._layers.fp8_state import OVERWRITE_WITH_GRADIENT

__all__ = ["Fp8Meta"]


@nnx.register_variable_name(OVERWRITE_WITH_GRADIENT)
class Fp8Meta(nnx.Variable[Any]):
    """FP8 state (amax history, ``scale_inv``): a variable whose gradient is its new value.

    Registered under the Linen collection name ``_overwrite_with_gradient``, so ``nnx.bridge``
    maps it to and from Linen modules' FP8 state. Keep it out of the optimizer
    (``nnx.Optimizer(model, tx, wrt=nnx.Param)``) and overwrite it with its gradient instead,
    as ``te_flax.nnx.train_step`` does.
    """
