"""Mixture-of-experts routing in plain JAX: scores, top-k, the aux loss and the capacity.

TransformerEngine's ``transformer_engine.jax.router`` names and signatures
(``fused_topk_with_score_function``, ``fused_moe_aux_loss``, ``ScoreFunction``,
``RoutingMapFormat``), computed with ``lax.top_k`` and elementwise XLA ops instead of CUDA
kernels, so they run on every backend and differentiate with JAX's own rules; plus what TE's
router leaves to the caller: the expert capacity and dropping the tokens over it, and the
aux-loss-free balancing update of the expert bias (DeepSeek-V3).

Scores are computed in float32, as TE's kernels compute them (the logits are promoted first).
Selection never differentiates: the gradient reaches the logits through the selected scores
only, and the expert bias, which only moves the selection, gets none (as in TE).
"""

from __future__ import annotations

import enum
import math
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import Array

__all__ = [
    "RoutingMapFormat",
    "ScoreFunction",
    "aux_loss_from_totals",
    "drop_over_capacity",
    "expert_capacity",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "update_expert_bias",
]


class ScoreFunction(enum.IntEnum):
    """How router logits become scores (TransformerEngine's enum and values)."""

    SIGMOID = 0
    SOFTMAX = 1
    SQRTSOFTPLUS = 2


class RoutingMapFormat(enum.IntEnum):
    """The routing map's layout: ``bool [T, E]`` or LSB-first bits ``uint8 [T, ceil(E / 8)]``."""

    BYTEMAP = 0
    BITMAP_U8 = 1


_E = TypeVar("_E", bound=enum.IntEnum)


def _enum(value: object, kind: type[_E], what: str) -> _E:
    if isinstance(value, kind):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return kind(value)
        except ValueError:
            pass
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    names = ", ".join(repr(name.lower()) for name in kind.__members__)
    raise ValueError(f"{what} must be one of {names} (or a {kind.__name__}), got {value!r}")


def _check_topk(topk: object, num_experts: int, what: str = "topk") -> int:
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= num_experts:
        raise ValueError(
            f"{what} must be an int from 1 to the number of experts ({num_experts}), got "
            f"{topk!r}: a token cannot pick more distinct experts than there are; lower {what} "
            "or add experts"
        )
    return topk


def _scores(logits: Array, score_function: ScoreFunction) -> Array:
    logits = logits.astype(jnp.float32)  # float32 scores, as TE's kernels compute them
    if score_function == ScoreFunction.SOFTMAX:
        return jax.nn.softmax(logits, axis=-1)
    if score_function == ScoreFunction.SIGMOID:
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def _grouped_choice(choice: Array, topk: int, num_groups: int, group_topk: int) -> Array:
    """``choice`` with the experts outside each token's ``group_topk`` best groups at -inf.

    DeepSeek-V3's node-limited routing: a group's score is the sum of its best
    ``topk // group_topk`` experts' scores.
    """
    tokens, num_experts = choice.shape
    if num_experts % num_groups or not 1 <= group_topk <= num_groups:
        raise ValueError(
            f"grouped top-k needs num_groups dividing the {num_experts} experts and 1 <= "
            f"group_topk <= num_groups, got num_groups={num_groups}, group_topk={group_topk}"
        )
    per_group = num_experts // num_groups
    if topk % group_topk or topk // group_topk > per_group:
        raise ValueError(
            f"grouped top-k takes topk // group_topk experts from each chosen group, so topk "
            f"({topk}) must be a multiple of group_topk ({group_topk}) and at most "
            f"{per_group * group_topk}; change topk or group_topk"
        )
    grouped = choice.reshape(tokens, num_groups, per_group)  # [T, groups, E / groups]
    group_scores = jnp.sum(jax.lax.top_k(grouped, topk // group_topk)[0], axis=-1)  # [T, groups]
    _, best_groups = jax.lax.top_k(group_scores, group_topk)  # [T, group_topk]
    keep = jnp.any(
        best_groups[:, :, None] == jnp.arange(num_groups)[None, None, :], axis=1
    )  # [T, groups]
    masked = jnp.where(keep[:, :, None], grouped, -jnp.inf)
    return masked.reshape(tokens, num_experts)


def fused_topk_with_score_function(
    logits: Array,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: str | ScoreFunction = ScoreFunction.SOFTMAX,
    expert_bias: Array | None = None,
    compute_aux_scores: bool = False,
    routing_map_format: str | RoutingMapFormat | int = RoutingMapFormat.BYTEMAP,
) -> tuple[Array, Array]:
    """Router scores and the top-k choice of each token (TransformerEngine's signature).

    Softmax: ``probs = softmax(top-k logits)``, or with ``use_pre_softmax`` the top-k of
    ``softmax(logits)``. Sigmoid and sqrtsoftplus: the experts are chosen by ``score +
    expert_bias`` and the chosen scores (without the bias) are normalised to sum to 1 when
    ``topk > 1``. ``num_groups`` / ``group_topk`` > 0 limit each token to its ``group_topk``
    best expert groups (DeepSeek-V3). The probabilities are then multiplied by
    ``scaling_factor``. All in float32.

    Args:
      logits: ``[num_tokens, num_experts]``, the gate GEMM's output.
      topk: the experts per token, 1 to ``num_experts``.
      use_pre_softmax: softmax over all experts before the top-k (softmax only; default False).
      num_groups, group_topk: grouped top-k (default -1: off).
      scaling_factor: multiplies the probabilities (a Python number; default 1.0).
      score_function: ``"softmax"`` (default), ``"sigmoid"`` or ``"sqrtsoftplus"``.
      expert_bias: ``[num_experts]`` or None; sigmoid and sqrtsoftplus only.
      compute_aux_scores: return the dense scores over all experts (``score_function`` of the
        logits, then normalised over the experts for sigmoid and sqrtsoftplus) and their plain
        top-k map, for the aux loss; the other options are ignored, as in TE.
      routing_map_format: ``"bytemap"`` (default) or ``"bitmap_u8"``.

    Returns:
      ``(probs, routing_map)``: float32 ``[num_tokens, num_experts]``, zero outside the chosen
      experts (dense scores with ``compute_aux_scores``), and ``bool [num_tokens,
      num_experts]`` (or ``uint8 [num_tokens, ceil(num_experts / 8)]``).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.router import fused_topk_with_score_function
      >>> probs, routing_map = fused_topk_with_score_function(jnp.array([[2.0, 0.0, 1.0]]), 2)
      >>> routing_map
      Array([[ True, False,  True]], dtype=bool)
      >>> [round(float(p), 3) for p in probs[0]]
      [0.731, 0.0, 0.269]
    """
    if not isinstance(scaling_factor, int | float) or isinstance(scaling_factor, bool):
        raise TypeError(
            f"scaling_factor must be a Python float or int, not {type(scaling_factor).__name__}; "
            "use math.sqrt() rather than jnp.sqrt()"
        )
    if logits.ndim != 2:
        raise ValueError(
            f"logits must be [num_tokens, num_experts], got shape {logits.shape}; reshape the "
            "token axes into one, e.g. logits.reshape(-1, num_experts)"
        )
    score_function = _enum(score_function, ScoreFunction, "score_function")
    routing_map_format = _enum(routing_map_format, RoutingMapFormat, "routing_map_format")
    num_experts = logits.shape[-1]
    topk = _check_topk(topk, num_experts)
    scores = _scores(logits, score_function)  # [T, E] float32
    if compute_aux_scores:
        if score_function != ScoreFunction.SOFTMAX:
            scores = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
        _, chosen = jax.lax.top_k(scores, topk)
        return scores, _routing_map(chosen, num_experts, routing_map_format)
    if expert_bias is not None and score_function == ScoreFunction.SOFTMAX:
        raise ValueError(
            "expert_bias is only supported with score_function='sigmoid' or 'sqrtsoftplus', "
            "got 'softmax'; use a sigmoid router for aux-loss-free balancing"
        )
    if expert_bias is not None and expert_bias.shape != (num_experts,):
        raise ValueError(
            f"expert_bias must have shape ({num_experts},) (one per expert), got "
            f"{expert_bias.shape}"
        )
    # Which experts: the selection sees the bias but passes it no gradient.
    if score_function == ScoreFunction.SOFTMAX and not use_pre_softmax:
        choice = logits.astype(jnp.float32)
    else:
        choice = scores
    if expert_bias is not None:
        choice = choice + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))[None, :]
    if num_groups > 0 and group_topk > 0:
        choice = _grouped_choice(choice, topk, num_groups, group_topk)
    _, chosen = jax.lax.top_k(jax.lax.stop_gradient(choice), topk)  # [T, k]
    if score_function == ScoreFunction.SOFTMAX and not use_pre_softmax:
        chosen_logits = jnp.take_along_axis(logits.astype(jnp.float32), chosen, axis=-1)
        weights = jax.nn.softmax(chosen_logits, axis=-1)  # [T, k]
    else:
        weights = jnp.take_along_axis(scores, chosen, axis=-1)  # [T, k]
        if score_function != ScoreFunction.SOFTMAX and topk > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * scaling_factor
    rows = jnp.arange(logits.shape[0])[:, None]
    probs = jnp.zeros(scores.shape, jnp.float32).at[rows, chosen].set(weights)  # [T, E]
    return probs, _routing_map(chosen, num_experts, routing_map_format)


def _routing_map(chosen: Array, num_experts: int, layout: RoutingMapFormat) -> Array:
    mask = jnp.any(
        chosen[:, :, None] == jnp.arange(num_experts)[None, None, :], axis=1
    )  # [T, E] bool
    if layout == RoutingMapFormat.BYTEMAP:
        return mask
    return jnp.packbits(mask, axis=-1, bitorder="little")  # [T, ceil(E / 8)] uint8


def fused_moe_aux_loss(probs: Array, tokens_per_expert: Array, topk: int, coeff: float) -> Array:
    """The load-balancing aux loss (Switch Transformer's; TransformerEngine's signature).

    ``loss = E * coeff / (topk * T**2) * sum_e(sum_t probs[t, e] * tokens_per_expert[e])``,
    in float32; with perfectly uniform routing it equals ``coeff``. The gradient reaches
    ``probs`` only.

    Args:
      probs: ``[num_tokens, num_experts]`` scores (``compute_aux_scores=True``).
      tokens_per_expert: ``[num_experts]`` integer counts (not differentiated).
      topk: the experts per token.
      coeff: the loss coefficient.

    Returns:
      A float32 scalar.
    """
    per_expert = jnp.sum(probs.astype(jnp.float32), axis=0)  # [T, E] -> [E]
    return aux_loss_from_totals(per_expert, tokens_per_expert, probs.shape[0], topk, coeff)


def aux_loss_from_totals(
    probs_per_expert: Array,
    tokens_per_expert: Array,
    num_tokens: int | Array,
    topk: int,
    coeff: float,
) -> Array:
    """``fused_moe_aux_loss`` from its per-expert sums ``sum_t probs[t, e]`` (``[E]``).

    The form a sharded batch needs: the sums and counts add over the devices (``psum``)
    before the loss is taken.
    """
    num_experts = probs_per_expert.shape[0]
    counts = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)  # [E]
    num_tokens = jnp.asarray(num_tokens, jnp.float32)
    scale = jnp.float32(num_experts * coeff / topk) / (num_tokens * num_tokens)
    return jnp.sum(probs_per_expert.astype(jnp.float32) * counts) * scale


def expert_capacity(
    num_tokens: int, num_experts: int, topk: int, capacity_factor: float | None
) -> int | None:
    """Rows each expert takes: ``ceil(num_tokens * topk / num_experts * capacity_factor)``.

    None (dropless) when ``capacity_factor`` is None.
    """
    if capacity_factor is None:
        return None
    if not isinstance(capacity_factor, int | float) or not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor must be a positive number, or None for dropless routing; got "
            f"{capacity_factor!r}"
        )
    return max(1, math.ceil(num_tokens * topk / num_experts * capacity_factor))


def drop_over_capacity(
    selected_experts: Array,
    weights: Array,
    num_experts: int,
    capacity: int,
    drop_policy: str = "probs",
    position_offset: Array | None = None,
) -> tuple[Array, Array]:
    """Drops the assignments past each expert's capacity.

    ``"probs"`` keeps each expert's ``capacity`` most probable assignments; ``"position"``
    its first ``capacity`` in token order (Switch Transformer, GShard). A dropped assignment's
    expert becomes ``num_experts`` (no expert: the permutation sorts it last and no group
    holds it) and its weight 0, so the token keeps only its residual path for that slot.

    Args:
      selected_experts: int ``[num_tokens, topk]``.
      weights: ``[num_tokens, topk]``.
      num_experts: the number of experts.
      capacity: rows per expert.
      drop_policy: ``"probs"`` (default) or ``"position"``.
      position_offset: ``"position"`` only: ``[num_experts]`` assignments to each expert that
        come before these tokens (on other devices), counted against the capacity.

    Returns:
      ``(selected_experts, weights)`` with the dropped assignments marked.
    """
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    flat_experts = selected_experts.reshape(-1)  # [T * k], token-major
    count = flat_experts.shape[0]
    if drop_policy == "probs":
        # Most probable first within each expert: sort by (expert, -weight), stable.
        order = jnp.lexsort((-jax.lax.stop_gradient(weights).reshape(-1), flat_experts))
    else:
        order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    starts = jnp.searchsorted(sorted_experts, jnp.arange(num_experts))  # [E]
    rank_sorted = jnp.arange(count) - starts[jnp.clip(sorted_experts, 0, num_experts - 1)]
    rank = jnp.zeros(count, rank_sorted.dtype).at[order].set(rank_sorted)  # [T * k]
    if position_offset is not None:
        rank = rank + position_offset[jnp.clip(flat_experts, 0, num_experts - 1)]
    kept = ((rank < capacity) & (flat_experts < num_experts)).reshape(selected_experts.shape)
    return (
        jnp.where(kept, selected_experts, num_experts),
        jnp.where(kept, weights, jnp.zeros((), weights.dtype)),
    )


def update_expert_bias(
    expert_bias: Array, tokens_per_expert: Array, update_rate: float = 1e-3
) -> Array:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of underloaded experts.

    ``expert_bias + update_rate * sign(mean load - load)``, applied by the train step after
    each step (not a gradient update); the bias only moves which experts are chosen.
    """
    load = tokens_per_expert.astype(jnp.float32)  # [E]
    step = update_rate * jnp.sign(jnp.mean(load) - load)
    return (expert_bias.astype(jnp.float32) + step).astype(expert_bias.dtype)
