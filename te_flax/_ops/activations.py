"""The activation stage of ``layernorm_mlp``: named activations and gated pairs.

An activation type is a tuple of names, one per slice of the ``act`` axis of the first GEMM's
output: ``("gelu",)`` applies GELU to the single slice, a gated pair such as ``("silu", "linear")``
(SwiGLU) applies the activation to slice 0 and multiplies by slice 1, and any longer or other
tuple (``("relu", "relu")``, ``("gelu", "tanh", "linear")``) applies each name to its slice and
multiplies the results, as TransformerEngine's LayerNormMLP computes the combinations its fused
kernels do not implement. The backward is ``jax.vjp`` of the same function, so it is exact for
every activation by construction.

One pair takes parameters: TransformerEngine's clamped SwiGLU (gpt-oss),
``("clamped_silu", "clamped_linear")`` with ``ClampedSwigluParams(limit, alpha,
glu_linear_offset)``, computes ``silu_alpha(min(a, limit)) * (clip(b, -limit, limit) +
glu_linear_offset)`` with ``silu_alpha(x) = x * sigmoid(alpha * x)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax import Array

__all__ = [
    "ACTIVATIONS",
    "CLAMPED_SWIGLU",
    "ClampedSwigluParams",
    "activation_backward",
    "activation_backward_of_slices",
    "activation_forward",
    "activation_of_slices",
    "canonical_activation_params",
    "canonical_activation_type",
    "rounded_once_activation",
]


def _quick_gelu(x: Array) -> Array:
    return x * jax.nn.sigmoid(1.702 * x)


def _squared_relu(x: Array) -> Array:
    return jnp.square(jax.nn.relu(x))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    # The tanh approximation is TransformerEngine's "gelu" and the form cuBLASLt fuses as a GEMM
    # epilogue.
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "quick_gelu": _quick_gelu,
    "squared_relu": _squared_relu,
    "linear": lambda x: x,
    # flax.linen's elementwise activations, which TransformerEngine's LayerNormMLP looks up by
    # name (``getattr(flax.linen, name)``) for the combinations its fused kernels do not cover.
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "elu": jax.nn.elu,
    "celu": jax.nn.celu,
    "selu": jax.nn.selu,
    "softplus": jax.nn.softplus,
    "soft_sign": jax.nn.soft_sign,
    "relu6": jax.nn.relu6,
    "hard_tanh": jax.nn.hard_tanh,
    "hard_sigmoid": jax.nn.hard_sigmoid,
    "hard_silu": jax.nn.hard_silu,
    "hard_swish": jax.nn.hard_swish,
    "log_sigmoid": jax.nn.log_sigmoid,
    "leaky_relu": jax.nn.leaky_relu,
}


# TransformerEngine's clamped SwiGLU: the only activation pair that takes parameters.
CLAMPED_SWIGLU = ("clamped_silu", "clamped_linear")


@dataclasses.dataclass(frozen=True)
class ClampedSwigluParams:
    """The parameters of TransformerEngine's clamped SwiGLU, with TE's names and defaults.

    ``limit`` clamps the activated slice from above and the linear slice to
    ``[-limit, limit]``; ``alpha`` scales the sigmoid's input; ``glu_linear_offset`` is added
    to the clamped linear slice. Frozen and hashable: it travels in an op's static config.
    """

    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0


def _clamped_silu(x: Array, params: ClampedSwigluParams) -> Array:
    clamped = jnp.minimum(x, jnp.asarray(params.limit, x.dtype))
    return clamped * jax.nn.sigmoid(jnp.asarray(params.alpha, x.dtype) * clamped)


def _clamped_linear(x: Array, params: ClampedSwigluParams) -> Array:
    limit = jnp.asarray(params.limit, x.dtype)
    return jnp.clip(x, -limit, limit) + jnp.asarray(params.glu_linear_offset, x.dtype)


_PARAMETERIZED: dict[str, Callable[[Array, ClampedSwigluParams], Array]] = {
    "clamped_silu": _clamped_silu,
    "clamped_linear": _clamped_linear,
}


def canonical_activation_type(activation_type: Sequence[str]) -> tuple[str, ...]:
    """``activation_type`` as a tuple, reversed when it starts with ``"linear"`` (TE's rule).

    ``("linear", "silu")`` and ``("silu", "linear")`` both mean SwiGLU and both become
    ``("silu", "linear")``. Names are matched in lower case, as TransformerEngine does.
    """
    if isinstance(activation_type, str) or not isinstance(activation_type, Sequence):
        raise TypeError(
            f"activation_type must be a tuple of activation names, got {activation_type!r}; "
            "e.g. ('gelu',) or ('silu', 'linear') for SwiGLU"
        )
    if not activation_type or not all(isinstance(name, str) for name in activation_type):
        raise TypeError(
            f"activation_type must be a non-empty tuple of activation names (str), got "
            f"{activation_type!r}; e.g. ('gelu',), ('silu', 'linear') or ('relu', 'relu')"
        )
    names = tuple(name.lower() for name in activation_type)
    unknown = [name for name in names if name not in ACTIVATIONS and name not in _PARAMETERIZED]
    if unknown:
        raise ValueError(
            f"unknown activation {unknown[0]!r} in activation_type={names!r}; known: "
            f"{', '.join(ACTIVATIONS)}, and the pair {CLAMPED_SWIGLU} (clamped SwiGLU)"
        )
    if any(name in _PARAMETERIZED for name in names):
        if sorted(names) != sorted(CLAMPED_SWIGLU):
            raise ValueError(
                f"activation_type={names!r}: 'clamped_silu' and 'clamped_linear' form one gated "
                f"pair, TransformerEngine's clamped SwiGLU; use {CLAMPED_SWIGLU}"
            )
        return CLAMPED_SWIGLU
    # TransformerEngine reverses a tuple that starts with "linear", so that a gated pair's
    # activation comes first whichever way it is written; slice i of the kernel's act axis
    # then takes the i-th name.
    return names[::-1] if names[0] == "linear" else names


def canonical_activation_params(
    activation_type: tuple[str, ...], activation_params: Mapping[str, float] | None
) -> ClampedSwigluParams | None:
    """The parameters of a canonical ``activation_type``, as a hashable value (or None).

    ``activation_params`` is TransformerEngine's dict: for the clamped SwiGLU the keys of
    ``ClampedSwigluParams`` (missing keys take TE's defaults, None or ``{}`` all of them); any
    other activation takes none.
    """
    if activation_params is not None and not isinstance(activation_params, Mapping):
        raise TypeError(
            f"activation_params must be a dict or None, got {activation_params!r}; e.g. "
            "{'limit': 7.0, 'alpha': 1.702} for ('clamped_silu', 'clamped_linear')"
        )
    given = dict(activation_params or {})
    if activation_type != CLAMPED_SWIGLU:
        if given:
            raise ValueError(
                f"activation_params={given!r} given, but activation_type={activation_type!r} "
                f"takes no parameters; only the clamped SwiGLU {CLAMPED_SWIGLU} does (keys "
                f"{[f.name for f in dataclasses.fields(ClampedSwigluParams)]})"
            )
        return None
    known = [field.name for field in dataclasses.fields(ClampedSwigluParams)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"unknown activation_params {unknown} for {CLAMPED_SWIGLU}; its keys are {known}"
        )
    for name, value in given.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise TypeError(f"activation_params[{name!r}] must be a finite number, got {value!r}")
    params = ClampedSwigluParams(**{name: float(value) for name, value in given.items()})
    if params.limit <= 0:
        raise ValueError(f"activation_params['limit'] must be positive, got {params.limit}")
    return params


def activation_of_slices(
    slices: Sequence[Array],
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None = None,
) -> Array:
    """The activation of the ``act`` axis' slices (each ``[..., intermediate]``)."""
    if activation_type == CLAMPED_SWIGLU:
        params = params or ClampedSwigluParams()
        # Gated: clamped_silu(slice 0) * clamped_linear(slice 1).
        return _clamped_silu(slices[0], params) * _clamped_linear(slices[1], params)
    # One slice: act(slice 0); a gated pair: act(slice 0) * slice 1; in general the product of
    # each slice's activation, left to right.
    activated = ACTIVATIONS[activation_type[0]](slices[0])
    for name, part in zip(activation_type[1:], slices[1:], strict=True):
        activated = activated * ACTIVATIONS[name](part)
    return activated


def activation_forward(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None = None,
) -> Array:
    """``[batch..., n_act, intermediate]`` -> ``[batch..., intermediate]``.

    Computed in the input's dtype, as the GEMM epilogue that XLA may fuse it into would.
    ``params``: the clamped SwiGLU's (None: TE's defaults); see
    ``canonical_activation_params``.
    """
    slices = [pre_activation[..., index, :] for index in range(len(activation_type))]
    return activation_of_slices(slices, activation_type, params)


def activation_backward(
    grad: Array,
    pre_activation: Array,
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None = None,
) -> Array:
    """The gradient of ``activation_forward`` w.r.t. its ``[..., n_act, intermediate]`` input.

    Computed in float32 and rounded once to the pre-activation's dtype, as TransformerEngine's
    activation-backward kernels do (a bfloat16 chain would round after every operation).
    """
    pre32 = pre_activation.astype(jnp.float32)
    _, vjp = jax.vjp(lambda pre: activation_forward(pre, activation_type, params), pre32)
    return vjp(grad.astype(jnp.float32))[0].astype(pre_activation.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def rounded_once_activation(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None = None,
) -> Array:
    """``activation_forward`` computed in float32 and rounded once to the input's dtype, its
    backward ``activation_backward`` (float32, rounded once) from the pre-activation alone.

    The MoE block's experts take it: the backward saves nothing but the pre-activation, which
    the step holds anyway, where JAX's own derivative of a bfloat16 chain saves the activated
    slice as a residual of its own. In float32 XLA also fuses the activation into the pass that
    quantizes its output for the next GEMM (a bfloat16 ``exp`` counts as too costly to repeat
    there): the FP8 step writes and reads one tensor fewer (``bench/RESULTS_moe.md``).
    """
    return activation_forward(pre_activation.astype(jnp.float32), activation_type, params).astype(
        pre_activation.dtype
    )


def _rounded_once_forward(
    pre_activation: Array,
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None = None,
) -> tuple[Array, Array]:
    return rounded_once_activation(pre_activation, activation_type, params), pre_activation


def _rounded_once_backward(
    activation_type: tuple[str, ...],
    params: ClampedSwigluParams | None,
    pre_activation: Array,
    grad: Array,
) -> tuple[Array]:
    return (activation_backward(grad, pre_activation, activation_type, params),)


rounded_once_activation.defvjp(_rounded_once_forward, _rounded_once_backward)


def activation_backward_of_slices(
    grad: Array, slices: Sequence[Array], activation_type: tuple[str, ...]
) -> tuple[Array, ...]:
    """The gradient of ``activation_of_slices`` w.r.t. each slice, in the slices' dtype
    (computed in float32). The operations of ``activation_backward`` on each slice: a kernel
    that holds the slices runs these."""
    dtype = slices[0].dtype
    parts32 = [part.astype(jnp.float32) for part in slices]
    _, vjp = jax.vjp(lambda *parts: activation_of_slices(parts, activation_type), *parts32)
    grads = vjp(grad.astype(jnp.float32))
    if len(grads) > 1:
        # ``activation_backward`` sums the slices' gradients, each padded with zeros to the
        # whole axis, and -0.0 + 0.0 is +0.0: so a zero gradient is +0.0 here too.
        grads = tuple(jnp.where(part == 0.0, 0.0, part) for part in grads)
    return tuple(part.astype(dtype) for part in grads)
