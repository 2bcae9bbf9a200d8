"""The Linen modules: TransformerEngine's attributes, parameter names and FP8 variable names.

Each module is its layer description (``te_flax._layers.linear``: attributes, parameters and the
call) run by the Linen shell, which creates the variables. Parameters carry logical axis names
(``nn.with_logical_partitioning``); FP8 state lives in the ``_overwrite_with_gradient``
collection, whose "gradient" is its new value (``te_flax.training`` applies it): differentiate
the whole variable dict, as a gradient of the ``params`` alone is refused.

Common attributes: ``dtype`` is the compute dtype (None: the input's), ``param_dtype`` the
storage dtype (default float32; FP8 kernels are quantized from it), ``recipe`` the FP8 recipe
(None: the one of the active ``te_flax.autocast``, or no FP8). The block-scaled recipes
(``MXFP8BlockScaling``, ``NVFP4BlockScaling``) keep no variables; NVFP4 with stochastic rounding
draws a key from the ``"sr_rng"`` RNG stream at every call (``rngs={"sr_rng": key}``).
"""

from __future__ import annotations

import flax.linen as nn  # noqa: F401  (the examples use it)

from te_flax._layers.linear import (
    DenseGeneralDescription,
    LayerNormDenseGeneralDescription,
    LayerNormDescription,
    LayerNormMLPDescription,
)
from te_flax.linen._base import TransformerEngineBase
from te_flax.linen._shell import LinenShell

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]


class LayerNorm(LinenShell, TransformerEngineBase, LayerNormDescription):
    """Layernorm or rmsnorm over the last axis, computed in float32.

    ``y = (x - mean) / sqrt(var + epsilon) * scale + ln_bias`` (layernorm) or
    ``y = x / sqrt(mean(x**2) + epsilon) * scale`` (rmsnorm); ``1 + scale`` with
    ``zero_centered_gamma``.

    Attributes:
      epsilon: added before the square root (default 1e-6).
      layernorm_type: ``"layernorm"`` (default) or ``"rmsnorm"``.
      zero_centered_gamma: multiply by ``1 + scale``; ``scale`` then starts at 0 (default False).
      scale_init, scale_axes: initializer (None: ones, or zeros when zero-centered) and logical
        axes (default ``("embed",)``) of ``scale``.
      bias_init, bias_axes: the same for ``ln_bias`` (layernorm only).
      dtype, param_dtype: compute and storage dtypes.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> layer = te_nn.LayerNorm(layernorm_type="rmsnorm")
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables))
      {'params': {'scale': (8,)}}
    """


class DenseGeneral(LinenShell, TransformerEngineBase, DenseGeneralDescription):
    """``y = x . kernel + bias``, contracting the trailing ``axis`` of x, FP8 under a recipe.

    Attributes:
      features: output size, an int or a tuple (a multi-axis kernel ``[in..., *features]``).
      kernel_init, kernel_axes: kernel initializer (None: variance scaling 1.0, fan-in,
        truncated normal; called on the flattened ``[fan_in, fan_out]`` shape) and logical axes.
      use_bias, bias_init, bias_axes: the bias ``[*features]`` (default on, as in TE).
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
        (``lora_a_kernel``, ``lora_b_kernel``; the update is scaled by alpha / dim).
      axis: the input axes to contract, trailing and in order (default -1).
      input_axes: logical axes of the input, for its sharding constraint.
      transpose_batch_sequence: the input is ``[seq, batch, ...]`` (changes no math).
      dtype, param_dtype, recipe: see the module docstring.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax, te_flax.linen as te_nn
      >>> layer = te_nn.DenseGeneral(features=(2, 4), kernel_axes=("embed", "heads", "kv"))
      >>> with te_flax.autocast(enabled=True):
      ...     variables = layer.init(jax.random.key(0), jnp.ones((3, 8)))
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables))["params"]
      {'bias': (2, 4), 'kernel': (8, 2, 4)}
      >>> sorted(variables["_overwrite_with_gradient"])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """


class LayerNormDenseGeneral(LinenShell, TransformerEngineBase, LayerNormDenseGeneralDescription):
    """A norm over the last axis fused with the GEMM that follows it.

    Returns ``(y, ln_output)``: ``y = norm(x) . kernel (+ bias)``, divided by ``depth_scaling``
    when set, and the norm output when ``return_layernorm_output`` (else None). The fused
    ``layernorm_dense`` op is used whenever the norm is enabled, FP8 or not.

    Attributes:
      features: output size, an int or a tuple.
      enable_layernorm: apply the norm (default True); without it this is a DenseGeneral.
      layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes, ln_bias_init,
        ln_bias_axes: the norm, as in ``LayerNorm``.
      kernel_init, kernel_axes, use_bias (default False), bias_init, bias_axes: the GEMM.
      return_layernorm_output: also return the norm output (default False).
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA,
        applied to the norm output (the main GEMM's input).
      axis: only -1 is supported.
      layernorm_input_axes, dot_input_axes: logical axes of the input and of the GEMM input.
      depth_scaling: divide the output by this (default None).
      transpose_batch_sequence, dtype, param_dtype, recipe: see the module docstring.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> layer = te_nn.LayerNormDenseGeneral(features=(3, 2, 4), return_layernorm_output=True)
      >>> (y, ln), variables = layer.init_with_output(jax.random.key(0), jnp.ones((5, 8)))
      >>> y.shape, ln.shape
      ((5, 3, 2, 4), (5, 8))
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables))
      {'params': {'kernel': (8, 3, 2, 4), 'ln_bias': (8,), 'scale': (8,)}}
    """


class LayerNormMLP(LinenShell, TransformerEngineBase, LayerNormMLPDescription):
    """Norm, GEMM 1 (``wi_kernel``), (gated) activation, dropout, GEMM 2 (``wo_kernel``).

    Returns ``(y, ln_output or None)``. With the norm, every configuration (the intermediate
    dropout, LoRA, the norm output) runs the one fused ``layernorm_mlp`` op.

    Attributes:
      intermediate_dim: the hidden size of the MLP (default 2048).
      activations: ``("gelu",)`` (default) or another activation, or a gated pair such as
        ``("silu", "linear")`` (SwiGLU); ``wi_kernel`` is ``[hidden, len(activations),
        intermediate_dim]``.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the norm, as in ``LayerNorm``.
      kernel_init, kernel_axes_1 (default ``("embed", "act", "mlp")``), kernel_axes_2
        (``("mlp", "embed")``), use_bias (default False), bias_init, bias_axes_1
        (``("act", "mlp")``), bias_axes_2 (``("embed",)``): the two GEMMs.
      intermediate_dropout_rate, intermediate_dropout_rng_name, intermediate_hidden_dropout_dims:
        dropout of the activation output (rate 0 by default; broadcast over the given dims).
      return_layernorm_output: also return the norm output.
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA on
        both GEMMs (``wi_lora_*``, ``wo_lora_*``), each on its GEMM's own input.
      layernorm_input_axes, dot_1_input_axes, dot_2_input_axes: logical axes of the input and
        of the two GEMM inputs.
      ffn1_ckpt_name, ffn2_ckpt_name: checkpoint names of the pre-activation and the output.
      axis (only -1), transpose_batch_sequence, dtype, param_dtype, recipe: as above.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> mlp = te_nn.LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"))
      >>> (y, _), variables = mlp.init_with_output(jax.random.key(0), jnp.ones((2, 4, 8)))
      >>> y.shape
      (2, 4, 8)
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables))["params"]
      {'ln_bias': (8,), 'scale': (8,), 'wi_kernel': (8, 2, 32), 'wo_kernel': (32, 8)}
    """
