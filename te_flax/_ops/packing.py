"""Sequence packing: TransformerEngine's ``SequenceDescriptor`` and the masks it stands for.

Several documents packed into one row of ``[batch, seq, ...]`` (TE's ``thd`` layouts: the same
shapes as ``bshd``, several segments per row) must not see each other: a query attends a key only
when both carry the same nonzero segment id (0 is padding), and rotary positions restart at each
document (``segment_pos``). A ``SequenceDescriptor`` gives the segments in one of TE's three
forms; ``segment_ids_and_pos`` turns any of them into ``([batch, seq] ids, [batch, seq]
positions)`` for queries and keys, and ``padding_mask`` into TE's boolean mask (True: masked).
On one device causal masks and sliding windows then apply within a document unchanged, since its
tokens are contiguous and its positions count up one by one. Across devices the tokens may lie
in any order (a reorder for load balancing): there the masks compare the positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

__all__ = [
    "SequenceDescriptor",
    "has_offsets",
    "has_positions",
    "padding_mask",
    "segment_ids_and_pos",
]


def _pair(value: Any, name: str) -> tuple[Array, Array]:
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(
                f"{name} must be one array (queries and keys alike) or a (query, key/value) "
                f"pair, got a tuple of {len(value)}"
            )
        return jnp.asarray(value[0]), jnp.asarray(value[1])
    value = jnp.asarray(value)
    return value, value


@jax.tree_util.register_pytree_node_class
class SequenceDescriptor:
    """The sequences of a batch, in TransformerEngine's forms (same names and meanings).

    - ``from_seqlens(seqlens)``: one sequence per row, ``seqlens`` ``[batch]`` tokens from the
      start, the rest padding.
    - ``from_seqlens_and_offsets(seqlens, seq_offsets)``: packed rows, ``seqlens`` ``[batch,
      max_segments]`` and ``seq_offsets`` ``[batch, max_segments + 1]`` (unused entries -1).
    - ``from_segment_ids_and_pos(segment_ids, segment_pos)``: ``[batch, seq]`` segment ids
      (from 1; 0 is padding) and the position of each token within its segment.

    Each takes one array for queries and keys alike or a ``(query, key/value)`` pair.
    """

    def __init__(
        self,
        seqlens: tuple[Array, Array] | None = None,
        seq_offsets: tuple[Array, Array] | None = None,
        segment_ids: tuple[Array, Array] | None = None,
        segment_pos: tuple[Array, Array] | None = None,
    ):
        empty = (jnp.zeros(0), jnp.zeros(0))
        self.seqlens = empty if seqlens is None else seqlens
        self.seq_offsets = empty if seq_offsets is None else seq_offsets
        self.segment_ids = empty if segment_ids is None else segment_ids
        self.segment_pos = empty if segment_pos is None else segment_pos

    def tree_flatten(self) -> tuple[tuple[tuple[Array, Array], ...], None]:
        return (self.seqlens, self.seq_offsets, self.segment_ids, self.segment_pos), None

    @classmethod
    def tree_unflatten(cls, aux_data: None, children: Any) -> SequenceDescriptor:
        del aux_data
        return cls(*children)

    @classmethod
    def from_seqlens(cls, seqlens: Array | tuple[Array, Array]) -> SequenceDescriptor:
        return cls(seqlens=_pair(seqlens, "seqlens"))

    @classmethod
    def from_seqlens_and_offsets(
        cls, seqlens: Array | tuple[Array, Array], seq_offsets: Array | tuple[Array, Array]
    ) -> SequenceDescriptor:
        return cls(seqlens=_pair(seqlens, "seqlens"), seq_offsets=_pair(seq_offsets, "seq_offsets"))

    @classmethod
    def from_segment_ids_and_pos(
        cls,
        segment_ids: Array | tuple[Array, Array],
        segment_pos: Array | tuple[Array, Array] | None = None,
        *,
        is_thd: bool | None = None,
        is_segment_ids_reordered: bool | None = None,
    ) -> SequenceDescriptor:
        """Segments from ``[batch, seq]`` ids and positions, in whatever order the tokens lie.

        The positions place every token: across devices the masks (causal, windows) compare
        positions, not indices, so a batch reordered for load balancing is described by its
        reordered ids and positions. ``is_thd`` and ``is_segment_ids_reordered`` are the
        keywords of TransformerEngine releases before 2.14 (2.20.2 has neither and needs
        ``segment_pos``); with them, ``segment_pos=None`` means those releases' default
        positions: counting from 0 at each run of one id (``is_thd=True``) or along the row,
        and refused for reordered ids, whose positions cannot be recovered.
        """
        if segment_pos is None:
            segment_pos = _default_positions(segment_ids, is_thd, is_segment_ids_reordered)
        ids, pos = _pair(segment_ids, "segment_ids"), _pair(segment_pos, "segment_pos")
        for row_ids, row_pos in zip(ids, pos, strict=True):
            _check_segments(row_ids, row_pos)
        return cls(segment_ids=ids, segment_pos=pos)


def _default_positions(
    segment_ids: Array | tuple[Array, Array],
    is_thd: bool | None,
    is_segment_ids_reordered: bool | None,
) -> tuple[Array, Array]:
    """The positions of TransformerEngine before 2.14 for ``segment_pos=None`` (its keywords
    given); without the keywords ``segment_pos`` is required, as in TE 2.20.2."""
    if is_thd is None and is_segment_ids_reordered is None:
        raise ValueError(
            "from_segment_ids_and_pos needs segment_pos (each token's position within its "
            "segment), as in TransformerEngine; e.g. for ids [1, 1, 2, 2, 2] pass "
            "[0, 1, 0, 1, 2]"
        )
    if is_segment_ids_reordered:
        raise ValueError(
            "from_segment_ids_and_pos(..., is_segment_ids_reordered=True) needs segment_pos: "
            "the positions of reordered tokens cannot be recovered from their ids. Reorder the "
            "positions with the ids (reorder_causal_load_balancing of both) and pass them"
        )

    def positions(ids: Array) -> Array:
        tokens = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
        if not is_thd:  # one sequence per row: positions along the row
            return tokens
        # Each run of one id starts where the id changes; a token counts from its run's start.
        starts = jnp.concatenate(
            [jnp.ones_like(ids[..., :1], jnp.bool_), ids[..., 1:] != ids[..., :-1]], axis=-1
        )
        run_start = lax.cummax(jnp.where(starts, tokens, 0), axis=ids.ndim - 1)
        return tokens - run_start

    q_ids, kv_ids = _pair(segment_ids, "segment_ids")
    return positions(q_ids), positions(kv_ids)


def has_positions(descriptor: SequenceDescriptor) -> bool:
    """Whether ``descriptor`` gives segment ids and positions (else seqlens and offsets, whose
    positions follow the tensors' indices)."""
    q_ids, kv_ids = descriptor.segment_ids
    return bool(q_ids.size + kv_ids.size)


def has_offsets(descriptor: SequenceDescriptor) -> bool:
    """Whether ``descriptor`` packs several documents per row by seqlens and offsets."""
    q_offsets, kv_offsets = descriptor.seq_offsets
    return bool(q_offsets.size + kv_offsets.size)


def _check_segments(ids: Array, pos: Array) -> None:
    """Where ``ids`` is concrete (not traced), its segment ids must be >= 0 (0 is padding).

    The positions are taken as given, as TransformerEngine takes them: they place each token
    for rotary embeddings and need not restart at each segment id. MaxText initialises its
    attention lazily on a dummy descriptor, all-ones segment ids with the batch's real
    positions, and that must be accepted. Traced values are not checked (a Python error
    cannot depend on them)."""
    del pos
    if isinstance(ids, jax.core.Tracer):
        return
    ids_np = np.asarray(ids)
    if (ids_np < 0).any():
        raise ValueError(
            f"segment_ids must be >= 0 (segments from 1, 0 for padding), got "
            f"{int(ids_np.min())}: number the documents of each row 1, 2, ... and pad with 0"
        )


def _from_seqlens(seqlens: Array, offsets: Array | None, length: int) -> tuple[Array, Array]:
    """Segment ids and positions ``[batch, length]`` of ``seqlens`` (and offsets)."""
    tokens = jnp.arange(length)  # [s]
    if offsets is None:  # one sequence per row, from the start
        seqlens = jnp.reshape(seqlens, (-1, 1))  # [b, 1]
        ids = (tokens[None, :] < seqlens).astype(jnp.int32)
        return ids, jnp.broadcast_to(tokens, ids.shape)
    count = seqlens.shape[-1]
    tokens = tokens[None, None, :]  # [1, 1, s]
    starts = offsets[:, :count, None]  # [b, n, 1]
    ends = starts + jnp.maximum(seqlens, 0)[:, :, None]
    inside = (tokens >= starts) & (tokens < ends) & (seqlens[:, :, None] > 0)  # [b, n, s]
    number = jnp.arange(1, count + 1, dtype=jnp.int32)[None, :, None]
    ids = jnp.sum(jnp.where(inside, number, 0), axis=1)  # [b, s]
    pos = jnp.sum(jnp.where(inside, tokens - starts, 0), axis=1)
    return ids.astype(jnp.int32), pos.astype(jnp.int32)


def segment_ids_and_pos(
    descriptor: SequenceDescriptor, q_len: int, kv_len: int
) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
    """``((q ids, kv ids), (q positions, kv positions))``, each ``[batch, len]`` int32."""
    if has_positions(descriptor):
        q_ids, kv_ids = descriptor.segment_ids
        q_pos, kv_pos = descriptor.segment_pos
        ids, pos = (q_ids, kv_ids), (q_pos, kv_pos)
        for name, pair in (("segment_ids", ids), ("segment_pos", pos)):
            for array, length in zip(pair, (q_len, kv_len), strict=True):
                if array.ndim != 2 or array.shape[1] != length:
                    raise ValueError(
                        f"{name} must be [batch, seq] with seq {length} (the tensors' sequence "
                        f"axis), got shape {array.shape}"
                    )
        return (
            tuple(a.astype(jnp.int32) for a in ids),  # type: ignore[return-value]
            tuple(a.astype(jnp.int32) for a in pos),
        )
    q_lens, kv_lens = descriptor.seqlens
    if q_lens.size + kv_lens.size == 0:
        raise ValueError(
            "an empty SequenceDescriptor; build it with SequenceDescriptor.from_seqlens, "
            "from_seqlens_and_offsets or from_segment_ids_and_pos"
        )
    q_offsets, kv_offsets = descriptor.seq_offsets
    packed = has_offsets(descriptor)
    q = _from_seqlens(q_lens, q_offsets if packed else None, q_len)
    kv = _from_seqlens(kv_lens, kv_offsets if packed else None, kv_len)
    return (q[0], kv[0]), (q[1], kv[1])


def padding_mask(ids: tuple[Array, Array]) -> Array:
    """TE's mask ``[batch, 1, q, kv]`` (True: masked out): keys of another document or padding."""
    q_ids, kv_ids = ids
    same = q_ids[:, :, None] == kv_ids[:, None, :]  # [b, q, kv]
    valid = (q_ids[:, :, None] > 0) & (kv_ids[:, None, :] > 0)
    return jnp.logical_not(same & valid)[:, None]
