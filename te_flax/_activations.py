"""The activation stage of ``layernorm_mlp``: named activations and gated pairs.

An activation type is a tuple of names, one per slice of the ``act`` axis of the first GEMM's
output: ``("gelu",)`` applies GELU to the single slice, a gated pair such as ``("silu", "linear")``
(SwiGLU) applies the activation to slice 0 and multiplies by slice 1. The backward is ``jax.vjp``
of the same function, so it is exact for every activation by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import Array

__all__ = [
    "ACTIVATIONS",
    "activation_backward",
    "activation_backward_of_slices",
    "activation_forward",
    "activation_of_slices",
    "canonical_activation_type",
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
}


def canonical_activation_type(activation_type: Sequence[str]) -> tuple[str, ...]:
    """``activation_type`` as a tuple with a gated pair's activation first.

    ``("linear", "silu")`` and ``("silu", "linear")`` both mean SwiGLU and both become
    ``("silu", "linear")``.
    """
    if isinstance(activation_type, str) or not isinstance(activation_type, Sequence):
        raise TypeError(
            f"activation_type must be a tuple of activation names, got {activation_type!r}; "
            "e.g. ('gelu',) or ('silu', 'linear') for SwiGLU"
        )
    names = tuple(activation_type)
    unknown = [name for name in names if name not in ACTIVATIONS]
    if unknown:
        raise ValueError(
            f"unknown activation {unknown[0]!r} in activation_type={names!r}; known: "
            f"{', '.join(ACTIVATIONS)}"
        )
    if len(names) == 1:
        return names
    if len(names) == 2 and "linear" in names:
        return names if names[1] == "linear" else (names[1], names[0])
    raise ValueError(
        f"activation_type={names!r} is not supported: give one activation, e.g. ('gelu',), or a "
        "gated pair of an activation and 'linear', e.g. ('gelu', 'linear') for GEGLU"
    )


def activation_of_slices(slices: Sequence[Array], activation_type: tuple[str, ...]) -> Array:
    """The activation of the ``act`` axis' slices (each ``[..., intermediate]``)."""
    activated = ACTIVATIONS[activation_type[0]](slices[0])
    if len(activation_type) == 1:
        return activated
    # Gated: activation(slice 0) * slice 1.
    return activated * slices[1]


def activation_forward(pre_activation: Array, activation_type: tuple[str, ...]) -> Array:
    """``[batch..., n_act, intermediate]`` -> ``[batch..., intermediate]``.

    Computed in the input's dtype, as the GEMM epilogue that XLA may fuse it into would.
    """
    slices = [pre_activation[..., index, :] for index in range(len(activation_type))]
    return activation_of_slices(slices, activation_type)


def activation_backward(
    grad: Array, pre_activation: Array, activation_type: tuple[str, ...]
) -> Array:
    """The gradient of ``activation_forward`` w.r.t. its ``[..., n_act, intermediate]`` input.

    Computed in float32 and rounded once to the pre-activation's dtype, as TransformerEngine's
    activation-backward kernels do (a bfloat16 chain would round after every operation).
    """
    pre32 = pre_activation.astype(jnp.float32)
    _, vjp = jax.vjp(lambda pre: activation_forward(pre, activation_type), pre32)
    return vjp(grad.astype(jnp.float32))[0].astype(pre_activation.dtype)


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
