"""Sequence packing: a packed batch equals its documents run one by one."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.attention import SequenceDescriptor, dot_product_attention

# Two rows of 8 tokens: documents of 3 and 4 tokens (+1 padding), of 5 and 2 (+1 padding).
LENGTHS = [[3, 4], [5, 2]]
SEQ, HIDDEN, HEADS = 8, 16, 4


def _segments():
    ids, pos = np.zeros((2, SEQ), np.int32), np.zeros((2, SEQ), np.int32)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for number, length in enumerate(lengths, start=1):
            ids[row, start : start + length] = number
            pos[row, start : start + length] = np.arange(length)
            start += length
    return ids, pos


def _documents():
    """(row, start, length) of every document."""
    out = []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            out.append((row, start, length))
            start += length
    return out


def test_descriptor_forms_agree_and_rank5_uint8_mask_is_accepted():
    ids, pos = _segments()
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, SEQ, 2, 8)) for key in keys)
    layer = te_nn.DotProductAttention(
        head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd", max_segments_per_seq=2
    )
    by_ids = layer.apply({}, q, k, v, SequenceDescriptor.from_segment_ids_and_pos(ids, pos))
    seqlens = jnp.asarray([[3, 4], [5, 2]])
    offsets = jnp.asarray([[0, 3, 7], [0, 5, 7]])
    by_offsets = layer.apply(
        {},
        q,
        k,
        v,
        sequence_descriptor=SequenceDescriptor.from_seqlens_and_offsets(seqlens, offsets),
    )
    np.testing.assert_array_equal(by_ids, by_offsets)
    # TE's rank-5 uint8 mask [b, 1, 1, q, kv] (nonzero: masked out) gives the same attention.
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    mask5 = (~(same & causal))[:, None, None].astype(np.uint8)
    by_mask = dot_product_attention(q, k, v, jnp.asarray(mask5), attn_mask_type="padding")
    np.testing.assert_allclose(by_ids, by_mask, rtol=1e-6, atol=1e-6)
    # One sequence per row: from_seqlens is a padding mask.
    first = layer.apply({}, q, k, v, SequenceDescriptor.from_seqlens(jnp.asarray([3, 5])))
    alone = dot_product_attention(q[:1, :3], k[:1, :3], v[:1, :3])
    np.testing.assert_allclose(first[:1, :3], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, (1, 0)])
def test_packed_transformer_layer_equals_documents_one_by_one(window):
    """Outputs and parameter gradients; rotary positions restart per document; a sliding
    window stays within its document; padding tokens get zero gradient."""
    layer = te_nn.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=32, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, enable_relative_embedding=False, enable_rotary_pos_emb=True,
        window_size=window,
    )  # fmt: skip
    ids, pos = _segments()
    x = jax.random.normal(jax.random.key(1), (2, SEQ, HIDDEN))
    cotangent = (
        jax.random.normal(jax.random.key(2), x.shape) * jnp.asarray(ids > 0, x.dtype)[..., None]
    )
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x, deterministic=True))
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))

    def packed_loss(variables, x):
        out = layer.apply(variables, x, attention_mask=descriptor, deterministic=True)
        return jnp.sum(out * cotangent), out

    # Jitted: run op by op, the layer's backward compiles hundreds of small programs.
    (_, packed), (grads, grad_x) = jax.jit(jax.value_and_grad(packed_loss, (0, 1), has_aux=True))(
        variables, x
    )

    def alone_loss(variables):
        total, outs = 0.0, []
        for row, start, length in _documents():
            document = x[row : row + 1, start : start + length]
            out = layer.apply(variables, document, deterministic=True)
            total += jnp.sum(out * cotangent[row : row + 1, start : start + length])
            outs.append(out[0])
        return total, outs

    (_, outs), alone_grads = jax.jit(jax.value_and_grad(alone_loss, has_aux=True))(variables)
    for (row, start, length), out in zip(_documents(), outs, strict=True):
        np.testing.assert_allclose(packed[row, start : start + length], out, rtol=2e-5, atol=2e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, alone_grads
    )
    np.testing.assert_array_equal(grad_x[ids == 0], 0.0)


def test_maxtext_initialises_on_a_dummy_descriptor_then_trains_packed():
    """MaxText initialises its attention lazily on one dummy row with a dummy descriptor
    (all-ones segment ids, the batch's real positions, the real batch of rows); then it applies
    the layer to the packed batch with the real descriptor. The dummy is accepted as TE accepts
    it, and the packed result is that of the documents run one by one."""
    layer = te_nn.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=32, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, enable_relative_embedding=False, enable_rotary_pos_emb=True,
    )  # fmt: skip
    ids, pos = _segments()
    dummy = SequenceDescriptor.from_segment_ids_and_pos(
        jnp.ones_like(jnp.asarray(ids)), jnp.asarray(pos)
    )
    variables = layer.init(
        jax.random.key(0), jnp.ones((1, SEQ, HIDDEN)), attention_mask=dummy, deterministic=True
    )
    x = jax.random.normal(jax.random.key(1), (2, SEQ, HIDDEN))
    real = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))
    packed = jax.jit(lambda v, x: layer.apply(v, x, attention_mask=real, deterministic=True))(
        variables, x
    )
    for row, start, length in _documents():
        alone = layer.apply(variables, x[row : row + 1, start : start + length], deterministic=True)
        np.testing.assert_allclose(packed[row, start : start + length], alone[0], atol=2e-5)


def test_one_row_of_queries_broadcasts_against_a_mask_of_a_larger_batch():
    # As TransformerEngine's attention: the output takes the mask's batch.
    q = jax.random.normal(jax.random.key(4), (1, SEQ, 2, 8))
    mask = jnp.zeros((2, 1, SEQ, SEQ), jnp.uint8).at[1, :, :, SEQ // 2 :].set(1)
    layer = te_nn.DotProductAttention(
        head_dim=8, num_attention_heads=2, attn_mask_type="padding_causal"
    )
    out = layer.apply({}, q, q, q, mask)
    assert out.shape == (2, SEQ, 2, 8)
    np.testing.assert_allclose(out[0], layer.apply({}, q, q, q, mask[:1])[0], rtol=1e-6)
    np.testing.assert_allclose(
        out[1, : SEQ // 2], layer.apply({}, q[:, : SEQ // 2], q[:, : SEQ // 2],
                                        q[:, : SEQ // 2], mask[1:, :, : SEQ // 2, : SEQ // 2])[0],
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def test_nnx_attention_takes_the_sequence_descriptor():
    from flax import nnx

    ids, pos = _segments()
    q = jax.random.normal(jax.random.key(3), (2, SEQ, 2, 8))
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))
    ours = te_nnx.DotProductAttention(8, 2, qkv_layout="thd_thd_thd", rngs=nnx.Rngs(0))
    linen = te_nn.DotProductAttention(head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd")
    np.testing.assert_array_equal(
        ours(q, q, q, sequence_descriptor=descriptor), linen.apply({}, q, q, q, descriptor)
    )


def test_maxtext_context_parallel_arguments_with_a_context_axis_of_size_one():
    """MaxText's arguments are accepted and change nothing on a context axis of size 1."""
    q = jax.random.normal(jax.random.key(4), (2, SEQ, 2, 8))
    maxtext = dict(
        context_parallel_axis="context",
        context_parallel_causal_load_balanced=True,
        context_parallel_strategy="all_gather",
    )
    plain = te_nn.DotProductAttention(head_dim=8, num_attention_heads=2)
    with_cp = te_nn.DotProductAttention(head_dim=8, num_attention_heads=2, **maxtext)
    mesh = jax.make_mesh((8, 1), ("data", "context"))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q: with_cp.apply({}, q, q, q))(q)
    np.testing.assert_allclose(out, plain.apply({}, q, q, q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ["DualChunkSwap", "Striped"])
def test_load_balancing_reorder_is_undone_by_its_inverse(strategy):
    from te_flax.attention import (
        ReorderStrategy,
        inverse_reorder_causal_load_balancing,
        reorder_causal_load_balancing,
    )

    x = jnp.arange(2 * 16).reshape(2, 16)
    reordered = reorder_causal_load_balancing(x, ReorderStrategy[strategy], 4, 1)
    first_device = {"DualChunkSwap": [0, 1, 14, 15], "Striped": [0, 4, 8, 12]}[strategy]
    np.testing.assert_array_equal(reordered[0, :4], first_device)
    np.testing.assert_array_equal(
        inverse_reorder_causal_load_balancing(reordered, ReorderStrategy[strategy], 4, 1), x
    )
