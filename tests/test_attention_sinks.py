"""TransformerEngine's softmax types (attention sinks): ``off_by_one`` and ``learnable``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.attention import dot_product_attention
from te_flax.convert import from_transformer_engine, to_transformer_engine
from tests.helpers import assert_close, normal

B, S, H, D = 2, 6, 4, 8
TOL = 1e-5


def _qkv(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(normal(k, (B, S, H, D)) for k in keys)


def _reference(q, k, v, sink, keep):
    """Softmax over each row's logits and one more, the sink, whose probability is dropped;
    masked positions and fully masked rows get probability 0."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(D)
    logits = jnp.where(keep, logits, -1e30)
    if sink is not None:
        column = jnp.broadcast_to(sink.reshape(1, -1, 1, 1), (*logits.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(keep, probs, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def _padding(valid=(6, 3)):
    """TE's padding mask (True = masked): the second sequence has 3 valid positions."""
    position = jnp.arange(S)[None, :] < jnp.asarray(valid)[:, None]
    return ~(position[:, None, :, None] & position[:, None, None, :])


@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one", "learnable"])
def test_sinks_match_the_reference_with_gradients(softmax_type):
    q, k, v = _qkv()
    mask = _padding()
    offset = jnp.array([0.5, -1.0, 2.0, 0.0]).reshape(1, H, 1, 1)
    sink = {"vanilla": None, "off_by_one": jnp.zeros(H), "learnable": offset}[softmax_type]
    cotangent = normal(jax.random.key(9), (B, S, H, D))

    def ours(q, k, v, offset):
        out = dot_product_attention(
            q, k, v, mask, attn_mask_type="padding", softmax_type=softmax_type,
            softmax_offset=offset if softmax_type == "learnable" else None,
        )  # fmt: skip
        return jnp.sum(out * cotangent)

    def reference(q, k, v, offset):
        used = offset if softmax_type == "learnable" else sink
        return jnp.sum(_reference(q, k, v, used, ~mask) * cotangent)

    got = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(q, k, v, offset)
    expected = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(q, k, v, offset)
    assert_close(got[0], expected[0], TOL, "loss")
    for name, a, e in zip("qkv", got[1][:3], expected[1][:3], strict=True):
        assert_close(a, e, TOL, name)
    if softmax_type == "learnable":
        assert_close(got[1][3], expected[1][3], TOL, "softmax_offset")
        assert np.all(np.asarray(got[1][3]) != 0)


@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one"])
def test_a_padding_query_gets_zero_output_and_sends_no_gradient(softmax_type):
    q, k, v = _qkv()
    mask = _padding()

    def attend(v):
        return dot_product_attention(q, k, v, mask, attn_mask_type="padding",
                                     softmax_type=softmax_type)  # fmt: skip

    out = attend(v)
    np.testing.assert_array_equal(out[1, 3:], 0.0)  # the second sequence's padding queries
    # A cotangent on the padding queries alone reaches no value.
    cotangent = jnp.zeros_like(out).at[1, 3:].set(1.0)
    (grad_v,) = jax.vjp(attend, v)[1](cotangent)
    np.testing.assert_array_equal(grad_v, 0.0)


def test_off_by_one_lets_a_query_attend_to_nothing():
    """With every logit far below 0 the sink takes the probability: the output goes to 0."""
    _, _, v = _qkv()
    q = jnp.full((B, S, H, D), 3.0)  # every logit is -9 * D / sqrt(D), about -25
    out = dot_product_attention(q, -q, v, attn_mask_type="no_mask", softmax_type="off_by_one")
    vanilla = dot_product_attention(q, -q, v, attn_mask_type="no_mask")
    assert float(jnp.abs(out).max()) < 1e-3 * float(jnp.abs(vanilla).max())


def test_learnable_sink_is_a_parameter_in_linen_and_nnx():
    x = normal(jax.random.key(0), (B, S, 32))
    attributes = dict(
        hidden_size=32,
        mlp_hidden_size=64,
        num_attention_heads=H,
        softmax_type="learnable",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    linen = te_nn.TransformerLayer(**attributes)
    variables = nn.meta.unbox(linen.init(jax.random.key(0), x, deterministic=True))
    sink = variables["params"]["attention"]["softmax_offset"]
    assert sink.shape == (1, H, 1, 1) and sink.dtype == jnp.float32
    np.testing.assert_array_equal(sink, 0.0)  # TE's initial sink
    params = jax.tree.map(lambda p: p + 0.3, variables["params"])
    module = te_nnx.TransformerLayer(**attributes, rngs=nnx.Rngs(0))
    nnx.update(module, nnx.State(jax.tree.map(lambda p: nnx.Param(p), params)))
    expected = linen.apply({"params": params}, x, deterministic=True)
    assert_close(module(x, deterministic=True), expected, TOL, "NNX vs Linen")
    grads = jax.grad(lambda p: jnp.sum(linen.apply({"params": p}, x, deterministic=True)))(params)
    assert np.all(np.asarray(grads["attention"]["softmax_offset"]) != 0)


def test_sinks_convert_from_and_to_transformer_engines_tree():
    """TE keeps the sink in its attention backend's submodule (and, in MultiHeadAttention,
    under DotProductAttention_0); te_flax on the attention module."""
    sink = jnp.arange(4.0).reshape(1, 4, 1, 1)
    kernel = jnp.ones((2, 2))
    te_tree = {"params": {"attention": {
        "DotProductAttention_0": {"_UnfusedDotProductAttention_0": {"softmax_offset": sink}},
        "qkv": {"kernel": kernel},
    }}}  # fmt: skip
    ours = from_transformer_engine(te_tree)
    assert set(ours["params"]["attention"]) == {"softmax_offset", "qkv"}
    back = to_transformer_engine(ours)
    assert jax.tree.structure(back) == jax.tree.structure(te_tree)
    gpu_tree = {"params": {"_FusedDotProductAttention_0": {"softmax_offset": sink}}}
    assert set(from_transformer_engine(gpu_tree)["params"]) == {"softmax_offset"}
    dpa = to_transformer_engine(from_transformer_engine(gpu_tree))["params"]
    assert set(dpa) == {"_UnfusedDotProductAttention_0"}


def test_bad_softmax_arguments_say_what_to_do():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        te_nn.DotProductAttention(head_dim=D, num_attention_heads=H, softmax_type="sink").init(
            jax.random.key(0), q, k, v
        )
    with pytest.raises(ValueError, match="needs softmax_offset"):
        dot_product_attention(q, k, v, softmax_type="learnable")
    with pytest.raises(ValueError, match="pass softmax_offset=None"):
        dot_product_attention(q, k, v, softmax_type="off_by_one", softmax_offset=jnp.zeros(H))
    with pytest.raises(ValueError, match="one logit per head"):
        dot_product_attention(q, k, v, softmax_type="learnable", softmax_offset=jnp.zeros(3))
    with pytest.raises(ValueError, match="XLA attention only"):
        dot_product_attention(q, k, v, softmax_type="off_by_one", implementation="cudnn")
    # TE's docstring spelling is accepted.
    dot_product_attention(q, k, v, softmax_type="off-by-one")
