"""The mixture-of-experts block's framework-neutral description, shared by the Linen and NNX
shells (``te_flax.linen.MoEBlock``, ``te_flax.nnx.MoEBlock``).

An optional pre-norm, the router (``te_flax.router``: a float32 gate GEMM, top-k, the
aux loss, the capacity), the permutation (``te_flax.permutation``), two grouped GEMMs
(``te_flax.dense.grouped_dense``) around a (gated) activation, and the weighted combine. With
a mesh whose axis the logical name ``"exp"`` maps to, the experts are split over that axis
and the tokens travel to them by ``all_to_all`` (``te_flax._parallel.experts``).

Why one ``wi_kernel [E, hidden, n_act, intermediate]`` rather than TransformerEngine's split
``wi_0`` / ``wi_1``: it is LayerNormMLP's ``wi_kernel`` with an expert axis in front, so a
dense MLP's kernel (or a checkpoint's) becomes an expert's by indexing, the gated activation
is the same stage as LayerNormMLP's, and both halves are one grouped GEMM: the tokens are
quantized and read once and each expert's FP8 scale covers the whole projection, as in
LayerNormMLP. TE's private MoE block stores the two halves contiguously for the same reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import PartitionSpec

from te_flax._base import checks as check
from te_flax._layers.base import (
    Dropout,
    Fp8Layer,
    FusedNorm,
    Initializer,
    ParamRecord,
    Params,
    compute_input,
    default_kernel_init,
    param,
    zeros,
)
from te_flax._layers.host import Layer
from te_flax._ops.activations import (
    canonical_activation_params,
    canonical_activation_type,
)
from te_flax._parallel.experts import (
    Routed,
    RoutingStats,
    check_expert_count,
    expert_parallel_forward,
    expert_parallel_size,
    shards_the_tokens,
)
from te_flax.dense import grouped_dense, grouped_dense_activated
from te_flax.layernorm import layernorm
from te_flax.permutation import (
    pure_jax_token_combine,
    pure_jax_token_dispatch,
    routing_map_to_selected_experts,
)
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.inspection import without_slots
from te_flax.router import (
    aux_loss_from_totals,
    drop_over_capacity,
    expert_capacity,
    fused_topk_with_score_function,
)
from te_flax.sharding import explicit_axes, on_auto_axes, spec_of, with_logical_constraint

__all__ = ["MoEBlockDescription", "RoutingStats"]


def _per_expert(init: Initializer, n_in: int) -> Initializer:
    """For ``[E, in, ...]``: each expert's kernel initialised on its own ``[in, out]`` shape
    (fan-in the input features, not the experts)."""

    def init_experts(key: Array, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        experts, rest = shape[0], tuple(shape[1:])
        flat = (math.prod(rest[:n_in]), math.prod(rest[n_in:]))
        keys = jax.random.split(key, experts)
        return jnp.stack([init(k, flat, dtype).reshape(rest) for k in keys])

    return init_experts


@dataclasses.dataclass
class MoEBlockDescription(Layer, FusedNorm, Fp8Layer):
    """Router, ``num_experts`` gated MLPs and the weighted combine; returns ``(out, aux_loss)``."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    intermediate_dim: int = 2048
    activations: Sequence[str] = ("silu", "linear")
    activation_params: dict[str, float] | None = None
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    use_expert_routing_bias: bool = False
    expert_bias_init: Initializer = zeros
    aux_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    fp8_dispatch: bool = True
    enable_layernorm: bool = False
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ("embed",)
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ("embed",)
    kernel_init: Initializer | None = None
    gate_kernel_axes: tuple[str | None, ...] = ("embed", None)
    wi_kernel_axes: tuple[str | None, ...] = ("exp", "embed", "act", "mlp")
    wo_kernel_axes: tuple[str | None, ...] = ("exp", "mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = zeros
    wi_bias_axes: tuple[str | None, ...] = ("exp", "act", "mlp")
    wo_bias_axes: tuple[str | None, ...] = ("exp", "embed")
    axis: int = -1
    dtype: Any = None
    param_dtype: Any = jnp.float32
    recipe: Recipe | None = None

    fp8_postfixes: ClassVar[tuple[str, ...]] = ("_0", "_1")

    # ------------------------------------------------------------------ description

    def in_features(self, x: Array) -> tuple[int, ...]:
        if self.axis not in (-1, x.ndim - 1):
            raise ValueError(f"axis={self.axis!r} is not supported: MoEBlock reads the last axis")
        return (x.shape[-1],)

    def _check(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "intermediate_dim"):
            check.check_positive_int(getattr(self, name), name)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) is larger than num_experts "
                f"({self.num_experts}): a token cannot pick more distinct experts than there "
                "are; lower num_experts_per_tok or add experts"
            )
        if self.use_expert_routing_bias and self.score_function == "softmax":
            raise ValueError(
                "use_expert_routing_bias needs score_function='sigmoid' or 'sqrtsoftplus' (the "
                "bias moves the choice of experts, as in DeepSeek-V3), got 'softmax'"
            )
        check_expert_count(self.num_experts)

    def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]:
        self._check()
        hidden, experts = in_features[-1], self.num_experts
        n_act, intermediate = len(self._activation()[0]), self.intermediate_dim
        kernel_init = self.kernel_init or default_kernel_init()
        params: list[ParamRecord] = []
        if self.enable_layernorm:
            params += self.fused_norm_params(hidden)
        params += [
            param("gate_kernel", (hidden, experts), kernel_init, self.gate_kernel_axes),
            param(
                "wi_kernel",
                (experts, hidden, n_act, intermediate),
                _per_expert(kernel_init, 1),
                self.wi_kernel_axes,
            ),
            param(
                "wo_kernel",
                (experts, intermediate, hidden),
                _per_expert(kernel_init, 1),
                self.wo_kernel_axes,
            ),
        ]
        if self.use_bias:
            params += [
                param("wi_bias", (experts, n_act, intermediate), self.bias_init, self.wi_bias_axes),
                param("wo_bias", (experts, hidden), self.bias_init, self.wo_bias_axes),
            ]
        if self.use_expert_routing_bias:
            params.append(param("expert_bias", (experts,), self.expert_bias_init, ("exp",)))
        return params

    def _activation(self) -> tuple[tuple[str, ...], Any]:
        activation_type = canonical_activation_type(self.activations)
        return activation_type, canonical_activation_params(activation_type, self.activation_params)

    @property
    def fp8_groups(self) -> int | None:
        """The two grouped GEMMs keep one FP8 state per expert (``[E, history]``)."""
        return self.num_experts

    # ------------------------------------------------------------------ forward

    def __call__(self, inputs: Array) -> tuple[Array, Array]:
        """``[batch..., hidden]`` -> ``([batch..., hidden], aux_loss [])``; reports
        ``aux_loss``, ``tokens_per_expert`` and ``tokens_dropped`` (``host.sow``)."""
        host = self.host()
        with host.variables(inputs) as (params, sets):
            (out, aux_loss), stats = self.forward(params, inputs, sets)
        host.sow("aux_loss", aux_loss)
        host.sow("tokens_per_expert", stats.tokens_per_expert)
        host.sow("tokens_dropped", stats.tokens_dropped)
        return out, aux_loss

    def forward(
        self,
        params: Params,
        x: Array,
        quantizer_sets: Sequence[QuantizerSet],
        dropout: Dropout = None,
    ) -> tuple[tuple[Array, Array], RoutingStats]:
        """``[batch..., hidden]`` -> ``((out [batch..., hidden], aux_loss []), stats)``."""
        self._check()
        x = compute_input(x, self.dtype)
        self.in_features(x)
        kernel_axes = (self.wi_kernel_axes, self.wo_kernel_axes)
        if expert_parallel_size() > 1 or shards_the_tokens(x, kernel_axes):
            params = self._as_stored(params, x)
            # te_flax.inspect_fp8(): the per-device experts' statistics have no slot here.
            sets = without_slots(tuple(quantizer_sets))
            return expert_parallel_forward(self, params, x, sets)
        if not explicit_axes():
            return self._forward_tokens(params, x, tuple(quantizer_sets))
        # On Explicit mesh axes the routing (a sort, histograms, scatters over every token) runs
        # with them as Auto, partitioned by XLA as on an Auto mesh (sharding.on_auto_axes).
        scalar = PartitionSpec()
        out_specs = ((spec_of(x), scalar), RoutingStats._make((scalar, scalar)))
        return on_auto_axes(self._forward_tokens, out_specs, params, x, tuple(quantizer_sets))

    def _as_stored(self, params: Params, x: Array) -> Params:
        """Each parameter constrained to its logical axes, so that its gradient leaves the
        experts' ``shard_map`` sharded as the parameter is stored (an FSDP kernel's gradient
        reduce-scattered, not all-reduced; on Auto axes XLA would choose)."""
        axes = {record.name: record.axes for record in self.param_records(self.in_features(x))}
        return {name: with_logical_constraint(value, axes[name]) for name, value in params.items()}

    def _forward_tokens(
        self, params: Params, x: Array, quantizer_sets: tuple[QuantizerSet, ...]
    ) -> tuple[tuple[Array, Array], RoutingStats]:
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        routed = self.route(params, tokens)
        capacity = self.capacity(tokens.shape[0])
        if capacity is not None:
            selected, weights = drop_over_capacity(
                routed.selected, routed.weights, self.num_experts, capacity, self.drop_policy
            )
            routed = routed._replace(selected=selected, weights=weights)
        out, stats = self.experts_and_combine(params, routed, quantizer_sets, capacity)
        return (out.reshape(x.shape), routed.aux_loss), stats

    def capacity(self, num_tokens: int) -> int | None:
        """Rows per expert for ``num_tokens`` tokens (None: dropless)."""
        return expert_capacity(
            num_tokens, self.num_experts, self.num_experts_per_tok, self.capacity_factor
        )

    def route(self, params: Params, tokens: Array, token_axes: Any = None) -> Routed:
        """Norm, float32 gate GEMM, top-k and aux loss for ``tokens [T, H]``.

        ``token_axes``: inside ``shard_map``, the mesh axes the tokens are split over; the
        aux loss then sums its statistics over them, so that it is the whole batch's.
        """
        if self.enable_layernorm:
            tokens = layernorm(tokens, **self.norm_arguments(params))
        # The router runs in float32 (TE promotes the logits before its top-k kernel): a
        # bfloat16 logit cannot separate nearby experts, and the choice is discontinuous.
        logits = jnp.matmul(
            tokens.astype(jnp.float32),
            params["gate_kernel"].astype(jnp.float32),
            precision=lax.Precision.HIGHEST,
        )  # [T, H] x [H, E] -> [T, E]
        k = self.num_experts_per_tok
        num_groups, group_topk = self.num_groups, self.group_topk
        grouped = num_groups is not None and group_topk is not None
        probs, routing_map = fused_topk_with_score_function(
            logits,
            k,
            use_pre_softmax=self.use_pre_softmax,
            num_groups=num_groups if num_groups is not None and grouped else -1,
            group_topk=group_topk if group_topk is not None and grouped else -1,
            scaling_factor=self.scaling_factor,
            score_function=self.score_function,
            expert_bias=params.get("expert_bias"),
        )
        selected, weights = routing_map_to_selected_experts(probs, routing_map, k)
        aux_loss = jnp.zeros((), jnp.float32)
        if self.aux_loss_coeff > 0:
            scores, aux_map = fused_topk_with_score_function(
                logits, k, score_function=self.score_function, compute_aux_scores=True
            )
            score_sums, counts = jnp.sum(scores, 0), jnp.sum(aux_map, 0)  # [E], [E]
            num_tokens = tokens.shape[0]
            if token_axes is not None:
                score_sums = lax.psum(score_sums, token_axes)
                counts = lax.psum(counts, token_axes)
                num_tokens = num_tokens * lax.psum(1, token_axes)
            aux_loss = aux_loss_from_totals(score_sums, counts, num_tokens, k, self.aux_loss_coeff)
        return Routed(tokens, selected, weights, aux_loss)

    def expert_ffn(
        self,
        params: Params,
        rows: Array,
        group_sizes: Array,
        quantizer_sets: Sequence[QuantizerSet],
        capacity: int | None,
    ) -> Array:
        """The experts' gated MLPs on ``rows [M, H]`` sorted by expert -> ``[M, H]``."""
        wi, wo = params["wi_kernel"], params["wo_kernel"]
        experts, hidden, n_act, intermediate = wi.shape
        activation_type, activation_params = self._activation()
        grouped: dict[str, Any] = dict(
            lowering="capacity" if capacity is not None else "ragged", capacity=capacity
        )
        wi_bias = params.get("wi_bias")
        # [M, H] x [E, H, n_act * F] -> [M, F]: the activation in float32, rounded once; its
        # backward from the pre-activation alone (no residual), quantized in one pass on a GPU.
        activated = grouped_dense_activated(
            rows,
            wi.reshape(experts, hidden, n_act * intermediate),
            group_sizes,
            activation_type,
            activation_params,
            bias=None if wi_bias is None else wi_bias.reshape(experts, n_act * intermediate),
            quantizer_set=quantizer_sets[0],
            **grouped,
        )
        return grouped_dense(
            activated.astype(rows.dtype),
            wo,
            group_sizes,
            bias=params.get("wo_bias"),
            quantizer_set=quantizer_sets[1],
            **grouped,
        )  # [M, F] x [E, F, H] -> [M, H]

    def experts_and_combine(
        self,
        params: Params,
        routed: Routed,
        quantizer_sets: Sequence[QuantizerSet],
        capacity: int | None,
    ) -> tuple[Array, RoutingStats]:
        """Dispatch, the expert MLPs and the weighted combine on one device: ``[T, H]``."""
        k, tokens = self.num_experts_per_tok, routed.tokens
        rows, perm_state, group_sizes = pure_jax_token_dispatch(
            tokens, routed.selected, self.num_experts, k
        )  # [T * k, H], sorted by expert
        expert_out = self.expert_ffn(params, rows, group_sizes, quantizer_sets, capacity)
        out = pure_jax_token_combine(
            expert_out, perm_state, routed.weights, k, 1, tokens.shape[0]
        )  # [1, T, H]
        return out[0], self.stats(routed.selected)

    def stats(self, selected: Array, token_axes: Any = None) -> RoutingStats:
        counts = jnp.sum(
            selected.reshape(-1)[:, None] == jnp.arange(self.num_experts)[None, :], axis=0
        ).astype(jnp.int32)  # [E]
        dropped = jnp.sum(selected == self.num_experts).astype(jnp.int32)
        if token_axes is not None:
            counts, dropped = lax.psum(counts, token_axes), lax.psum(dropped, token_axes)
        return RoutingStats(lax.stop_gradient(counts), lax.stop_gradient(dropped))
