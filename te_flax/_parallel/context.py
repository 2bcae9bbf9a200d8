"""Causal load balancing for context parallelism: TransformerEngine's token reorderings.

Under a causal mask the last tokens of a sequence attend far more keys than the first, so a
sequence split into ``cp_size`` contiguous shards gives the last device most of the work. TE
reorders the tokens before sharding so that every device holds early and late tokens alike:

* ``ReorderStrategy.DualChunkSwap``: the sequence is cut into ``2 * cp_size`` chunks and device
  ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` (needs ``seq % (2 * cp_size) == 0``).
* ``ReorderStrategy.Striped``: device ``r`` holds stripes ``r, r + cp_size, ...`` of
  ``stripe_size`` tokens (needs ``seq % (cp_size * stripe_size) == 0``).

``reorder_causal_load_balancing(x, strategy, cp_size, seq_dim)`` gives the reordered tensor
(its ``cp_size`` contiguous shards are the devices' tokens) and
``inverse_reorder_causal_load_balancing`` undoes it, with TE's signatures and orders.

The attention across devices reads the tokens' order from their positions: a
``SequenceDescriptor``'s segment ids and positions, reordered with the tensors, are the truth
about which token is where, whatever reorder made them (MaxText reorders packed batches with
``Striped``, as TE does for ``thd``). Without positions (no descriptor, or seqlens) a
load-balanced input is read as ``DualChunkSwap``, as TE reads ``bshd`` inputs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import PartitionSpec as P

from te_flax._base.checks import check_positive_int
from te_flax._base.explicit_sharding import (
    explicit_axes,
    on_auto_axes,
    placed_for_shard_map,
    spec_of,
)
from te_flax._ops.attention import logits, xla_attention
from te_flax._ops.packing import (
    SequenceDescriptor,
    has_offsets,
    has_positions,
    segment_ids_and_pos,
)

__all__ = [
    "ReorderStrategy",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
]


class ReorderStrategy(enum.Enum):
    """TransformerEngine's token orders for causal load balancing (same names and values)."""

    DualChunkSwap = 0
    Striped = 1


def _order(strategy: object, cp_size: int, length: int, stripe_size: int | None) -> np.ndarray:
    """The reordered tensor's token ``i`` is the original token ``order[i]``."""
    check_positive_int(cp_size, "cp_size", "the number of devices along the context axis")
    tokens = np.arange(length)
    if strategy == ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(
                f"ReorderStrategy.DualChunkSwap takes no stripe_size, got {stripe_size!r}; "
                "leave it None (stripes belong to ReorderStrategy.Striped)"
            )
        if cp_size == 1:
            return tokens
        if cp_size % 2 or length % (2 * cp_size):
            raise ValueError(
                f"DualChunkSwap load balancing needs an even cp_size and a sequence length "
                f"divisible by 2 x cp_size = {2 * cp_size}; got cp_size={cp_size} and length "
                f"{length}: pad the sequence to a multiple of {2 * cp_size}"
            )
        chunks = tokens.reshape(2 * cp_size, -1)
        pairs = [chunks[[rank, 2 * cp_size - 1 - rank]] for rank in range(cp_size)]
        return np.concatenate(pairs).reshape(-1)
    if strategy == ReorderStrategy.Striped:
        stripe = 1 if stripe_size is None else stripe_size
        if not isinstance(stripe, int) or stripe < 1 or length % (cp_size * stripe):
            raise ValueError(
                f"Striped load balancing needs a positive stripe_size and a sequence length "
                f"divisible by cp_size x stripe_size; got cp_size={cp_size}, stripe_size="
                f"{stripe_size!r}, length {length}: pad the sequence to a multiple of "
                f"{cp_size * max(int(stripe), 1)}"
            )
        # [rounds, cp_size, stripe] -> [cp_size, rounds, stripe]: device r's stripes together.
        return tokens.reshape(-1, cp_size, stripe).swapaxes(0, 1).reshape(-1)
    raise ValueError(
        f"strategy must be ReorderStrategy.DualChunkSwap or ReorderStrategy.Striped, got "
        f"{strategy!r}"
    )


def reorder_causal_load_balancing(
    tensor: Array, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
    stripe_size: int | None = None,
) -> Array:  # fmt: skip
    """``tensor`` with its ``seq_dim`` reordered for causal load balancing over ``cp_size``."""
    order = _order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return _permuted(tensor, order, seq_dim)


def inverse_reorder_causal_load_balancing(
    tensor: Array, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
    stripe_size: int | None = None,
) -> Array:  # fmt: skip
    """Undoes ``reorder_causal_load_balancing`` (the same arguments)."""
    order = _order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return _permuted(tensor, np.argsort(order), seq_dim)


def _permuted(tensor: Array, order: np.ndarray, axis: int) -> Array:
    """``tensor`` with ``axis`` permuted by ``order``, keeping its sharding: on ``Explicit`` mesh
    axes the gather runs with the axes as ``Auto`` (JAX cannot type a gather along a sharded
    axis), its result resharded as the input."""

    def take(t: Array) -> Array:
        return jnp.take(t, jnp.asarray(order), axis=axis)

    return on_auto_axes(take, spec_of(tensor), tensor)


# ------------------------------------------------------------------- attention across devices

# TE's CPStrategy names (any case; TE also spells ALL_GATHER as ALLGATHER). DEFAULT: all-gather.
CP_STRATEGIES = ("DEFAULT", "ALL_GATHER", "ALLGATHER", "RING")


def canonical_cp_strategy(strategy: object) -> str:
    """``"ALL_GATHER"`` or ``"RING"`` (DEFAULT is the all-gather) from TE's names or enum."""
    name = str(getattr(strategy, "name", strategy)).strip().upper()
    if name not in CP_STRATEGIES:
        raise ValueError(
            f"context_parallel_strategy must be one of {CP_STRATEGIES} (any case, or TE's "
            f"CPStrategy), got {strategy!r}"
        )
    return "RING" if name == "RING" else "ALL_GATHER"


def token_order(cp_size: int, length: int, load_balanced: bool) -> np.ndarray:
    """The original position of each token of a ``length`` sequence given without positions.

    Load-balanced inputs are then in ``DualChunkSwap`` order (TE's order for ``bshd``), so
    device ``r``'s tokens are chunks ``r`` and ``2 cp - 1 - r``; causal masks and windows
    compare these positions, not the tensor's indices.
    """
    if load_balanced:
        return _order(ReorderStrategy.DualChunkSwap, cp_size, length, None)
    _check_divisible(cp_size, length)
    return np.arange(length)


def _check_divisible(cp_size: int, length: int) -> None:
    if length % cp_size:
        raise ValueError(
            f"context parallelism over {cp_size} devices needs a sequence length divisible by "
            f"{cp_size}, got {length}: pad the sequence to a multiple of {cp_size}"
        )


Segments = tuple[tuple[Array, Array], tuple[Array, Array]]


def descriptor_segments(
    descriptor: SequenceDescriptor, q_len: int, kv_len: int, cp_size: int, load_balanced: bool
) -> Segments:
    """``((q ids, kv ids), (q positions, kv positions))`` ``[batch, len]`` of a descriptor, as
    the tokens lie across ``cp_size`` devices.

    Segment ids and positions are taken as given: they say where each token is, whatever
    reorder made them. Seqlens say it only in the tensors' own order: for a load-balanced
    input they are read in ``DualChunkSwap`` order (TE's order without positions), and
    packed seqlens with offsets are refused, as TE refuses them across devices.
    """
    ids, pos = segment_ids_and_pos(descriptor, q_len, kv_len)
    if has_positions(descriptor) or not load_balanced or cp_size == 1:
        return ids, pos
    if has_offsets(descriptor):
        raise ValueError(
            f"a load-balanced packed batch across {cp_size} devices needs a SequenceDescriptor "
            "of segment ids and positions, got one of seqlens and offsets: they cannot say "
            "which reorder placed the tokens (TE's thd context parallelism refuses them too). "
            "Build it with SequenceDescriptor.from_segment_ids_and_pos of the ids and "
            "positions reordered as the tensors were (reorder_causal_load_balancing)"
        )

    def swapped(pair: tuple[Array, Array]) -> tuple[Array, Array]:
        q, kv = (reorder_causal_load_balancing(t, ReorderStrategy.DualChunkSwap, cp_size, 1)
                 for t in pair)  # fmt: skip
        return q, kv

    return swapped(ids), swapped(pos)


def _one_document(
    batch: int, q_len: int, kv_len: int, cp_size: int, load_balanced: bool
) -> Segments:
    """The segments of inputs without a descriptor: one document per row (ids 1), positions
    ``[1, len]`` from ``token_order``."""
    ids = (jnp.ones((batch, q_len), jnp.int32), jnp.ones((batch, kv_len), jnp.int32))
    q_pos, kv_pos = (
        jnp.asarray(token_order(cp_size, length, load_balanced), jnp.int32)[None]
        for length in (q_len, kv_len)
    )
    return ids, (q_pos, kv_pos)


def _block_keep(
    q_pos: Array,
    q_ids: Array,
    kv_pos: Array,
    kv_ids: Array,
    causal: bool,
    window: tuple[int, int] | None,
) -> Array:
    """``[batch, 1, q, kv]`` True where a query attends a key: the same nonzero segment, and
    (by positions ``[batch or 1, len]``, not indices) causal and within the window."""
    keep = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0)
    query, key = q_pos[:, :, None], kv_pos[:, None, :]
    if causal:
        keep = keep & (key <= query)
    if window is not None:
        left, right = window
        if left >= 0:
            keep = keep & (key >= query - left)
        if right >= 0:
            keep = keep & (key <= query + right)
    return keep[:, None]


def context_parallel_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    axis: str,
    strategy: str,
    load_balanced: bool,
    segments: Segments | None,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    sink: Array | None,
) -> Array:
    """Attention with the sequence sharded over the mesh axis ``axis`` (TE's context parallelism).

    ``query``, ``key``, ``value`` are the global ``[batch, seq, heads, head_dim]`` tensors, in
    any token order that ``segments`` describes (else in DualChunkSwap order when
    ``load_balanced``), run under ``shard_map`` over ``axis`` only (the other mesh axes stay
    automatic); each device keeps its ``seq / cp`` queries and

    * ``"ALL_GATHER"``: gathers every key and value (and their segment ids and positions) and
      runs the one-device attention on its queries; autodiff turns the gathers into
      reduce-scatters of the key and value gradients.
    * ``"RING"``: passes its key/value block round the ring with ``ppermute``, ``cp`` steps,
      combining the blocks with an online softmax (running maximum and sum in float32),
      skipping a block none of its queries attends; the backward pass (a custom VJP) runs
      the ring again from the saved output and log-sum-exp (flash-attention style).

    Masks are computed from the tokens' positions and segment ids, so the result is the
    one-device attention's on the tokens in their original order (``segments``: ``((q ids, kv
    ids), (q positions, kv positions))``, each ``[batch, len]``, ids 0 for padding, e.g. from
    ``descriptor_segments``; None: one document per row, positions from ``load_balanced``).
    ``sink`` is the softmax's sink logit ``[1, heads, 1, 1]``.
    """
    cp_size = int(jax.sharding.get_abstract_mesh().shape[axis])
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    described = segments is not None  # by a descriptor: any order, documents
    if segments is None:
        segments = _one_document(batch, q_len, kv_len, cp_size, load_balanced)
    for length in (q_len, kv_len):
        _check_divisible(cp_size, length)
    (q_ids, kv_ids), (q_pos, kv_pos) = segments
    heads = query.shape[2]
    sink_arg = jnp.zeros((1, heads, 1, 1), jnp.float32) if sink is None else sink
    sink_arg = jnp.broadcast_to(sink_arg, (1, heads, 1, 1))

    def local(
        q: Array, k: Array, v: Array, q_pos: Array, kv_pos: Array, q_ids: Array, kv_ids: Array,
        sink_logit: Array,
    ) -> Array:  # fmt: skip
        sink_or_none = None if sink is None else sink_logit
        if strategy == "ALL_GATHER":
            k, v = (_gather_keys(t, axis) for t in (k, v))
            kv_ids, kv_pos = (lax.all_gather(t, axis, axis=1, tiled=True) for t in (kv_ids, kv_pos))
            keep = _block_keep(q_pos, q_ids, kv_pos, kv_ids, causal, window)
            out, _ = xla_attention(q, k, v, keep, None, scale, None, sink=sink_or_none)
            return out
        block = (k, v, kv_pos, kv_ids)
        # DualChunkSwap's causal blocks are all partly attended: no block to skip. Any other
        # order, windows and documents may leave a block unattended: it is skipped at run time.
        skip = not load_balanced or window is not None or described
        return _ring(
            q, block, q_pos, q_ids, causal, window, scale, sink_or_none, axis, cp_size, skip
        )

    seq = P(None, axis)
    in_specs = (seq, seq, seq, seq, seq, seq, seq, P())
    args = (query, key, value, q_pos, kv_pos, q_ids, kv_ids, sink_arg)
    return jax.shard_map(local, in_specs=in_specs, out_specs=seq, axis_names={axis})(
        *placed_for_shard_map(args, in_specs, {axis})
    )


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_keys(x: Array, axis: str) -> Array:
    """All-gathers the sequence (axis 1) of a key or value block; its gradient is summed over
    the devices (a reduce-scatter) in float32, then rounded to ``x``'s dtype once."""
    return lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_keys_forward(x: Array, axis: str) -> tuple[Array, None]:
    return _gather_keys(x, axis), None


def _gather_keys_backward(axis: str, _: None, grad: Array) -> tuple[Array]:
    grad32 = grad.astype(jnp.float32)
    if explicit_axes():
        # JAX (0.12) fails to lower a reduce-scatter in a shard_map that leaves Explicit mesh
        # axes automatic ("Length of sharding.spec ... must be equal to aval's ndim"): there
        # the sum is an all-reduce, and each device keeps its block (twice the bytes).
        block = grad.shape[1] // lax.axis_size(axis)
        total = lax.psum(grad32, axis)
        summed = lax.dynamic_slice_in_dim(total, lax.axis_index(axis) * block, block, axis=1)
    else:
        summed = lax.psum_scatter(grad32, axis, scatter_dimension=1, tiled=True)
    return (summed.astype(grad.dtype),)


_gather_keys.defvjp(_gather_keys_forward, _gather_keys_backward)


class _RingConfig(NamedTuple):
    """The ring's static settings (hashable: the custom VJP's non-differentiated argument)."""

    causal: bool
    window: tuple[int, int] | None
    scale: float
    axis: str
    cp_size: int
    skip: bool
    has_sink: bool


def _ring(
    q: Array,
    block: tuple[Array, Array, Array, Array],
    q_pos: Array,
    q_ids: Array,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    sink: Array | None,
    axis: str,
    cp_size: int,
    skip: bool,
) -> Array:
    """Ring attention on one device: ``block`` = its (keys, values, key positions, key ids),
    passed on to the next device after each step; online softmax in float32. With ``skip``,
    a block no query attends is skipped at run time. The backward pass (a custom VJP) runs
    the ring again from the saved output and log-sum-exp, so no block outlives its step."""
    k, v, kv_pos, kv_ids = block
    config = _RingConfig(causal, window, float(scale), axis, cp_size, skip, sink is not None)
    heads = q.shape[2]
    sink_arg = jnp.zeros((1, heads, 1, 1), jnp.float32) if sink is None else sink
    # Varying over the axis, so that autodiff sums the sink's per-device gradients.
    sink_arg = _vary(sink_arg.astype(jnp.float32), axis)
    return _ring_attention(config, q, k, v, q_pos, kv_pos, q_ids, kv_ids, sink_arg)


def _vary(x: Array, axis: str) -> Array:
    """``x`` marked as varying over ``axis`` (unchanged where it already is)."""
    return x + lax.pcast(jnp.zeros((), x.dtype), (axis,), to="varying")


def _ring_pass(
    config: _RingConfig,
    carry: tuple[Array, ...],
    moving: tuple[Array, ...],
    step_fn: Callable[
        [tuple[Array, ...], tuple[Array, ...], Array], tuple[tuple[Array, ...], tuple[Array, ...]]
    ],
    q_pos: Array,
    q_ids: Array,
) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """``cp_size`` ring steps: ``moving`` = (keys, values, key positions, key ids, extras...)
    visits every device, ``step_fn(carry, moving, keep)`` -> (carry, moving) at each, then
    passes on to the next device; a block no query attends is skipped (with ``config.skip``).

    Every step, a device's own block included, is one loop of ``cp_size`` iterations, so that
    ``moving`` is back home at the end (one hop more than the blocks need; the backward's key
    and value gradients need it). Outside a loop the own block's forward scores and the
    backward's would be one value (common subexpressions are merged across the optimization
    barrier on the CPU), kept alive from the forward to the backward; and a loop of one step
    (2 devices) would be unrolled into the forward's and backward's straight-line code, which
    then share every block's scores. One block's scores are live at a time."""
    to_next = [(rank, (rank + 1) % config.cp_size) for rank in range(config.cp_size)]

    def step(
        state: tuple[tuple[Array, ...], tuple[Array, ...]], _: None
    ) -> tuple[tuple[tuple[Array, ...], tuple[Array, ...]], None]:
        # The next block waits for this one's step: its scores are freed first.
        carry, moving = lax.optimization_barrier(state)
        keep = _block_keep(q_pos, q_ids, moving[2], moving[3], config.causal, config.window)
        if config.skip:  # a block no query attends (causal, windows, other documents)
            carry, moving = lax.cond(
                jnp.any(keep), step_fn, lambda c, m, keep: (c, m), carry, moving, keep
            )
        else:
            carry, moving = step_fn(carry, moving, keep)
        moving = tuple(lax.ppermute(t, config.axis, to_next) for t in moving)
        return (carry, moving), None

    (carry, moving), _ = lax.scan(step, (carry, moving), None, length=config.cp_size)
    return carry, moving


def _scores(config: _RingConfig, grouped: Array, k: Array, keep: Array) -> Array:
    """``[batch, heads, q, kv]`` float32 scaled logits, -inf where not attended."""
    scores = logits(grouped, k)  # [b, kv_heads, group, q, kv] float32
    scores = einops.rearrange(scores, "b k g q s -> b (k g) q s") * jnp.float32(config.scale)
    return jnp.where(keep, scores, -jnp.inf)


def _ring_forward(
    config: _RingConfig, q: Array, k: Array, v: Array, q_pos: Array, kv_pos: Array,
    q_ids: Array, kv_ids: Array, sink: Array,
) -> tuple[Array, Array]:  # fmt: skip
    """The output ``[b, q, h, d]`` and the rows' log-sum-exp ``[b, h, q]`` (float32)."""
    kv_heads = k.shape[2]
    grouped = einops.rearrange(q, "b q (k g) d -> b q k g d", k=kv_heads)
    # Running max, sum and weighted values; the sink is one more logit every row starts with.
    # Zeros like q's (its batch's sharding on Explicit mesh axes, as the steps' results have).
    rows = jnp.zeros_like(q[..., 0], jnp.float32).swapaxes(1, 2)  # [b, h, q]
    if config.has_sink:
        row_max, row_sum = rows + sink[..., 0], rows + 1.0
    else:
        row_max, row_sum = rows - jnp.inf, rows
    acc = jnp.zeros_like(q, jnp.float32).swapaxes(1, 2)  # [b, h, q, d]

    def attend(
        state: tuple[Array, ...], moving: tuple[Array, ...], keep: Array
    ) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        """One block into the running (max, sum, weighted values)."""
        row_max, row_sum, acc = state
        logits = _scores(config, grouped, moving[0], keep)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
        shift = jnp.where(jnp.isfinite(new_max), new_max, jnp.float32(0.0))
        correction = jnp.exp(row_max - shift)
        probs = jnp.exp(logits - shift[..., None])  # masked: exp(-inf) = 0
        row_sum = row_sum * correction + jnp.sum(probs, axis=-1)
        v = moving[1]
        probs = einops.rearrange(probs.astype(v.dtype), "b (k g) q s -> b k g q s", k=kv_heads)
        weighted = jnp.einsum("bkgqs,bskd->bkgqd", probs, v, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + einops.rearrange(weighted, "b k g q d -> b (k g) q d")
        return (new_max, row_sum, acc), moving

    # Every device's state varies over the axis (the blocks do), whatever it starts from.
    state = tuple(_vary(t, config.axis) for t in (row_max, row_sum, acc))
    (row_max, row_sum, acc), _ = _ring_pass(
        config, state, (k, v, kv_pos, kv_ids), attend, q_pos, q_ids
    )
    # A query that sees no key (padding) gets zeros, as on one device.
    seen = row_sum > 0
    out = jnp.where(seen[..., None], acc / jnp.maximum(row_sum, 1e-30)[..., None], 0.0)
    lse = jnp.where(seen, row_max + jnp.log(jnp.maximum(row_sum, 1e-30)), jnp.float32(0.0))
    return einops.rearrange(out, "b h q d -> b q h d").astype(q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(
    config: _RingConfig, q: Array, k: Array, v: Array, q_pos: Array, kv_pos: Array,
    q_ids: Array, kv_ids: Array, sink: Array,
) -> Array:  # fmt: skip
    return _ring_forward(config, q, k, v, q_pos, kv_pos, q_ids, kv_ids, sink)[0]


def _ring_attention_forward(
    config: _RingConfig, q: Array, k: Array, v: Array, q_pos: Array, kv_pos: Array,
    q_ids: Array, kv_ids: Array, sink: Array,
) -> tuple[Array, tuple[Array, ...]]:  # fmt: skip
    """Saves the local q, k, v, the output and the log-sum-exp (and the small ids)."""
    out, lse = _ring_forward(config, q, k, v, q_pos, kv_pos, q_ids, kv_ids, sink)
    return out, (q, k, v, out, lse, q_pos, kv_pos, q_ids, kv_ids, sink)


def _ring_attention_backward(
    config: _RingConfig, saved: tuple[Array, ...], grad: Array
) -> tuple[Array | None, ...]:
    """Flash-attention backward round the ring: each step recomputes a block's probabilities
    from the log-sum-exp; the block's key/value gradients travel with it (float32) and are
    back on their device when the ring ends."""
    q, k, v, out, lse, q_pos, kv_pos, q_ids, kv_ids, sink = saved
    # Not the forward's blocks: the backward recomputes its own, in its own loop (the barrier
    # alone does not stop XLA from merging straight-line recomputation with the forward's).
    q, k, v, out, lse, grad = lax.optimization_barrier((q, k, v, out, lse, grad))
    kv_heads = k.shape[2]
    group = q.shape[2] // kv_heads
    grouped = einops.rearrange(q, "b q (k g) d -> b q k g d", k=kv_heads)
    grad_grouped = einops.rearrange(grad, "b q (k g) d -> b q k g d", k=kv_heads)
    # D = rowsum(dO * O): the softmax's correction, [b, h, q].
    delta = jnp.einsum("bqhd,bqhd->bhq", grad.astype(jnp.float32), out.astype(jnp.float32))
    scale = jnp.float32(config.scale)

    def block_grads(
        carry: tuple[Array, ...], moving: tuple[Array, ...], keep: Array
    ) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
        (dq,) = carry
        k, v, kv_pos, kv_ids, dk, dv = moving
        # Masked scores are -inf: their probabilities are exp(-inf) = 0.
        probs = jnp.exp(_scores(config, grouped, k, keep) - lse[..., None])
        probs = einops.rearrange(probs, "b (k g) q s -> b k g q s", k=kv_heads)
        dprobs = jnp.einsum(
            "bqkgd,bskd->bkgqs", grad_grouped, v, preferred_element_type=jnp.float32
        )
        dscores = probs * (
            dprobs - einops.rearrange(delta, "b (k g) q -> b k g q", k=kv_heads)[..., None]
        )
        dq = dq + scale * jnp.einsum(
            "bkgqs,bskd->bqkgd", dscores, k, preferred_element_type=jnp.float32
        )
        dk = dk + scale * jnp.einsum(
            "bkgqs,bqkgd->bskd", dscores, grouped, preferred_element_type=jnp.float32
        )
        dv = dv + jnp.einsum(
            "bkgqs,bqkgd->bskd", probs, grad_grouped, preferred_element_type=jnp.float32
        )
        return (dq,), (k, v, kv_pos, kv_ids, dk, dv)

    dq, dk, dv = (jnp.zeros_like(t, jnp.float32) for t in (grouped, k, v))
    state = (_vary(dq, config.axis),)
    zeros = tuple(_vary(t, config.axis) for t in (dk, dv))
    (dq,), moving = _ring_pass(
        config, state, (k, v, kv_pos, kv_ids, *zeros), block_grads, q_pos, q_ids
    )
    dk, dv = moving[4:]  # back home with their blocks
    dq = einops.rearrange(dq, "b q k g d -> b q (k g) d", g=group)
    dsink = None
    if config.has_sink:
        # The sink is a logit whose value is 0: its gradient is -sum p_sink * D.
        dsink = -jnp.sum(jnp.exp(sink[..., 0] - lse) * delta, axis=(0, 2))
        dsink = dsink.reshape(sink.shape)
    else:
        dsink = jnp.zeros_like(sink)
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        None,
        None,
        None,
        dsink,
    )


_ring_attention.defvjp(_ring_attention_forward, _ring_attention_backward)
