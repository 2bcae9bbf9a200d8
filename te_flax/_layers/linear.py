"""The four linear layers, written once for Linen and NNX (``te_flax._layers.host``).

Each description is a dataclass of the layer's attributes (TransformerEngine's names and
defaults, Flax's ``dtype``/``param_dtype``) with four methods: ``in_features(x)`` checks an
input and returns the sizes the kernel contracts, ``param_records(in_features)`` lists the
parameters (name, shape, initializer, logical axes), ``__call__`` (TransformerEngine's call
signature) takes the parameters and quantizer sets from its front end's host, and ``forward(params,
x, quantizer_sets, dropout)`` runs the functional ops. The shells only supply the host, so Linen
and NNX cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from te_flax._base import checks as check
from te_flax._layers.base import (
    Dropout,
    Fp8Layer,
    FusedNorm,
    Initializer,
    LowRank,
    Norm,
    ParamRecord,
    Params,
    check_last_axis,
    compute_input,
    default_kernel_init,
    flat_fan_in,
    named_sets,
    param,
    zeros,
)
from te_flax._layers.host import Layer
from te_flax._ops.activations import (
    ClampedSwigluParams,
    activation_forward,
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax.dense import dense
from te_flax.layernorm import layernorm
from te_flax.layernorm_dense import layernorm_dense, layernorm_dense_with_norm_output
from te_flax.layernorm_mlp import (
    apply_dropout,
    dropout_mask,
    layernorm_mlp,
    layernorm_mlp_with_norm_output,
)
from te_flax.quantize import QuantizerSet, Recipe

__all__ = [
    "DenseGeneralDescription",
    "LayerNormDenseGeneralDescription",
    "LayerNormDescription",
    "LayerNormMLPDescription",
    "ParamRecord",
]


def _per_activation(init: Initializer) -> Initializer:
    """For ``[hidden, n_act, intermediate]``: each act slice initialised on its own, as in TE.

    The keys are drawn as TransformerEngine draws them (each slice's key split off the rest of
    the chain: ``key, slice_key = split(key)``), so the same init key gives TE's values.
    """

    def stacked_init(key: Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> Array:
        hidden, n_act, intermediate = shape
        slices = []
        for _ in range(n_act):
            key, slice_key = jax.random.split(key)
            slices.append(init(slice_key, (hidden, intermediate), dtype))
        return jnp.stack(slices, axis=-2)

    return stacked_init


def _features(features: int | Sequence[int] | None) -> tuple[int, ...]:
    if features is None:
        raise TypeError("features is required: the output size, an int or a tuple of ints")
    sizes = (features,) if isinstance(features, int) else tuple(features)
    if not sizes or not all(isinstance(f, int) and f >= 1 for f in sizes):
        raise ValueError(f"features must be a positive int or a tuple of them, got {sizes!r}")
    return sizes


# ----------------------------------------------------------------------------- LayerNorm


@dataclasses.dataclass
class LayerNormDescription(Layer, Norm, Fp8Layer):
    """Layernorm or rmsnorm over the last axis (parameters ``scale`` and ``ln_bias``)."""

    # TransformerEngine's fields, in its order.
    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ("embed",)
    bias_init: Initializer = zeros
    bias_axes: tuple[str | None, ...] = ("embed",)
    dtype: Any = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False

    def in_features(self, x: Array) -> tuple[int, ...]:
        check.check_input(x, f"{type(self).__name__}'s input")
        return (x.shape[-1],)

    def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]:
        return self.norm_params(in_features[-1], self.bias_init, self.bias_axes)

    def __call__(self, x: Array) -> Array:
        """``[batch..., hidden]`` -> the same shape (TE's parameter name, ``x``)."""
        with self.host().variables(x) as (params, sets):
            return self.forward(params, x, sets)

    def forward(
        self,
        params: Params,
        x: Array,
        quantizer_sets: Sequence[QuantizerSet] = (),
        dropout: Dropout = None,
    ) -> Array:
        x = compute_input(x, self.dtype)
        return layernorm(x, **self.norm_arguments(params))


# ----------------------------------------------------------------------------- DenseGeneral


@dataclasses.dataclass
class DenseGeneralDescription(Layer, LowRank, Fp8Layer):
    """``x . kernel + bias`` over one or more trailing axes of x."""

    # TransformerEngine's fields, in its order.
    features: int | tuple[int, ...] | None = None  # required
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str | None, ...] = ()
    use_bias: bool = True
    bias_init: Initializer = zeros
    bias_axes: tuple[str | None, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int | tuple[int, ...] = -1
    dtype: Any = None
    input_axes: tuple[str | None, ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None

    fp8_postfixes: ClassVar[tuple[str, ...]] = ("",)

    def _axes(self, ndim: int) -> tuple[int, ...]:
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        normalized = tuple(a % ndim for a in axes) if ndim else axes
        if normalized != tuple(range(ndim - len(axes), ndim)):
            raise ValueError(
                f"axis={self.axis!r} must name the input's trailing axes in order (input rank "
                f"{ndim}); e.g. axis=-1, or axis=(-2, -1) to contract the last two"
            )
        return normalized

    def in_features(self, x: Array) -> tuple[int, ...]:
        contracted = 1 if isinstance(self.axis, int) else len(tuple(self.axis))
        check.check_input(x, f"{type(self).__name__}'s input", contracted)
        return tuple(x.shape[a] for a in self._axes(x.ndim))

    def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]:
        features = _features(self.features)
        kernel_init = flat_fan_in(self.kernel_init or default_kernel_init(), len(in_features))
        params = [param("kernel", (*in_features, *features), kernel_init, self.kernel_axes)]
        if self.use_bias:
            params.append(param("bias", features, self.bias_init, self.bias_axes))
        return params + self.lora_params("", in_features, features, self.kernel_init)

    def __call__(self, inputs: Array) -> Array:
        """``[batch..., in...]`` -> ``[batch..., *features]``."""
        with self.host().variables(inputs) as (params, sets):
            return self.forward(params, inputs, sets)

    def forward(
        self,
        params: Params,
        x: Array,
        quantizer_sets: Sequence[QuantizerSet],
        dropout: Dropout = None,
    ) -> Array:
        x = compute_input(x, self.dtype)
        axes = self._axes(x.ndim)
        quantizer_sets = named_sets(quantizer_sets, self.quantization_checkpoint_name)
        out = dense(
            x,
            params["kernel"],
            params.get("bias"),
            contracting_dims=(axes, tuple(range(len(axes)))),
            transpose_batch_sequence=self.transpose_batch_sequence,
            input_axes=self.input_axes or None,
            kernel_axes=self.kernel_axes or None,
            quantizer_set=quantizer_sets[0],
        )
        return self.with_lora(out, x, params, "", len(axes))


# --------------------------------------------------------------------------- LayerNormDenseGeneral


@dataclasses.dataclass
class LayerNormDenseGeneralDescription(Layer, FusedNorm, LowRank, Fp8Layer):
    """A norm fused with the GEMM after it; returns ``(out, norm output or None)``."""

    # TransformerEngine's fields, in its order.
    features: int | tuple[int, ...] | None = None  # required
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ("embed",)
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str | None, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = zeros
    bias_axes: tuple[str | None, ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int = -1
    dtype: Any = None
    layernorm_input_axes: tuple[str | None, ...] | None = None
    dot_input_axes: tuple[str | None, ...] | None = None
    depth_scaling: float | None = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None

    fp8_postfixes: ClassVar[tuple[str, ...]] = ("",)

    def in_features(self, x: Array) -> tuple[int, ...]:
        check.check_input(x, f"{type(self).__name__}'s input")
        check_last_axis(self.axis, x)
        return (x.shape[-1],)

    def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]:
        hidden = in_features[-1]
        features = _features(self.features)
        params: list[ParamRecord] = []
        if self.enable_layernorm:
            params += self.fused_norm_params(hidden)
        kernel_init = flat_fan_in(self.kernel_init or default_kernel_init(), 1)
        params.append(param("kernel", (hidden, *features), kernel_init, self.kernel_axes))
        if self.use_bias:
            params.append(param("bias", features, self.bias_init, self.bias_axes))
        return params + self.lora_params("", (hidden,), features, self.kernel_init)

    def __call__(self, inputs: Array) -> tuple[Array, Array | None]:
        """``[batch..., hidden]`` -> ``([batch..., *features], ln_output or None)``."""
        with self.host().variables(inputs) as (params, sets):
            return self.forward(params, inputs, sets)

    def forward(
        self,
        params: Params,
        x: Array,
        quantizer_sets: Sequence[QuantizerSet],
        dropout: Dropout = None,
    ) -> tuple[Array, Array | None]:
        x = compute_input(x, self.dtype)
        check_last_axis(self.axis, x)
        quantizer_sets = named_sets(quantizer_sets, self.quantization_checkpoint_name)
        gemm: dict[str, Any] = dict(
            kernel=params["kernel"],
            bias=params.get("bias"),
            transpose_batch_sequence=self.transpose_batch_sequence,
            kernel_axes=self.kernel_axes or None,
            quantizer_set=quantizer_sets[0],
        )
        needs_norm_output = self.return_layernorm_output or self.enable_low_rank_adaptation
        if not self.enable_layernorm:
            # TE's convention: without a norm, the "norm output" is the input itself.
            out, ln = dense(x, **gemm, input_axes=self.dot_input_axes), x
        elif needs_norm_output:
            out, ln = layernorm_dense_with_norm_output(x, **gemm, **self._fused_norm(params))
        else:
            out, ln = layernorm_dense(x, **gemm, **self._fused_norm(params)), None
        out = self.with_lora(out, ln, params, "", 1)
        if self.depth_scaling is not None:
            out = out / jnp.asarray(self.depth_scaling, out.dtype)
        return out, ln if self.return_layernorm_output else None

    def _fused_norm(self, params: Params) -> dict[str, Any]:
        return dict(
            **self.norm_arguments(params),
            layernorm_input_axes=self.layernorm_input_axes,
            dot_input_axes=self.dot_input_axes,
        )


# ----------------------------------------------------------------------------- LayerNormMLP


def _fused_gradient_quantizers(
    set_1: QuantizerSet, set_2: QuantizerSet
) -> tuple[QuantizerSet, QuantizerSet]:
    """The two GEMMs' sets for the composed path, quantizing gradients as the fused op does.

    The fused ``layernorm_mlp`` (like TransformerEngine's) quantizes the layer's output gradient
    with the first set's gradient quantizer and the activation gradient with the second's; each
    ``dense`` op quantizes its own output gradient with its own set. Exchanging the gradient
    quantizers keeps ``grad_0_*`` / ``grad_1_*`` one meaning on every path.
    """
    return (
        dataclasses.replace(set_1, dgrad=set_2.dgrad),
        dataclasses.replace(set_2, dgrad=set_1.dgrad),
    )


@dataclasses.dataclass
class LayerNormMLPDescription(Layer, FusedNorm, LowRank, Fp8Layer):
    """Norm, GEMM 1, (gated) activation, dropout, GEMM 2; returns ``(out, norm output or None)``."""

    # TransformerEngine's fields, in its order.
    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ("embed",)
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ("embed",)
    kernel_init: Initializer | None = None
    kernel_axes_1: tuple[str | None, ...] = ("embed", "act", "mlp")
    kernel_axes_2: tuple[str | None, ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = zeros
    bias_axes_1: tuple[str | None, ...] = ("act", "mlp")
    bias_axes_2: tuple[str | None, ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Sequence[str] = ("gelu",)
    activation_params: dict[str, float] | None = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    axis: int = -1
    dtype: Any = None
    layernorm_input_axes: tuple[str | None, ...] | None = None
    dot_1_input_axes: tuple[str | None, ...] | None = None
    dot_2_input_axes: tuple[str | None, ...] | None = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: str | None = None
    # te_flax's.
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None

    fp8_postfixes: ClassVar[tuple[str, ...]] = ("_0", "_1")

    def in_features(self, x: Array) -> tuple[int, ...]:
        check.check_input(x, f"{type(self).__name__}'s input")
        check_last_axis(self.axis, x)
        return (x.shape[-1],)

    def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]:
        hidden = in_features[-1]
        n_act = len(self._activation()[0])
        intermediate = self.intermediate_dim
        check.check_positive_int(intermediate, "intermediate_dim")
        check.check_rate(self.intermediate_dropout_rate, "intermediate_dropout_rate")
        kernel_init = self.kernel_init or default_kernel_init()
        params: list[ParamRecord] = []
        if self.enable_layernorm:
            params += self.fused_norm_params(hidden)
        params += [
            param(
                "wi_kernel",
                (hidden, n_act, intermediate),
                _per_activation(kernel_init),
                self.kernel_axes_1,
            ),
            param("wo_kernel", (intermediate, hidden), kernel_init, self.kernel_axes_2),
        ]
        if self.use_bias:
            params += [
                param("wi_bias", (n_act, intermediate), self.bias_init, self.bias_axes_1),
                param("wo_bias", (hidden,), self.bias_init, self.bias_axes_2),
            ]
        return (
            params
            + self.lora_params("wi_", (hidden,), (n_act, intermediate), self.kernel_init)
            + self.lora_params("wo_", (intermediate,), (hidden,), self.kernel_init)
        )

    def __call__(self, inputs: Array, deterministic: bool = False) -> tuple[Array, Array | None]:
        """``[batch..., hidden]`` -> ``([batch..., hidden], ln_output or None)``.

        ``deterministic=True`` turns the intermediate dropout off.
        """
        host = self.host()
        dropout = None  # the key the fused op draws the dropout mask from
        if self.intermediate_dropout_rate > 0 and not deterministic:
            dropout = host.rng(self.intermediate_dropout_rng_name)
        with host.variables(inputs) as (params, sets):
            return self.forward(params, inputs, sets, dropout)

    def forward(
        self,
        params: Params,
        x: Array,
        quantizer_sets: Sequence[QuantizerSet],
        dropout: Dropout = None,
    ) -> tuple[Array, Array | None]:
        """``dropout``: the intermediate dropout's key, None when the dropout is off (rate 0 or
        deterministic).

        Every configuration with the norm runs the one fused ``layernorm_mlp`` op: the dropout
        mask is drawn inside it from the key, LoRA and the norm output are part of it.
        """
        x = compute_input(x, self.dtype)
        check_last_axis(self.axis, x)
        activation_type, activation_params = self._activation()
        set_1, set_2 = named_sets(quantizer_sets, self.quantization_checkpoint_name)[:2]
        rate = 0.0 if dropout is None else self.intermediate_dropout_rate
        lora = None
        if self.enable_low_rank_adaptation:
            lora = tuple(
                params[f"{gemm}_lora_{part}_kernel"] for gemm in ("wi", "wo") for part in "ab"
            )
        if not self.enable_layernorm:
            out, ln = self._without_norm(
                params, x, (set_1, set_2), activation_type, activation_params, dropout, rate
            )
            return out, ln if self.return_layernorm_output else None
        arguments: dict[str, Any] = dict(
            **self.norm_arguments(params),
            kernels=[params["wi_kernel"], params["wo_kernel"]],
            biases=[params.get("wi_bias"), params.get("wo_bias")],
            transpose_batch_sequence=self.transpose_batch_sequence,
            norm_input_axes=self.layernorm_input_axes,
            dot_1_input_axes=self.dot_1_input_axes,
            dot_2_input_axes=self.dot_2_input_axes,
            kernel_1_axes=self.kernel_axes_1 or None,
            kernel_2_axes=self.kernel_axes_2 or None,
            ffn1_ckpt_name=self.ffn1_ckpt_name,
            ffn2_ckpt_name=self.ffn2_ckpt_name,
            activation_type=activation_type,
            activation_params=self.activation_params,
            quantizer_sets=(set_1, set_2),
            intermediate_dropout_rate=rate,
            intermediate_dropout_rng=dropout,
            intermediate_dropout_dims=tuple(self.intermediate_hidden_dropout_dims),
            low_rank_adaptation_kernels=lora,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
        )
        if self.return_layernorm_output:
            return layernorm_mlp_with_norm_output(x, **arguments)
        return layernorm_mlp(x, **arguments), None

    def _activation(self) -> tuple[tuple[str, ...], ClampedSwigluParams | None]:
        """The canonical activation type and its parameters (checked)."""
        activation_type = canonical_activation_type(self.activations)
        return activation_type, canonical_activation_params(activation_type, self.activation_params)

    def _without_norm(
        self,
        params: Params,
        x: Array,
        quantizer_sets: tuple[QuantizerSet, QuantizerSet],
        activation_type: tuple[str, ...],
        activation_params: ClampedSwigluParams | None,
        dropout: Dropout,
        rate: float,
    ) -> tuple[Array, Array]:
        """Without the norm (``enable_layernorm=False``, which TransformerEngine does not fuse
        either): two ``dense`` ops around the activation; the norm output is the input."""
        set_1, set_2 = _fused_gradient_quantizers(*quantizer_sets)
        pre_activation = dense(
            x,
            params["wi_kernel"],
            params.get("wi_bias"),
            transpose_batch_sequence=self.transpose_batch_sequence,
            input_axes=self.dot_1_input_axes,
            kernel_axes=self.kernel_axes_1 or None,
            quantizer_set=set_1,
        )
        # [batch..., hidden] -> [batch..., n_act, intermediate]
        pre_activation = self.with_lora(pre_activation, x, params, "wi_", 1)
        pre_activation = checkpoint_name(pre_activation, self.ffn1_ckpt_name)
        # [batch..., n_act, intermediate] -> [batch..., intermediate]
        activated = activation_forward(pre_activation, activation_type, activation_params)
        if dropout is not None and rate > 0:
            mask = dropout_mask(
                activated.shape, rate, tuple(self.intermediate_hidden_dropout_dims), dropout
            )
            activated = apply_dropout(activated, mask, rate)
        out = dense(
            activated,
            params["wo_kernel"],
            params.get("wo_bias"),
            transpose_batch_sequence=self.transpose_batch_sequence,
            input_axes=self.dot_2_input_axes,
            kernel_axes=self.kernel_axes_2 or None,
            quantizer_set=set_2,
        )
        out = self.with_lora(out, activated, params, "wo_", 1)
        return checkpoint_name(out, self.ffn2_ckpt_name), x
