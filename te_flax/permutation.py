"""Token permutation for mixtures of experts: ``argsort`` + gather (TransformerEngine's names).

``pure_jax_token_dispatch`` copies each token once per chosen expert and sorts the copies by
expert, so that ``grouped_dense`` sees every expert's rows together; ``pure_jax_token_combine``
sorts them back and sums each token's copies weighted by its routing weights. Both are
TransformerEngine's pure-JAX functions with its signatures and results; here an assignment to
expert ``num_experts`` (a token dropped by ``te_flax.router.drop_over_capacity``) sorts after
every group and belongs to none.

A sort is a gather by a permutation, whose transpose is the gather by the inverse permutation:
the backward is written that way, not as the scatter-add JAX would derive.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

__all__ = [
    "PureJaxPermState",
    "pure_jax_token_combine",
    "pure_jax_token_dispatch",
    "routing_map_to_selected_experts",
]


@jax.custom_vjp
def sort_rows(rows: Array, order: Array) -> Array:
    """``rows[order]`` for a permutation ``order``, differentiated as the inverse gather."""
    return jnp.take(rows, order, axis=0)


def _sort_rows_forward(rows: Array, order: Array) -> tuple[Array, Array]:
    return sort_rows(rows, order), order


def _sort_rows_backward(order: Array, cotangent: Array) -> tuple[Array, None]:
    return sort_rows(cotangent, jnp.argsort(order)), None


sort_rows.defvjp(_sort_rows_forward, _sort_rows_backward)


def routing_map_to_selected_experts(
    sparse_probs: Array, routing_map: Array, topk: int
) -> tuple[Array, Array]:
    """``(selected_experts [T, topk], weights [T, topk])`` from the router's ``(probs, map)``."""
    # A stable argsort puts the True entries last, in expert order.
    selected_experts = jnp.argsort(routing_map, axis=-1, stable=True)[..., -topk:]
    weights = jnp.take_along_axis(sparse_probs, selected_experts, axis=-1)
    return selected_experts, weights


class PureJaxPermState(NamedTuple):
    """What ``pure_jax_token_combine`` needs to undo ``pure_jax_token_dispatch``."""

    sorted_indices: Array  # [num_real_tokens + padding_size], the forward sort
    num_real_tokens: int  # tokens * topk
    padding_size: int  # alignment rows appended before the sort


def pure_jax_token_dispatch(
    inputs: Array,
    selected_experts: Array,
    num_experts: int,
    num_experts_per_tok: int,
    align_size: int = 0,
    roll_to_expert_id: int | None = None,
) -> tuple[Array, PureJaxPermState, Array]:
    """Each token copied once per chosen expert, the copies sorted by expert.

    Args:
      inputs: ``[num_tokens, hidden]`` (or ``[batch, seq, hidden]``, flattened).
      selected_experts: int ``[num_tokens, topk]`` (or ``[batch, seq, topk]``); the value
        ``num_experts`` marks a dropped assignment.
      num_experts: the number of experts.
      num_experts_per_tok: topk; must equal ``selected_experts.shape[-1]``.
      align_size: pad each expert's group to a multiple of this with zero rows (default 0: no
        padding).
      roll_to_expert_id: rotate the expert ids by minus this before sorting (group
        ``i`` is then expert ``i + roll_to_expert_id``).

    Returns:
      ``(sorted_inputs [num_tokens * topk + padding, hidden], state, group_sizes [E] int32)``.
    """
    if selected_experts.shape[-1] != num_experts_per_tok:
        raise ValueError(
            f"num_experts_per_tok={num_experts_per_tok} must equal selected_experts.shape[-1]="
            f"{selected_experts.shape[-1]}"
        )
    if not isinstance(align_size, int) or align_size < 0:
        raise ValueError(f"align_size must be an int >= 0, got {align_size!r}")
    hidden = inputs.shape[-1]
    rows = inputs.reshape(-1, hidden)  # [T, H]
    experts = selected_experts.reshape(-1).astype(jnp.int32)  # [T * k], token-major
    num_real_tokens = experts.shape[0]
    if roll_to_expert_id is not None:
        experts = jnp.where(
            experts < num_experts, (experts - roll_to_expert_id) % num_experts, num_experts
        )
    counts = jax.ops.segment_sum(
        jnp.ones_like(experts), experts, num_segments=num_experts
    )  # [E]; the dropped (id E) fall outside
    padding_size = 0
    if align_size > 0:
        # Each expert owns align_size - 1 padding slots; the ones it needs join its group, the
        # rest join no group.
        slots = align_size - 1
        needed = (align_size - counts % align_size) % align_size  # [E]
        position = jnp.arange(num_experts * slots)
        owner = position // slots
        padding_experts = jnp.where(position % slots < needed[owner], owner, num_experts)
        experts = jnp.concatenate([experts, padding_experts.astype(jnp.int32)])
        counts = counts + needed
        padding_size = num_experts * slots
    order = jnp.argsort(experts, stable=True)  # [T * k + padding]
    copies = jnp.repeat(rows, num_experts_per_tok, axis=0)  # [T * k, H]
    copies = jnp.pad(copies, ((0, padding_size), (0, 0)))
    sorted_inputs = sort_rows(copies, order)
    state = PureJaxPermState(order, num_real_tokens, padding_size)
    return sorted_inputs, state, counts.astype(jnp.int32)


def pure_jax_token_combine(
    expert_outputs: Array,
    perm_state: PureJaxPermState,
    routing_weights: Array,
    num_experts_per_tok: int,
    batch_size: int,
    sequence_length: int,
) -> Array:
    """Undoes the dispatch sort and sums each token's copies weighted by its routing weights.

    Args:
      expert_outputs: ``[num_tokens * topk + padding, hidden]``, rows in the dispatch order.
      perm_state: from ``pure_jax_token_dispatch``.
      routing_weights: ``[num_tokens, topk]`` (any shape with that many elements); cast to
        the outputs' dtype.
      num_experts_per_tok: topk.
      batch_size, sequence_length: the output's leading shape.

    Returns:
      ``[batch_size, sequence_length, hidden]``.
    """
    unsorted = sort_rows(expert_outputs, jnp.argsort(perm_state.sorted_indices))
    unsorted = unsorted[: perm_state.num_real_tokens]  # drop the alignment rows
    hidden = unsorted.shape[-1]
    weights = routing_weights.reshape(-1, num_experts_per_tok).astype(unsorted.dtype)  # [T, k]
    copies = unsorted.reshape(weights.shape[0], num_experts_per_tok, hidden)  # [T, k, H]
    output = jnp.einsum("tkh,tk->th", copies, weights)  # [T, H]
    return output.reshape(batch_size, sequence_length, hidden)
