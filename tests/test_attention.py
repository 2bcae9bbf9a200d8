"""The attention core against a NumPy reference, and the structure of the composite layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax import attention as attn
from te_flax._layers.attention import ATTENTION_FROM_MHA, MultiHeadAttentionDescription
from te_flax._layers.transformer import (
    ATTENTION_FROM_LAYER,
    MLP_FROM_LAYER,
    NORM_FROM_LAYER,
    TransformerLayerDescription,
)

BATCH, SEQ, HEADS, GROUPS, HEAD_DIM = 2, 6, 4, 2, 8


def reference_attention(q, k, v, keep, scale):
    """``softmax(q.k * scale, masked) . v`` in float64, GQA by repeating the key/value heads;
    a fully masked row gives zeros. ``keep``: ``[batch, q, kv]`` booleans (True: attend)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    mask = keep[:, None]
    logits = np.where(mask, logits, -np.inf)
    top = np.max(np.where(mask, logits, -1e300), axis=-1, keepdims=True)
    weights = np.where(mask, np.exp(logits - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    probs = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def _qkv(seed=0, seq=SEQ):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (BATCH, seq, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(keys[1], (BATCH, seq, GROUPS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(keys[2], (BATCH, seq, GROUPS, HEAD_DIM), jnp.float32)
    return q, k, v


@pytest.mark.parametrize(
    "mask_type, window", [("causal", None), ("no_mask", (2, 1)), ("causal", (2, 0))]
)
def test_attention_equals_the_reference(mask_type, window):
    q, k, v = _qkv()
    out = attn.dot_product_attention(
        q, k, v, attn_mask_type=mask_type, window_size=window, implementation="xla"
    )
    i, j = np.arange(SEQ)[:, None], np.arange(SEQ)[None, :]
    keep = np.ones((SEQ, SEQ), bool)
    if mask_type == "causal":
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    expected = reference_attention(
        q, k, v, np.broadcast_to(keep, (BATCH, SEQ, SEQ)), HEAD_DIM**-0.5
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_padding_mask_in_te_forms_equals_the_reference():
    """TE's masks: True (or nonzero) masks out; ``[b, 1, q, kv]`` and rank-5 uint8 alike."""
    q, k, v = _qkv(1)
    lengths = np.array([4, 6])
    valid = np.arange(SEQ)[None, :] < lengths[:, None]  # [b, s]
    keep = valid[:, :, None] & valid[:, None, :]  # [b, q, kv]
    expected = reference_attention(q, k, v, keep, HEAD_DIM**-0.5)
    mask4 = jnp.asarray(~keep[:, None])
    out = attn.dot_product_attention(q, k, v, mask4, attn_mask_type="padding")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


TABLES = [
    (ATTENTION_FROM_MHA, MultiHeadAttentionDescription),
    (ATTENTION_FROM_LAYER, TransformerLayerDescription),
    (MLP_FROM_LAYER, TransformerLayerDescription),
    (NORM_FROM_LAYER, TransformerLayerDescription),
]


@pytest.mark.parametrize("table, owner", TABLES)
def test_shared_attribute_tables_name_real_fields(table, owner):
    """Each table copies owner fields to sublayer fields: a renamed or dropped attribute on
    either side fails here, not as a silently ignored attribute."""
    target_fields = {f.name for f in dataclasses.fields(table.target)}
    owner_fields = {f.name for f in dataclasses.fields(owner)}
    for target, source in table.pairs():
        assert target in target_fields, (table.target.__name__, target)
        assert source in owner_fields, (owner.__name__, source)


def test_transformer_layer_names_its_sublayers_by_description_type():
    from te_flax._layers.attention import RelativePositionBiasesDescription
    from te_flax._layers.composite import DropoutDescription
    from te_flax._layers.linear import LayerNormMLPDescription

    children = TransformerLayerDescription(hidden_size=32, num_attention_heads=4).children()
    kinds = {name: child.kind for name, child in children.items()}
    assert kinds == {
        "relpos_bias": RelativePositionBiasesDescription,
        "attention": MultiHeadAttentionDescription,
        "dropout": DropoutDescription,
        "mlp": LayerNormMLPDescription,
    }
    assert children["mlp"].attributes["intermediate_dim"] == 2048
    assert children["attention"].attributes["head_dim"] == 8


# ------------------------------------------------------------------ input width != hidden_size


def test_transformer_layer_input_width_differs_from_hidden_size_in_linen_and_nnx():
    """As in TE: hidden_size sets the attention width (head_dim 16 / 4 heads = 4); the
    output projection and the MLP return the input's width (24); NNX agrees with Linen."""
    import flax.linen as nn
    from flax import nnx

    import te_flax.linen as te_nn
    import te_flax.nnx as te_nnx

    attributes = dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=4)
    x = jax.random.normal(jax.random.key(1), (2, 5, 24))
    layer = te_nn.TransformerLayer(**attributes)
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x, deterministic=True))
    out = layer.apply(variables, x, deterministic=True)
    assert out.shape == x.shape
    shapes = jax.tree.map(jnp.shape, variables["params"])
    assert shapes["attention"]["qkv"]["kernel"] == (24, 3, 16)
    assert shapes["attention"]["out"]["kernel"] == (16, 24)
    assert shapes["mlp"]["wi_kernel"] == (24, 1, 32)
    assert shapes["mlp"]["wo_kernel"] == (32, 24)

    module = te_nnx.TransformerLayer(in_features=24, **attributes, rngs=nnx.Rngs(0))
    nnx.update(module, nnx.State(jax.tree.map(nnx.Param, variables["params"])))
    np.testing.assert_allclose(module(x, deterministic=True), out, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="build it with in_features"):
        module(jnp.ones((2, 5, 16)), deterministic=True)
