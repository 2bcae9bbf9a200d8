"""The ops' argument checks that need the ops' own types: a norm's arguments (to a ``NormConfig``)
and a quantizer set. Every other check is in ``te_flax._base.checks``; each error names the
argument, what was received, and how to fix it."""

from __future__ import annotations

import math

from jax import Array

from te_flax._base.checks import canonical_norm_type, check_floating, check_shape
from te_flax._ops.norm import NormConfig
from te_flax.quantize import QuantizerSet

__all__ = ["check_norm", "check_quantizer_set"]


def check_norm(
    x: Array,
    gamma: Array,
    beta: Array | None,
    norm_type: object,
    zero_centered_gamma: object,
    epsilon: object,
) -> NormConfig:
    """Validates the norm arguments against ``x`` and returns their static description."""
    norm_type = canonical_norm_type(norm_type)
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(f"zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
    if (
        not isinstance(epsilon, int | float)
        or isinstance(epsilon, bool)
        or not math.isfinite(epsilon)
        or epsilon <= 0
    ):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon!r}")
    hidden = x.shape[-1]
    check_floating(gamma, "gamma")
    check_shape(gamma, (hidden,), "gamma", f"the norm runs over x's last axis of size {hidden}")
    if norm_type == "rmsnorm" and beta is not None:
        raise ValueError(
            'beta must be None for rmsnorm (it has no shift); drop it or use norm_type="layernorm"'
        )
    if norm_type == "layernorm":
        if beta is None:
            raise ValueError(
                f"beta is None but layernorm needs a shift of shape ({hidden},); pass "
                f'jnp.zeros({hidden}) or use norm_type="rmsnorm"'
            )
        check_floating(beta, "beta")
        check_shape(beta, (hidden,), "beta", f"the norm runs over x's last axis of size {hidden}")
    return NormConfig(norm_type, zero_centered_gamma, float(epsilon))


def check_quantizer_set(quantizer_set: object, name: str = "quantizer_set") -> QuantizerSet:
    if not isinstance(quantizer_set, QuantizerSet):
        raise TypeError(
            f"{name} must be a te_flax.quantize.QuantizerSet, got {quantizer_set!r}; build one "
            "with QuantizerFactory.create_set(fp8_recipe=...) or pass noop_quantizer_set"
        )
    quantizer_set.check(name)
    return quantizer_set
