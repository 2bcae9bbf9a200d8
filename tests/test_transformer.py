"""TE's attention and transformer layers against a reference written plainly in jnp.

The reference reads the Linen parameter tree and recomputes the layer from the maths: unfused
float32 norms and GEMMs, einsum attention with explicit boolean masks, rotary embeddings pair
by pair, T5 buckets from their definition. Forward outputs and every gradient (parameters and
inputs) must agree within 1e-5 in float32 without FP8, and within the FP8 tolerances of the
other module tests under delayed scaling.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax
import te_flax.linen as te_nn
from tests.helpers import (
    F32,
    HIGHEST,
    assert_close,
    normal,
    reference_dense,
    reference_norm,
)

TOL = 1e-5
BATCH, SEQ, HIDDEN, HEADS, HEAD_DIM = 2, 8, 32, 4, 8
LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)

# ----------------------------------------------------------------------------- the reference


def reference_keep(mask_type, pad_mask, q_len, kv_len, window=None, offset=0):
    """Which key each query attends (True: attend), ``[batch or 1, 1, q, kv]``, by definition."""
    keep = np.ones((1, 1, q_len, kv_len), bool)
    if "bottom_right" in mask_type:
        offset += kv_len - q_len
    for i in range(q_len):
        position = i + offset
        for j in range(kv_len):
            if "causal" in mask_type and j > position:
                keep[..., i, j] = False
            if window is not None:
                left, right = window
                if (left >= 0 and j < position - left) or (right >= 0 and j > position + right):
                    keep[..., i, j] = False
    keep = jnp.asarray(keep)
    if "padding" in mask_type:
        keep = jnp.logical_and(keep, jnp.logical_not(pad_mask))
    return keep


def reference_attention(q, k, v, keep, bias, scale):
    """Softmax attention with GQA by repeating the key/value heads, float32."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision=HIGHEST) * scale
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(keep, logits, LARGE_NEGATIVE)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnd->btnd", probs, v, precision=HIGHEST)


def reference_rope(x, method, positions, windows=(1, 10000)):
    """Pair (a, b) of features turns by ``position / timescale``; x ``[b, s, h, d]``."""
    d = x.shape[-1]
    half = np.arange(d // 2)
    a, b = (2 * half, 2 * half + 1) if method == "consecutive" else (half, half + d // 2)
    timescale = windows[0] * (windows[1] / windows[0]) ** (2 * half / d)
    angle = jnp.asarray(positions, F32)[:, None] / jnp.asarray(timescale, F32)[None, :]
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    out = x.at[..., a].set(x[..., a] * cos - x[..., b] * sin)
    return out.at[..., b].set(x[..., b] * cos + x[..., a] * sin)


def reference_buckets(q_len, k_len, num_buckets=32, max_distance=128, bidirectional=True):
    """T5's bucket of each (query, key) pair, one at a time."""
    out = np.zeros((q_len, k_len), np.int32)
    for i in range(q_len):
        for j in range(k_len):
            n, bucket, distance = num_buckets, 0, i - j
            if bidirectional:
                n //= 2
                bucket = n if distance < 0 else 0
                distance = abs(distance)
            else:
                distance = max(distance, 0)
            exact = n // 2
            if distance < exact:
                bucket += distance
            else:
                large = exact + int(
                    math.log(distance / exact + np.finfo(np.float32).eps)
                    / math.log(max_distance / exact)
                    * (n - exact)
                )
                bucket += min(large, n - 1)
            out[i, j] = bucket
    return out


def _norm(p, x, norm_type="layernorm"):
    return reference_norm(x, p["scale"], p.get("ln_bias"), norm_type)


def reference_mha(p, x_q, x_kv, cfg, mask=None, bias=None, self_attention=True):
    """TE's MultiHeadAttention from its parameters (``cfg``: the module's attributes)."""
    heads, groups = cfg["num_attention_heads"], cfg.get("num_gqa_groups") or HEADS
    d = cfg["head_dim"]
    b, s, _ = x_q.shape
    if "qkv" in p:
        ln = _norm(p["qkv"], x_q)
        qkv = reference_dense(ln, p["qkv"]["kernel"])  # [b, s, 3, heads * d]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        ln = _norm(p["query"], x_q)
        q = reference_dense(ln, p["query"]["kernel"])
        source = ln if self_attention else x_kv.astype(F32)
        if "kv" in p:
            kv = reference_dense(source, p["kv"]["kernel"])
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k = reference_dense(source, p["key"]["kernel"])
            v = reference_dense(source, p["value"]["kernel"])
    q = q.reshape(b, s, heads, d)
    k, v = k.reshape(b, -1, groups, d), v.reshape(b, -1, groups, d)
    if cfg.get("enable_rotary_pos_emb"):
        method = cfg.get("rotary_pos_emb_group_method", "consecutive")
        q = reference_rope(q, method, np.arange(q.shape[1]))
        k = reference_rope(k, method, np.arange(k.shape[1]))
    keep = reference_keep(
        cfg.get("attn_mask_type", "causal"), mask, q.shape[1], k.shape[1], cfg.get("window_size")
    )
    scale = 1 / math.sqrt(d) if cfg.get("scale_attn_logits") else 1.0
    if bias is not None and cfg.get("attn_bias_type") == "pre_scale_bias":
        bias = bias * scale
    context = reference_attention(q, k, v, keep, bias, scale).reshape(b, s, heads * d)
    return reference_dense(context, p["out"]["kernel"]), ln


def reference_mlp(p, x, gated):
    ln = _norm(p, x)
    h = jnp.einsum("bsh,hai->bsai", ln, p["wi_kernel"], precision=HIGHEST)
    act = jax.nn.silu(h[:, :, 0]) * h[:, :, 1] if gated else jax.nn.relu(h[:, :, 0])
    return reference_dense(act, p["wo_kernel"])


def reference_layer(p, x, cfg, encoded=None, attention_mask=None, cross_mask=None):
    """TE's TransformerLayer (deterministic) from its parameters."""
    decoder = cfg.get("layer_type") == te_nn.TransformerLayerType.DECODER
    mha = dict(num_attention_heads=HEADS, head_dim=HIDDEN // HEADS, **cfg.get("mha", {}))
    bias = None
    if "relpos_bias" in p:
        buckets = reference_buckets(x.shape[1], x.shape[1], bidirectional=not decoder)
        bias = p["relpos_bias"]["rel_embedding"][:, buckets][None]
    x = x.astype(F32)
    name = "self_attention" if decoder else "attention"
    y, _ = reference_mha(p[name], x, x, mha, attention_mask, bias)
    x = x + y
    if decoder:
        cross = dict(mha, attn_mask_type="padding")
        y, _ = reference_mha(p["encoder_decoder_attention"], x, encoded, cross, cross_mask,
                             self_attention=False)  # fmt: skip
        x = x + y
    gated = tuple(cfg.get("mlp_activations", ("relu",))) == ("silu", "linear")
    return x + reference_mlp(p["mlp"], x, gated)


# ----------------------------------------------------------------------------- helpers


def _inputs(shape=(BATCH, SEQ, HIDDEN), seed=0):
    return normal(jax.random.key(seed), shape)


def _padding_mask(q_len, kv_len, valid_q=(8, 5), valid_kv=(8, 5)):
    """TE's padding mask: True where the query or the key is padding."""
    q = np.arange(q_len)[None, :] >= np.asarray(valid_q)[:, None]
    k = np.arange(kv_len)[None, :] >= np.asarray(valid_kv)[:, None]
    return jnp.asarray(q[:, None, :, None] | k[:, None, None, :])  # [b, 1, q, kv]


def _unbox(variables):
    return nn.meta.unbox(variables)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _check_against_reference(forward, reference, variables, args, tol=TOL):
    """Forward and all gradients (parameters and float32 inputs) of ``forward`` vs ``reference``.

    ``forward(variables, *args)`` runs the module; ``reference(params, *args)`` the maths.
    """
    params = variables["params"]
    out = forward(variables, *args)
    assert_close(out, reference(params, *args), tol, "forward")
    cotangent = normal(jax.random.key(7), out.shape)
    floats = [i for i, a in enumerate(args) if isinstance(a, jax.Array) and a.dtype == F32]

    def gradients(fn):
        def loss(params, float_args):
            full = list(args)
            for i, value in zip(floats, float_args, strict=True):
                full[i] = value
            return jnp.sum(fn(params, *full) * cotangent)

        return jax.grad(loss, argnums=(0, 1))(params, [args[i] for i in floats])

    ours = gradients(lambda p, *a: forward({**variables, "params": p}, *a))
    theirs = gradients(reference)
    for (path, a), (_, e) in zip(
        jax.tree_util.tree_leaves_with_path(ours),
        jax.tree_util.tree_leaves_with_path(theirs),
        strict=True,
    ):
        assert_close(a, e, tol, f"gradient {jax.tree_util.keystr(path)}")


def _mha(**attributes):
    defaults = dict(head_dim=HEAD_DIM, num_attention_heads=HEADS, transpose_batch_sequence=False)
    return te_nn.MultiHeadAttention(**{**defaults, **attributes}), {**defaults, **attributes}


# ----------------------------------------------------------------------------- attention


MASK_CASES = [
    ("no_mask", SEQ),
    ("padding", SEQ),
    ("causal", SEQ),
    ("padding_causal", SEQ),
    ("causal_bottom_right", 12),
    ("padding_causal_bottom_right", 12),
]


@pytest.mark.parametrize("mask_type,kv_len", MASK_CASES)
def test_cross_attention_for_every_mask_type_matches_the_reference(mask_type, kv_len):
    module, cfg = _mha(attn_mask_type=mask_type)
    x, encoded = _inputs(), _inputs((BATCH, kv_len, HIDDEN), seed=1)
    mask = _padding_mask(SEQ, kv_len, valid_kv=(kv_len, kv_len - 3))
    variables = _unbox(module.init(jax.random.key(1), x, encoded, mask))
    assert set(variables["params"]) == {"query", "kv", "out"}

    def forward(variables, x, encoded, mask):
        return module.apply(variables, x, encoded, mask)[0]

    def reference(p, x, encoded, mask):
        return reference_mha(p, x, encoded, cfg, mask, self_attention=False)[0]

    _check_against_reference(forward, reference, variables, (x, encoded, mask))


SELF_ATTENTION_CASES = {
    "fused-qkv": dict(),
    "gqa": dict(num_gqa_groups=2),
    "mqa-unfused": dict(num_gqa_groups=1, fuse_qkv_params=False),
    "scaled-logits": dict(fuse_qkv_params=False, scale_attn_logits=True, scaled_query_init=False),
    "rope": dict(enable_rotary_pos_emb=True),
    "rope-alternate": dict(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate"),
    "sliding-window": dict(window_size=(2, 0)),
    "window-no-mask": dict(attn_mask_type="no_mask", window_size=(1, 2)),
    "gqa-padding-window": dict(
        attn_mask_type="padding_causal", num_gqa_groups=2, window_size=(3, -1)
    ),
}


@pytest.mark.parametrize("case", list(SELF_ATTENTION_CASES))
def test_self_attention_variants_match_the_reference(case):
    module, cfg = _mha(**SELF_ATTENTION_CASES[case])
    x, mask = _inputs(), _padding_mask(SEQ, SEQ)
    variables = _unbox(module.init(jax.random.key(1), x, x, mask))
    names = {"qkv", "out"} if "qkv" in variables["params"] else None
    assert names or case in ("gqa", "mqa-unfused", "scaled-logits", "gqa-padding-window")

    def forward(variables, x, mask):
        return module.apply(variables, x, x, mask)[0]  # inputs_q is inputs_kv

    def reference(p, x, mask):
        return reference_mha(p, x, x, cfg, mask)[0]

    _check_against_reference(forward, reference, variables, (x, mask))


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias", None])
def test_attention_bias_types_match_the_reference(bias_type):
    module, cfg = _mha(attn_bias_type=bias_type, scale_attn_logits=True)
    x, bias = _inputs(), normal(jax.random.key(3), (1, HEADS, SEQ, SEQ))
    variables = _unbox(module.init(jax.random.key(1), x, x, None, bias))

    def forward(variables, x, bias):
        return module.apply(variables, x, x, None, bias)[0]

    def reference(p, x, bias):
        return reference_mha(p, x, x, cfg, None, bias)[0]

    _check_against_reference(forward, reference, variables, (x, bias))


def test_relative_position_buckets_and_biases_match_t5():
    for bidirectional in (True, False):
        for q_len, k_len in ((5, 5), (40, 300)):
            np.testing.assert_array_equal(
                te_flax.attention.relative_position_buckets(q_len, k_len, 32, 128, bidirectional),
                reference_buckets(q_len, k_len, 32, 128, bidirectional),
            )
    rpb = te_nn.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=4)
    bias, variables = rpb.init_with_output(jax.random.key(0), 6, 9, False)
    table = _unbox(variables)["params"]["rel_embedding"]  # TE's parameter name
    np.testing.assert_array_equal(
        bias, table[:, reference_buckets(6, 9, bidirectional=False)][None]
    )
