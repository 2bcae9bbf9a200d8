"""te_flax's attention and transformer layers against TransformerEngine 2.20.2's, beyond the
layer suite: an input width other than hidden_size, packed sequences, TE's load-balancing
reorders and a packed batch in TE's Striped order across devices."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from tests.parity import te_reference as ref

TOLERANCE = 1e-5


def test_transformer_layer_input_width_other_than_hidden_size(parity_results):
    """hidden_size=16 sets the attention width; the input and output are 24 wide."""
    attributes = dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4)
    theirs, ours = ref.TE.TransformerLayer(**attributes), te_nn.TransformerLayer(**attributes)
    x = jax.random.normal(jax.random.key(1), (2, 6, 24))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    te_variables = nn.meta.unbox(theirs.init(jax.random.key(0), x, deterministic=True))
    our_variables = nn.meta.unbox(ours.init(jax.random.key(0), x, deterministic=True))
    assert jax.tree.map(jnp.shape, te_variables) == jax.tree.map(jnp.shape, our_variables)

    def loss(module, variables):
        def value_of(variables, x):
            return jnp.sum(module.apply(variables, x, deterministic=True) * cotangent)

        return jax.value_and_grad(value_of, argnums=(0, 1))(variables, x)

    (_, te_grads), (_, our_grads) = (
        loss(theirs, te_variables),
        loss(ours, te_variables),
    )
    errors = {
        "output": ref.relative_error(
            ours.apply(te_variables, x, deterministic=True),
            theirs.apply(te_variables, x, deterministic=True),
        ),
        "parameter gradients": max(
            ref.relative_error(a, b)
            for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(te_grads), strict=True)
        ),
    }
    parity_results[("TransformerLayer input width 24, hidden_size 16", "none")] = {
        **errors,
        "FP8 state": 0.0,
    }
    for what, error in errors.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"


@pytest.mark.parametrize(
    "strategy, cp_size, stripe_size",
    [
        ("DualChunkSwap", 2, None),
        ("DualChunkSwap", 4, None),
        ("Striped", 4, None),
        ("Striped", 2, 1),
        ("Striped", 4, 2),
        ("Striped", 8, 2),
    ],
)
def test_causal_load_balancing_reorders_as_te(strategy, cp_size, stripe_size):
    from transformer_engine.jax import attention as te_attention

    from te_flax import attention

    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    ours = attention.reorder_causal_load_balancing(
        x, attention.ReorderStrategy[strategy], cp_size, 1, stripe_size
    )
    theirs = te_attention.reorder_causal_load_balancing(
        x, te_attention.ReorderStrategy[strategy], cp_size, 1, stripe_size
    )
    np.testing.assert_array_equal(ours, theirs)
    back = te_attention.inverse_reorder_causal_load_balancing(
        theirs, te_attention.ReorderStrategy[strategy], cp_size, 1, stripe_size
    )
    np.testing.assert_array_equal(
        attention.inverse_reorder_causal_load_balancing(
            ours, attention.ReorderStrategy[strategy], cp_size, 1, stripe_size
        ),
        back,
    )


# Two rows of 16 tokens, documents of 5, 7, 4 and of 9, 7 tokens (no padding: every query sees
# a key, so TE's unfused softmax and te_flax's agree on every row, gradients included).
_STRIPED_IDS = np.asarray([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 7], np.int32)
_STRIPED_POS = np.asarray([[*range(5), *range(7), *range(4)], [*range(9), *range(7)]], np.int32)


@pytest.mark.parametrize(
    "cp_strategy, cp_size, stripe_size",
    [("ring", 2, None), ("all_gather", 4, 2), ("ring", 8, 1)],
)
def test_striped_packed_context_parallelism_equals_te(
    cp_strategy, cp_size, stripe_size, parity_results
):
    """MaxText's packed batch across devices: reordered by TE's Striped reorder, described by
    TE's descriptor of the reordered ids and positions (te_flax's holds the same arrays),
    through te_flax's ring or all-gather attention, put back by TE's inverse. Output and q, k,
    v gradients equal TE's unfused attention on the batch in its order, and on the reordered
    batch with TE's own mask of the reordered positions (``make_swa_mask``)."""
    from transformer_engine.jax import attention as te_attention

    from te_flax.attention import SequenceDescriptor
    from te_flax.sharding import make_mesh

    striped = te_attention.ReorderStrategy.Striped

    def reorder(x, inverse=False):
        function = te_attention.inverse_reorder_causal_load_balancing if inverse else (
            te_attention.reorder_causal_load_balancing
        )  # fmt: skip
        return function(x, striped, cp_size, 1, stripe_size)

    ids, pos = jnp.asarray(_STRIPED_IDS), jnp.asarray(_STRIPED_POS)
    ids_r, pos_r = reorder(ids), reorder(pos)
    theirs_descriptor = te_attention.SequenceDescriptor.from_segment_ids_and_pos(ids_r, pos_r)
    ours_descriptor = SequenceDescriptor.from_segment_ids_and_pos(ids_r, pos_r)
    for a, b in zip(
        jax.tree.leaves(ours_descriptor), jax.tree.leaves(theirs_descriptor), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # TE 2.20.2 dropped the keywords of its releases before 2.14, which te_flax still takes.
    with pytest.raises(TypeError):
        te_attention.SequenceDescriptor.from_segment_ids_and_pos(
            ids_r, pos_r, is_thd=True, is_segment_ids_reordered=True
        )
    SequenceDescriptor.from_segment_ids_and_pos(
        ids_r, pos_r, is_thd=True, is_segment_ids_reordered=True
    )

    def same_document(ids_q, ids_kv):
        return (ids_q[:, :, None] == ids_kv[:, None, :]) & (ids_q[:, :, None] > 0)

    # TE's unfused attention takes masks (True: masked out), which carry the causality too.
    causal = jnp.tril(jnp.ones((16, 16), jnp.bool_))
    in_order = jnp.logical_not(same_document(ids, ids) & causal)[:, None]
    by_positions = te_attention.make_swa_mask(pos_r, pos_r, (-1, 0), jnp.bool_)
    reordered = jnp.logical_not(same_document(ids_r, ids_r)[:, None] & by_positions)
    attributes = dict(
        head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd", max_segments_per_seq=3,
        attn_mask_type="padding_causal", transpose_batch_sequence=False,
    )  # fmt: skip
    ours_module = te_nn.DotProductAttention(
        **attributes, context_parallel_axis="context", context_parallel_strategy=cp_strategy,
        context_parallel_causal_load_balanced=True,
    )  # fmt: skip
    theirs_module = ref.TE.DotProductAttention(**attributes)
    keys = jax.random.split(jax.random.key(5), 4)
    q, k, v = (jax.random.normal(key, (2, 16, 2, 8)) for key in keys[:3])
    weights = jax.random.normal(keys[3], q.shape)

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * weights), out

    def ours(q, k, v):
        out = ours_module.apply(
            {}, *(reorder(t) for t in (q, k, v)), sequence_descriptor=ours_descriptor
        )
        return reorder(out, inverse=True)

    def theirs_in_order(q, k, v):
        return theirs_module.apply({}, q, k, v, in_order, deterministic=True)

    def theirs_reordered(q, k, v):
        out = theirs_module.apply(
            {}, *(reorder(t) for t in (q, k, v)), reordered, deterministic=True
        )
        return reorder(out, inverse=True)

    def run(attend):
        step = jax.jit(jax.value_and_grad(partial(loss, attend), argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = step(q, k, v)
        return out, grads

    with jax.set_mesh(make_mesh({"data": 8 // cp_size, "context": cp_size})):
        got = run(ours)
    errors = {"output": 0.0, "parameter gradients": 0.0}
    for expected in (run(theirs_in_order), run(theirs_reordered)):
        errors["output"] = max(errors["output"], ref.relative_error(got[0], expected[0]))
        # The gradients of q, k and v: the attention has no parameters.
        for a, b in zip(got[1], expected[1], strict=True):
            errors["parameter gradients"] = max(
                errors["parameter gradients"], ref.relative_error(a, b)
            )
    for what, error in errors.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"
    case = f"DotProductAttention packed, Striped, {cp_strategy} on {cp_size} devices"
    parity_results[(case, "none")] = {**errors, "FP8 state": 0.0}


def test_packed_attention_equals_te_segment_ids(parity_results):
    """te_flax's packed attention against TE's pure-JAX attention (its CPU path takes masks,
    not descriptors) given the mask the segments stand for (TE's rank-5 uint8 form)."""
    from te_flax.attention import SequenceDescriptor

    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 0]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 0]], jnp.int32)
    attributes = dict(
        head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd", max_segments_per_seq=2,
        attn_mask_type="padding_causal", transpose_batch_sequence=False,
    )  # fmt: skip
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (2, 8, 2, 8)) for key in keys)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    # TE's pure-JAX path takes a padding_causal mask as it is given (its fused path adds the
    # causal part itself): the mask TE gets carries the causality too.
    causal = jnp.tril(jnp.ones((8, 8), jnp.bool_))
    mask = jnp.logical_not(same & causal)[:, None, None].astype(jnp.uint8)  # [b, 1, 1, q, kv]
    theirs = ref.TE.DotProductAttention(**attributes).apply(
        {}, q, k, v, mask[:, 0], deterministic=True
    )
    ours = te_nn.DotProductAttention(**attributes).apply(
        {}, q, k, v, SequenceDescriptor.from_segment_ids_and_pos(ids, pos), deterministic=True
    )
    valid = (ids > 0)[..., None, None]
    error = ref.relative_error(jnp.where(valid, ours, 0.0), jnp.where(valid, theirs, 0.0))
    parity_results[("DotProductAttention packed (segment ids)", "none")] = {
        "output": error,
        "parameter gradients": 0.0,
        "FP8 state": 0.0,
    }
    assert error <= TOLERANCE


def test_a_row_of_queries_broadcasts_against_the_masks_batch_as_in_te():
    """MaxText's lazy init: one dummy row of queries with the real batch's mask."""
    from transformer_engine.jax.flax import DotProductAttention as TEDotProductAttention

    seq = 16
    q = jax.random.normal(jax.random.key(0), (1, seq, 2, 8))
    mask = jnp.zeros((2, 1, seq, seq), jnp.uint8).at[1, :, :, seq // 2 :].set(1)
    options = dict(
        head_dim=8,
        num_attention_heads=2,
        attn_mask_type="padding",
        transpose_batch_sequence=False,
    )
    theirs = TEDotProductAttention(**options).apply({}, q, q, q, mask)
    ours = te_nn.DotProductAttention(**options).apply({}, q, q, q, mask)
    assert ours.shape == theirs.shape == (2, seq, 2, 8)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
