"""``MoEBlock``, Linen style: the mixture-of-experts block of ``te_flax._layers.moe``."""

from __future__ import annotations

import flax.linen as nn  # noqa: F401  (the example uses it)

from te_flax._layers.moe import MoEBlockDescription
from te_flax.linen._base import TransformerEngineBase
from te_flax.linen._shell import LinenShell

__all__ = ["MoEBlock"]


class MoEBlock(LinenShell, TransformerEngineBase, MoEBlockDescription):
    """A mixture of ``num_experts`` gated MLPs, ``num_experts_per_tok`` of them per token.

    ``probs = topk(score_function(norm(x) . gate_kernel))`` in float32, then
    ``y = sum_k probs[k] * wo[e_k] . act(norm(x) . wi[e_k])`` over each token's chosen experts
    ``e_k``. Returns ``(y, aux_loss)``: ``y`` has x's shape and dtype, ``aux_loss`` is the
    load-balancing loss times ``aux_loss_coeff`` (float32; 0 when the coefficient is 0), to be
    added to the training loss. The expert GEMMs are ``grouped_dense``, FP8 under a recipe with
    one scale per expert (delayed-scaling variables ``{x,kernel,grad}_{0,1}_*`` of shape
    ``[num_experts, ...]``). With a mesh and logical axis rules that map ``"exp"`` to a mesh
    axis, the experts are split over it (expert parallelism, ``configs/rules/ep.yaml``).
    Each call sows ``aux_loss``, ``tokens_per_expert`` (``[E]``) and ``tokens_dropped`` into
    the ``"intermediates"`` collection (a ``TransformerLayer`` with ``moe=`` returns only its
    output: add the sown ``aux_loss`` to the training loss).

    Attributes:
      num_experts: the experts (default 8).
      num_experts_per_tok: top-k, 1 to ``num_experts`` (default 2).
      intermediate_dim: each expert's hidden size (default 2048).
      activations: ``("silu", "linear")`` (SwiGLU, default) or another (gated) activation, as
        in ``LayerNormMLP``; ``activation_params`` for the clamped SwiGLU.
      score_function, use_pre_softmax, num_groups, group_topk, scaling_factor: the router, as
        ``te_flax.router.fused_topk_with_score_function`` (defaults ``"softmax"``, False, None,
        None, 1.0).
      use_expert_routing_bias, expert_bias_init: an ``expert_bias [E]`` that moves the choice
        only (sigmoid or sqrtsoftplus; DeepSeek-V3's aux-loss-free balancing, updated by
        ``te_flax.router.update_expert_bias`` from the sown ``tokens_per_expert``).
      aux_loss_coeff: the load-balancing loss coefficient (default 0.0).
      capacity_factor: rows per expert ``ceil(tokens * k / E * capacity_factor)``; the
        assignments past it are dropped (weight 0); None (default) is dropless.
      drop_policy: ``"probs"`` (default: keep the most probable) or ``"position"`` (the first).
      fp8_dispatch: under expert parallelism and an FP8 recipe, the tokens travel to their
        experts' devices as float8 on the scales the expert GEMMs quantize them with, about
        half the bytes of BF16, and come back in the compute dtype (default True;
        docs/moe.md). False sends them in the compute dtype (NVFP4: one device's numerics).
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: an optional pre-norm (default off), as in ``LayerNormMLP``.
      kernel_init: each kernel's initializer (None: TE's variance scaling, per expert).
      gate_kernel_axes, wi_kernel_axes, wo_kernel_axes: logical axes (defaults
        ``("embed", None)``, ``("exp", "embed", "act", "mlp")``, ``("exp", "mlp", "embed")``).
      use_bias, bias_init, wi_bias_axes, wo_bias_axes: per-expert biases ``wi_bias [E, n_act,
        F]`` and ``wo_bias [E, H]`` (default off).
      axis (only -1), dtype, param_dtype, recipe: as in the other modules.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> import te_flax.linen as te_nn
      >>> moe = te_nn.MoEBlock(num_experts=4, intermediate_dim=16, aux_loss_coeff=1e-2)
      >>> (y, aux_loss), variables = moe.init_with_output(jax.random.key(0), jnp.ones((2, 3, 8)))
      >>> y.shape, aux_loss.shape
      ((2, 3, 8), ())
      >>> jax.tree.map(jnp.shape, nn.meta.unbox(variables["params"]))
      {'gate_kernel': (8, 4), 'wi_kernel': (4, 8, 2, 16), 'wo_kernel': (4, 16, 8)}
    """
