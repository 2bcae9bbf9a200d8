"""What every layer description is made of: parameter records, initializers, input checks, the
parts several layers share (the norm, low-rank adaptation) and what a layer says about its FP8
state.

A shared part is a mixin: its methods, and the attributes they read as bare annotations (for the
type checker). Each layer declares those attributes as its own dataclass fields, at the places
TransformerEngine's constructor of that layer gives them: a constructor's order is per layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from te_flax._base import checks as check
from te_flax._ops.lora import lora_delta, lora_shapes
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.state import fresh_state

__all__ = [
    "Dropout",
    "Fp8Layer",
    "FusedNorm",
    "Initializer",
    "LowRank",
    "Norm",
    "ParamRecord",
    "Params",
    "check_last_axis",
    "compute_input",
    "default_kernel_init",
    "flat_fan_in",
    "named_sets",
    "param",
    "scaled_init",
    "stacked_init",
]

Initializer = Callable[..., Array]  # init(key, shape, dtype)
# The key of a layer's dropout, None when its dropout is off.
Dropout = Array | None
# A layer's parameters by name (ParamRecord.name -> array).
Params = dict[str, Array]
zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def default_kernel_init() -> Initializer:
    """TransformerEngine's default: variance scaling 1.0, fan-in, truncated normal."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One parameter: its name, shape, ``init(key, shape, dtype)`` and logical axis names."""

    name: str
    shape: tuple[int, ...]
    init: Initializer
    axes: tuple[str | None, ...]


def param(
    name: str, shape: Sequence[int], init: Initializer, axes: Sequence[str | None]
) -> ParamRecord:
    """A ``ParamRecord`` with its logical axes checked against its shape (no axes: all None)."""
    dims = tuple(int(d) for d in shape)
    names = tuple(axes) if axes else (None,) * len(dims)
    if len(names) != len(dims):
        raise ValueError(
            f"the logical axes {names} of parameter {name!r} name {len(names)} dimensions but it "
            f"has shape {dims}; give one logical axis name (or None) per dimension"
        )
    return ParamRecord(name, dims, init, names)


def flat_fan_in(init: Initializer, n_in: int) -> Initializer:
    """``init`` called on the 2-D ``[prod(in), prod(out)]`` shape, then reshaped.

    Fan-in and fan-out are then the contracted and the output sizes whatever the kernel's rank.
    """

    def flat_init(key: Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> Array:
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        return jnp.reshape(init(key, flat, dtype), shape)

    return flat_init


def stacked_init(kernel_init: Initializer, parts: int, first_scale: float = 1.0) -> Initializer:
    """Init for a flat ``[hidden, parts * width]`` kernel: each part on its own (TE's qkv/kv).

    The first part (the query of a fused QKV kernel) is divided by ``first_scale``.
    """

    def init(key: Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Array:
        hidden, total = shape
        keys = jax.random.split(key, parts)
        blocks = [kernel_init(k, (hidden, total // parts), dtype) for k in keys]
        blocks[0] = blocks[0] / jnp.asarray(first_scale, dtype)
        return jnp.concatenate(blocks, axis=-1)

    return init


def scaled_init(kernel_init: Initializer, scale: float) -> Initializer:
    """``kernel_init`` divided by ``scale`` (TE's scaled query kernel)."""

    def init(key: Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Array:
        return kernel_init(key, shape, dtype) / jnp.asarray(scale, dtype)

    return init


def compute_input(x: Array, dtype: DTypeLike | None) -> Array:
    """``x`` checked to be floating point, cast to the compute ``dtype`` (None: kept)."""
    check.check_floating(x, "the input")
    dtype = check.check_dtype(dtype, "dtype")
    return x if dtype is None else x.astype(dtype)


def check_last_axis(axis: object, x: Array, layer: str = "this layer") -> None:
    if axis not in (-1, x.ndim - 1):
        raise ValueError(
            f"axis={axis!r} is not supported: {layer} normalizes and contracts the last axis "
            "only (axis=-1); move the features axis last, e.g. with jnp.moveaxis"
        )


def named_sets(
    quantizer_sets: Sequence[QuantizerSet], name: str | None
) -> tuple[QuantizerSet, ...]:
    """The sets with TE's ``quantization_checkpoint_name``: the quantized operands each GEMM
    saves for its backward carry that ``jax.checkpoint`` name (unquantized sets save none)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"quantization_checkpoint_name must be a str (a jax.checkpoint name) or None, got "
            f"{name!r}"
        )
    return tuple(
        qs if name is None or qs.is_noop else dataclasses.replace(qs, checkpoint_name=name)
        for qs in quantizer_sets
    )


class Fp8Layer:
    """What a layer says about its FP8 state; both shells create and read it from this.

    ``fp8_postfixes``: one per GEMM (the variable names' postfix). ``fp8_groups``: None for one
    state per tensor, else the number of groups of a grouped GEMM (one state per group).
    """

    fp8_postfixes: ClassVar[tuple[str, ...]] = ()

    @property
    def fp8_groups(self) -> int | None:
        return None

    def fresh_fp8_state(self, recipe: Recipe | None, postfix: str) -> dict[str, Array]:
        """One GEMM's initial FP8 variables under ``recipe`` (empty when it keeps none)."""
        return fresh_state(recipe, postfix, self.fp8_groups)


class Norm:
    """The norm of a layer: layernorm or rmsnorm over the last axis, ``scale`` (and a bias).

    A layer with it declares these fields (TE's defaults: ``"layernorm"``, 1e-6, False, None,
    ``("embed",)``).
    """

    layernorm_type: str
    epsilon: float
    zero_centered_gamma: bool
    scale_init: Initializer | None
    scale_axes: tuple[str | None, ...]

    def norm_params(
        self, hidden: int, bias_init: Initializer, bias_axes: tuple[str | None, ...]
    ) -> list[ParamRecord]:
        norm_type = check.canonical_norm_type(self.layernorm_type, "layernorm_type")
        scale_init = self.scale_init or (zeros if self.zero_centered_gamma else ones)
        params = [param("scale", (hidden,), scale_init, self.scale_axes)]
        if norm_type == "layernorm":
            params.append(param("ln_bias", (hidden,), bias_init, bias_axes))
        return params

    def norm_arguments(self, params: Params) -> dict[str, Any]:
        return dict(
            gamma=params["scale"],
            beta=params.get("ln_bias"),
            norm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma,
            epsilon=self.epsilon,
        )


class FusedNorm(Norm):
    """The norm fused into a GEMM layer, whose own ``bias`` is the GEMM's: ``ln_bias_*``.

    A layer with it declares these fields besides the norm's (TE's defaults: zeros,
    ``("embed",)``).
    """

    ln_bias_init: Initializer
    ln_bias_axes: tuple[str | None, ...]

    def fused_norm_params(self, hidden: int) -> list[ParamRecord]:
        return self.norm_params(hidden, self.ln_bias_init, self.ln_bias_axes)


class LowRank:
    """Low-rank adaptation beside a GEMM, with TE's attribute and parameter names.

    A layer with it declares these fields (TE's defaults: False, 32, None).
    """

    enable_low_rank_adaptation: bool
    low_rank_adaptation_dim: int
    low_rank_adaptation_alpha: float | None

    def lora_params(
        self,
        prefix: str,
        in_features: Sequence[int],
        features: Sequence[int],
        kernel_init: Initializer | None,
    ) -> list[ParamRecord]:
        if not self.enable_low_rank_adaptation:
            return []
        a_shape, b_shape = lora_shapes(
            tuple(in_features), tuple(features), self.low_rank_adaptation_dim
        )
        init = flat_fan_in(kernel_init or default_kernel_init(), len(in_features))
        return [
            param(f"{prefix}lora_a_kernel", a_shape, init, ()),
            param(f"{prefix}lora_b_kernel", b_shape, zeros, ()),
        ]

    def with_lora(
        self, out: Array, x: Array | None, params: Params, prefix: str, n_contract: int
    ) -> Array:
        if not self.enable_low_rank_adaptation:
            return out
        assert x is not None, "the layer keeps the GEMM input when LoRA is on"
        delta = lora_delta(
            x,
            params[f"{prefix}lora_a_kernel"],
            params[f"{prefix}lora_b_kernel"],
            n_contract,
            self.low_rank_adaptation_dim,
            self.low_rank_adaptation_alpha,
        )
        return out + delta.astype(out.dtype)
