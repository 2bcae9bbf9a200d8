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
from flax import nnx

import te_flax
import te_flax.convert
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import DelayedScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT, merge_fp8_state
from tests.helpers import (
    F32,
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    HIGHEST,
    assert_close,
    normal,
    reference_dense,
    reference_norm,
    relative_error,
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
    # TE's masked softmax: a masked position has probability 0, a fully masked row (a padding
    # query) all zeros.
    probs = jnp.where(keep, jax.nn.softmax(logits, axis=-1), 0.0)
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
    if "scale" not in p:  # no input norm (output_layernorm): the "norm output" is the input
        return x.astype(F32)
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


# The MLP activations of the reference layer; TE's "gelu" is the tanh approximation.
_ACTIVATIONS = {"gelu": lambda h: jax.nn.gelu(h, approximate=True), "relu": jax.nn.relu}


def reference_mlp(p, x, activations):
    ln = _norm(p, x)
    h = jnp.einsum("bsh,hai->bsai", ln, p["wi_kernel"], precision=HIGHEST)
    if tuple(activations) == ("silu", "linear"):
        act = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
    else:
        (activation,) = activations
        act = _ACTIVATIONS[activation](h[:, :, 0])
    return reference_dense(act, p["wo_kernel"]), ln


def reference_layer(p, x, cfg, encoded=None, attention_mask=None, cross_mask=None):
    """TE's TransformerLayer (deterministic) from its parameters; ``cfg``: its attributes."""
    decoder = cfg.get("layer_type") == te_nn.TransformerLayerType.DECODER
    post_ln = cfg.get("apply_residual_connection_post_layernorm", False)
    mha = dict(
        num_attention_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        attn_mask_type=cfg.get("self_attn_mask_type", "causal"),
        num_gqa_groups=cfg.get("num_gqa_groups"),
        enable_rotary_pos_emb=cfg.get("enable_rotary_pos_emb", False),
        rotary_pos_emb_group_method=cfg.get("rotary_pos_emb_group_method", "consecutive"),
    )
    bias = None
    if "relpos_bias" in p:
        buckets = reference_buckets(x.shape[1], x.shape[1], bidirectional=not decoder)
        bias = p["relpos_bias"]["rel_embedding"][:, buckets][None]
    x = x.astype(F32)
    name = "self_attention" if decoder else "attention"
    y, ln = reference_mha(p[name], x, x, mha, attention_mask, bias)
    x = y + (ln if post_ln else x)
    if decoder:
        # The cross-attention is position-free (no rotary embedding), unlike TE's.
        cross = dict(mha, attn_mask_type="padding", enable_rotary_pos_emb=False)
        y, ln = reference_mha(p["encoder_decoder_attention"], x, encoded, cross, cross_mask,
                              self_attention=False)  # fmt: skip
        x = y + (ln if post_ln else x)
    y, ln = reference_mlp(p["mlp"], x, cfg.get("mlp_activations", ("gelu",)))
    x = y + (ln if post_ln else x)
    if "output_layernorm" in p:
        x = _norm(p["output_layernorm"], x)
    return x


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
    separate = case in ("gqa", "mqa-unfused", "scaled-logits", "gqa-padding-window")
    # One fused qkv kernel for self-attention without GQA when fuse_qkv_params (TE's layout).
    assert ("qkv" in variables["params"]) == (not separate)

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


# ----------------------------------------------------------------------------- TransformerLayer

DECODER = te_nn.TransformerLayerType.DECODER
LAYER_CASES = {
    "encoder-relpos": dict(),
    "encoder-swiglu-rope-gqa": dict(
        mlp_activations=("silu", "linear"),
        enable_relative_embedding=False,
        enable_rotary_pos_emb=True,
        num_gqa_groups=2,
        self_attn_mask_type="padding",
    ),
    "encoder-output-layernorm": dict(output_layernorm=True, self_attn_mask_type="no_mask"),
    "encoder-post-layernorm-residual": dict(apply_residual_connection_post_layernorm=True),
    "decoder-cross-attention": dict(layer_type=DECODER, self_attn_mask_type="padding_causal"),
    "decoder-unfused-rope": dict(
        layer_type=DECODER,
        fuse_qkv_params=False,
        enable_relative_embedding=False,
        enable_rotary_pos_emb=True,
        rotary_pos_emb_group_method="alternate",
    ),
}


def _layer(**attributes):
    base = dict(hidden_size=HIDDEN, mlp_hidden_size=64, num_attention_heads=HEADS)
    return te_nn.TransformerLayer(**{**base, **attributes})


def _layer_inputs(cfg):
    x, encoded = _inputs(), _inputs((BATCH, 6, HIDDEN), seed=2)
    mask = _padding_mask(SEQ, SEQ)
    cross_mask = _padding_mask(SEQ, 6, valid_kv=(6, 4))
    decoder = cfg.get("layer_type") == DECODER
    return (x, encoded if decoder else None, mask, cross_mask if decoder else None)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_transformer_layer_matches_the_reference(case):
    cfg = LAYER_CASES[case]
    layer = _layer(**cfg)
    x, encoded, mask, cross_mask = _layer_inputs(cfg)
    variables = _unbox(layer.init(jax.random.key(1), x, encoded, mask, cross_mask, True))

    def forward(variables, x, encoded, mask, cross_mask):
        return layer.apply(variables, x, encoded, mask, cross_mask, deterministic=True)

    def reference(p, x, encoded, mask, cross_mask):
        return reference_layer(p, x, cfg, encoded, mask, cross_mask)

    _check_against_reference(forward, reference, variables, (x, encoded, mask, cross_mask))


def test_transpose_batch_sequence_transposes_inputs_and_nothing_else():
    x = _inputs()
    layer, transposed = _layer(), _layer(transpose_batch_sequence=True)
    variables = layer.init(jax.random.key(1), x, deterministic=True)
    y = layer.apply(variables, x, deterministic=True)
    y_t = transposed.apply(variables, jnp.swapaxes(x, 0, 1), deterministic=True)
    assert_close(jnp.swapaxes(y_t, 0, 1), y, TOL)


def test_parameter_tree_names_are_transformer_engines():
    x, encoded, _, cross_mask = _layer_inputs(dict(layer_type=DECODER))
    layer = _layer(layer_type=DECODER, output_layernorm=True)
    variables = layer.init(jax.random.key(0), x, encoded, None, cross_mask, deterministic=True)
    shapes = jax.tree.map(jnp.shape, _unbox(variables)["params"])
    assert shapes == {
        "relpos_bias": {"rel_embedding": (HEADS, 32)},
        "self_attention": {
            "qkv": {"kernel": (HIDDEN, 3, HIDDEN)},
            "out": {"kernel": (HIDDEN, HIDDEN)},
        },
        "encoder_decoder_attention": {
            "query": {"kernel": (HIDDEN, HIDDEN), "ln_bias": (HIDDEN,), "scale": (HIDDEN,)},
            "kv": {"kernel": (HIDDEN, 2, HIDDEN)},
            "out": {"kernel": (HIDDEN, HIDDEN)},
        },
        "mlp": {"ln_bias": (HIDDEN,), "scale": (HIDDEN,), "wi_kernel": (HIDDEN, 1, 64),
                "wo_kernel": (64, HIDDEN)},
        "output_layernorm": {"ln_bias": (HIDDEN,), "scale": (HIDDEN,)},
    }  # fmt: skip


def _fp8_layer_step(layer, variables, x):
    """One differentiated step: (output, parameter gradients, new FP8 state)."""
    cotangent = normal(jax.random.key(7), x.shape)

    def loss(variables):
        variables = merge_fp8_state(variables)
        return jnp.sum(layer.apply(variables, x, deterministic=True) * cotangent)

    grads = jax.jit(jax.grad(loss))(variables)
    return grads["params"], grads[OVERWRITE_WITH_GRADIENT]


def test_fp8_transformer_layer_is_within_fp8_tolerance_and_updates_every_gemms_state():
    recipe = DelayedScaling(amax_history_len=4)
    layer = _layer(mlp_activations=("silu", "linear"), recipe=recipe)
    x = _inputs()
    variables = _unbox(layer.init(jax.random.key(1), x, deterministic=True))
    fp8 = variables[OVERWRITE_WITH_GRADIENT]
    # Every GEMM keeps its own delayed-scaling state: qkv, out, and the MLP's two.
    assert set(fp8) == {"attention", "mlp"} and set(fp8["attention"]) == {"qkv", "out"}
    assert {n for n in fp8["mlp"] if n.endswith("scale_inv")} == {
        f"{role}_{i}_scale_inv" for role in ("x", "kernel", "grad") for i in (0, 1)
    }
    _, new_fp8 = _fp8_layer_step(layer, variables, x)
    for path, history in jax.tree_util.tree_leaves_with_path(new_fp8):
        if jax.tree_util.keystr(path).endswith("amax_history']"):
            assert history[0] > 0 and np.all(history[1:] == 0), jax.tree_util.keystr(path)
    # The second step quantizes with the scales of the first: compare it with the maths.
    variables = {**variables, OVERWRITE_WITH_GRADIENT: new_fp8}
    params = variables["params"]
    y = layer.apply(variables, x, deterministic=True)
    expected = reference_layer(params, x, dict(mlp_activations=("silu", "linear")))
    assert relative_error(y, expected) < FP8_FORWARD_TOLERANCE
    grads, _ = _fp8_layer_step(layer, variables, x)
    cotangent = normal(jax.random.key(7), x.shape)
    expected_grads = jax.grad(
        lambda p: jnp.sum(
            reference_layer(p, x, dict(mlp_activations=("silu", "linear"))) * cotangent
        )
    )(params)
    for (path, a), (_, e) in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree_util.tree_leaves_with_path(expected_grads),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        # The attention's gradients come through the MLP's two FP8 dgrad GEMMs and the output
        # projection's before its own: the e5m2 roundings of a chain of GEMMs compound (the
        # norm scale of the QKV projection measured 0.156 for one draw of the parameters).
        tolerance = FP8_BACKWARD_TOLERANCE * (1.5 if name.startswith("['attention']") else 1)
        assert relative_error(a, e) < tolerance, name


def test_lora_scope_adds_adapters_that_start_at_zero():
    x = _inputs()
    base = _layer()
    variables = _unbox(base.init(jax.random.key(0), x, deterministic=True))
    lora = _layer(low_rank_adaptation_scope="exclude_mlp", low_rank_adaptation_dim=4)
    lora_variables = _unbox(lora.init(jax.random.key(0), x, deterministic=True))
    params = lora_variables["params"]
    assert params["attention"]["qkv"]["lora_a_kernel"].shape == (HIDDEN, 3, 4)
    assert params["attention"]["out"]["lora_b_kernel"].shape == (4, HIDDEN)
    assert not any("lora" in name for name in params["mlp"])
    # B starts at zero: with the base layer's weights the output is the base layer's.
    merged = jax.tree.map(lambda a: a, params)
    for path in (("attention", "qkv"), ("attention", "out"), ("mlp",)):
        target, source = merged, variables["params"]
        for key in path:
            target, source = target[key], source[key]
        target.update({k: v for k, v in source.items() if "lora" not in k})
    np.testing.assert_array_equal(
        lora.apply({"params": merged}, x, deterministic=True),
        base.apply(variables, x, deterministic=True),
    )


def test_bf16_compute_keeps_the_input_dtype_and_tracks_float32():
    x = _inputs()
    layer = _layer(dtype=jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    y = layer.apply(variables, x.astype(jnp.bfloat16), deterministic=True)
    assert y.dtype == jnp.bfloat16
    expected = reference_layer(_unbox(variables)["params"], x, {})
    assert relative_error(y, expected) < 0.02
    assert layer.apply(variables, x, deterministic=True).dtype == F32


def test_integer_masks_as_in_te_examples_and_nnx_without_a_dropout_stream():
    x, mask = _inputs(), _padding_mask(SEQ, SEQ)
    layer = _layer(self_attn_mask_type="padding", enable_relative_embedding=False)
    variables = layer.init(jax.random.key(0), x, attention_mask=mask, deterministic=True)
    as_bool = layer.apply(variables, x, attention_mask=mask, deterministic=True)
    as_uint8 = layer.apply(variables, x, attention_mask=mask.astype(jnp.uint8), deterministic=True)
    np.testing.assert_array_equal(as_uint8, as_bool)
    with pytest.raises(TypeError, match="boolean or integer"):
        layer.apply(variables, x, attention_mask=mask.astype(F32), deterministic=True)
    # No dropout anywhere: an NNX layer needs no "dropout" RNG stream.
    quiet = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)
    model = te_nnx.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=64, num_attention_heads=HEADS, **quiet,
        rngs=nnx.Rngs(params=0),
    )  # fmt: skip
    assert model(x).shape == x.shape


# ----------------------------------------------------------------------------- Linen vs NNX


def _nnx_layer(cfg, seed=7):
    """The NNX layer; ``seed`` is an int or an ``nnx.Rngs``."""
    base = dict(hidden_size=HIDDEN, mlp_hidden_size=64, num_attention_heads=HEADS)
    rngs = seed if isinstance(seed, nnx.Rngs) else nnx.Rngs(seed)
    return te_nnx.TransformerLayer(**base, **cfg, rngs=rngs)


def _equal_trees(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


@pytest.mark.parametrize("case", ["encoder-relpos", "decoder-cross-attention"])
def test_linen_and_nnx_agree_bit_for_bit_with_fp8(case):
    cfg = dict(LAYER_CASES[case], recipe=DelayedScaling(amax_history_len=4))
    layer, args = _layer(**cfg), _layer_inputs(cfg)
    variables = _unbox(layer.init(jax.random.key(1), *args, True))
    model = _nnx_layer(cfg)
    te_nnx.load_linen_variables(model, variables)
    _equal_trees(te_nnx.linen_variables(model), variables)
    target = normal(jax.random.key(5), args[0].shape)

    def linen_loss(variables):
        out = layer.apply(merge_fp8_state(variables), *args, deterministic=True)
        return jnp.mean((out - target) ** 2)

    def nnx_loss(model):
        return jnp.mean((model(*args, deterministic=True) - target) ** 2)

    value, grads = jax.jit(jax.value_and_grad(linen_loss))(variables)
    nnx_value, nnx_grads = nnx.jit(te_nnx.value_and_grad(nnx_loss))(model)
    np.testing.assert_array_equal(nnx_value, value)
    _equal_trees(nnx.to_pure_dict(nnx.state(nnx_grads, nnx.Param)), grads["params"])
    fp8_grads = nnx.to_pure_dict(nnx.state(nnx_grads, te_nnx.Fp8Meta))
    _equal_trees(fp8_grads, grads[OVERWRITE_WITH_GRADIENT])


def test_nnx_attention_modules_agree_with_linen():
    x, mask = _inputs(), _padding_mask(SEQ, 6, valid_kv=(6, 4))
    encoded = _inputs((BATCH, 6, 16), seed=3)
    attributes = dict(num_gqa_groups=2, attn_mask_type="padding", transpose_batch_sequence=False)
    linen = te_nn.MultiHeadAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS, **attributes)
    variables = linen.init(jax.random.key(0), x, encoded, mask)
    module = te_nnx.MultiHeadAttention(
        HIDDEN, HEAD_DIM, HEADS, in_kv_features=16, **attributes, rngs=nnx.Rngs(3)
    )
    te_nnx.load_linen_variables(module, variables)
    np.testing.assert_array_equal(
        module(x, encoded, mask)[0], linen.apply(variables, x, encoded, mask)[0]
    )
    with pytest.raises(ValueError, match="in_kv_features"):
        te_nnx.MultiHeadAttention(HIDDEN, HEAD_DIM, HEADS, rngs=nnx.Rngs(0))(x, x + 1)
    rpb = te_nn.RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2)
    rpb_variables = rpb.init(jax.random.key(0), 5, 5)
    nnx_rpb = te_nnx.RelativePositionBiases(8, 16, 2, rngs=nnx.Rngs(1))
    te_nnx.load_linen_variables(nnx_rpb, rpb_variables)
    np.testing.assert_array_equal(nnx_rpb(5, 5), rpb.apply(rpb_variables, 5, 5))


# ----------------------------------------------------------------------------- decoding

VOCAB, LENGTH = 11, 7


class _TinyDecoder(nn.Module):
    """An embedding, one DECODER TransformerLayer over an encoder output, tied logits."""

    layer_attributes: dict

    @nn.compact
    def __call__(self, tokens, encoded, decode=False):
        embed = nn.Embed(VOCAB, HIDDEN, name="embed")
        x = embed(tokens)  # [batch, seq, hidden]
        cross_mask = jnp.zeros((tokens.shape[0], 1, tokens.shape[1], encoded.shape[1]), bool)
        x = _layer(**self.layer_attributes, name="decoder")(
            x, encoded, None, cross_mask, deterministic=True, decode=decode,
            max_decode_length=LENGTH,
        )  # fmt: skip
        return embed.attend(x)


@pytest.mark.parametrize(
    "attributes",
    [dict(), dict(enable_relative_embedding=False, enable_rotary_pos_emb=True, num_gqa_groups=2)],
    ids=["relpos", "rope-gqa"],
)
def test_kv_cache_greedy_decoding_equals_the_full_causal_forward(attributes):
    model = _TinyDecoder(dict(layer_type=DECODER, **attributes))
    encoded = _inputs((BATCH, 5, HIDDEN), seed=4)
    prompt = jnp.zeros((BATCH, LENGTH), jnp.int32)
    variables = model.init(jax.random.key(0), prompt, encoded)
    # Sizing the cache: decode=True on a full-length input, as with TE.
    cache = model.init(jax.random.key(0), prompt, encoded, decode=True)["cache"]
    step = jax.jit(
        lambda cache, token: model.apply(
            {**variables, "cache": cache}, token, encoded, decode=True, mutable=["cache"]
        )
    )
    full = jax.jit(lambda tokens: model.apply(variables, tokens, encoded))
    tokens = jnp.ones((BATCH, 1), jnp.int32)  # the first token
    generated = [tokens]
    for position in range(LENGTH - 1):
        logits, updated = step(cache, generated[-1])
        cache = updated["cache"]
        # The full forward over the tokens so far (padded; the causal mask hides the rest).
        so_far = jnp.concatenate(generated, axis=1)
        padded = jnp.pad(so_far, ((0, 0), (0, LENGTH - so_far.shape[1])))
        expected = full(padded)[:, position]
        assert_close(logits[:, 0], expected, TOL, f"logits at position {position}")
        next_token = jnp.argmax(logits[:, 0], axis=-1)[:, None].astype(jnp.int32)
        np.testing.assert_array_equal(next_token[:, 0], jnp.argmax(expected, axis=-1))
        generated.append(next_token)
    assert int(cache["decoder"]["self_attention"]["cache_index"]) == LENGTH - 1


def test_nnx_decoding_equals_linen_decoding():
    cfg = dict(layer_type=DECODER, enable_relative_embedding=False, enable_rotary_pos_emb=True)
    layer, model = _layer(**cfg), _nnx_layer(cfg)
    x, encoded = _inputs((BATCH, 4, HIDDEN)), _inputs((BATCH, 5, HIDDEN), seed=4)
    cross_mask = jnp.zeros((BATCH, 1, 1, 5), bool)
    variables = layer.init(
        jax.random.key(0), x, encoded, None, cross_mask[..., :1, :].repeat(4, 2), True
    )
    te_nnx.load_linen_variables(model, variables)
    cache = layer.init(jax.random.key(0), x, encoded, None, jnp.zeros((BATCH, 1, 4, 5), bool),
                       True, decode=True)["cache"]  # fmt: skip
    model.init_cache(BATCH, 4)
    for t in range(4):
        token = x[:, t : t + 1]
        y, updated = layer.apply({**variables, "cache": cache}, token, encoded, None, cross_mask,
                                 True, decode=True, mutable=["cache"])  # fmt: skip
        cache = updated["cache"]
        np.testing.assert_array_equal(model(token, encoded, None, cross_mask, True, decode=True), y)
    with pytest.raises(ValueError, match="init_cache"):
        _nnx_layer(cfg)(x[:, :1], encoded, None, cross_mask, True, decode=True)


# ----------------------------------------------------------------------------- dropout, scan


def test_dropout_is_off_when_deterministic_and_follows_the_rng_otherwise():
    layer = _layer(drop_path=0.2)  # TE's defaults: 0.1 hidden, attention and MLP dropout
    x = _inputs()
    variables = layer.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    quiet = layer.apply(variables, x, deterministic=True)
    reference = reference_layer(_unbox(variables)["params"], x, {})
    assert_close(quiet, reference, TOL)

    def noisy(seed):
        return layer.apply(variables, x, rngs={"dropout": jax.random.key(seed)})

    np.testing.assert_array_equal(noisy(3), noisy(3))
    assert not np.allclose(noisy(3), noisy(4))
    assert not np.allclose(noisy(3), quiet)
    # Attention dropout alone, through the explicit-softmax path.
    mha, _ = _mha(attention_dropout=0.5)
    mha_variables = mha.init(jax.random.key(0), x, x)
    dropped = mha.apply(mha_variables, x, x, rngs={"dropout": jax.random.key(2)})[0]
    kept = mha.apply(mha_variables, x, x, deterministic=True)[0]
    assert dropped.shape == kept.shape and not np.allclose(dropped, kept)


class _Stack(nn.Module):
    """TransformerLayers stacked with nn.scan, each with its own parameters and FP8 state."""

    layers: int = 2

    @nn.compact
    def __call__(self, x):
        def body(layer, carry, _):
            return layer(carry, deterministic=True), None

        scanned = nn.scan(
            body,
            variable_axes={"params": 0, OVERWRITE_WITH_GRADIENT: 0},
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return scanned(_layer(recipe=DelayedScaling(amax_history_len=4), name="layers"), x, None)[0]


@pytest.mark.slow
def test_scanned_layers_equal_the_layers_applied_in_turn_with_their_fp8_state():
    x = _inputs()
    stack = _Stack()
    variables = _unbox(stack.init(jax.random.key(0), x))
    layers = variables["params"]["layers"]
    assert layers["attention"]["qkv"]["kernel"].shape == (2, HIDDEN, 3, HIDDEN)
    fp8 = variables[OVERWRITE_WITH_GRADIENT]["layers"]
    assert fp8["mlp"]["x_0_amax_history"].shape == (2, 4)
    layer = _layer(recipe=DelayedScaling(amax_history_len=4))
    y = x
    stacked = {"params": layers, OVERWRITE_WITH_GRADIENT: fp8}
    for i in range(2):
        y = layer.apply(jax.tree.map(lambda v, i=i: v[i], stacked), y, deterministic=True)
    # Within a few ulps: evaluation scales the fresh state just in time, and the two programs
    # fuse the scale products differently.
    np.testing.assert_allclose(stack.apply(variables, x), y, rtol=1e-6, atol=1e-5)
    # One training step: each layer's FP8 state moves on its own.
    grads = jax.grad(lambda v: jnp.sum(stack.apply(merge_fp8_state(v), x) ** 2))(variables)
    history = grads[OVERWRITE_WITH_GRADIENT]["layers"]["attention"]["qkv"]["x_amax_history"]
    assert history.shape == (2, 4) and history[0, 0] > 0 and history[1, 0] > 0
    assert history[0, 0] != history[1, 0]  # different inputs, different amaxes


class _NnxStack(nnx.Module):
    """The NNX twin of ``_Stack``: layers created with ``nnx.vmap``, applied with ``nnx.scan``."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 2):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(rngs):
            return _nnx_layer(dict(recipe=DelayedScaling(amax_history_len=4)), seed=rngs)

        self.layers = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x, deterministic=True)

        return body(x, self.layers)


@pytest.mark.slow
def test_nnx_scan_over_stacked_layers_equals_the_linen_scan():
    x = _inputs()
    stack = _Stack()
    variables = _unbox(stack.init(jax.random.key(0), x))
    nnx_stack = _NnxStack(nnx.Rngs(5))
    te_nnx.load_linen_variables(nnx_stack, variables)

    def linen_loss(variables):
        return jnp.sum(stack.apply(merge_fp8_state(variables), x) ** 2)

    value, grads = jax.jit(jax.value_and_grad(linen_loss))(variables)
    nnx_value, nnx_grads = nnx.jit(te_nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2)))(nnx_stack)
    np.testing.assert_allclose(nnx_value, value, rtol=1e-6)
    for ours, theirs in (
        (nnx.to_pure_dict(nnx.state(nnx_grads, nnx.Param)), grads["params"]),
        (nnx.to_pure_dict(nnx.state(nnx_grads, te_nnx.Fp8Meta)), grads[OVERWRITE_WITH_GRADIENT]),
    ):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ours, theirs
        )


# ----------------------------------------------------------------------------- errors, convert


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (
                te_nn.DotProductAttention(
                    head_dim=8, num_attention_heads=4, context_parallel_strategy="ulysses"
                ),
                None,
            ),
            "context_parallel_strategy must be one of",
        ),
        (lambda: _mha(num_heads=4), "num_heads.*num_attention_heads"),
        (lambda: _mha(num_gqa_groups=3), "multiple of num_gqa_groups"),
        (lambda: _mha(attn_mask_type="diagonal"), "attn_mask_type must be one of"),
        (lambda: _mha(low_rank_adaptation_scope="everything"), "low_rank_adaptation_scope"),
        (lambda: _mha(window_size=(2,)), "window_size"),
    ],
)
def test_unsupported_or_wrong_attention_options_are_refused_by_name(make, message):
    module, _ = make()
    x = _inputs()
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        module.init(jax.random.key(0), x, x)


def test_wrong_layer_calls_are_refused_with_the_fix():
    x = _inputs()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="DECODER"):
        _layer().init(key, x, decode=True)
    with pytest.raises(ValueError, match="encoded"):
        _layer(layer_type=DECODER).init(key, x)
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        _layer(num_attention_heads=5).init(key, x)
    with pytest.raises(ValueError, match="takes no parameters"):
        _layer(mlp_activations=("gelu",), mlp_activation_params={"limit": 7.0}).init(key, x)
    with pytest.raises(ValueError, match="reshape it to three axes"):
        _layer().init(key, _inputs((BATCH * SEQ, 32)))
    with pytest.raises(ValueError, match="needs a mask"):
        _layer(self_attn_mask_type="padding").init(key, x, deterministic=True)
    with pytest.raises(ValueError, match="qkv_layout"):
        te_nn.DotProductAttention(head_dim=8, num_attention_heads=4, qkv_layout="sbhd").init(
            key, jnp.ones((2, 4, 4, 8))
        )


def test_transformer_engine_variables_convert_both_ways():
    layer = _layer(recipe=DelayedScaling(amax_history_len=4))
    x = _inputs()
    variables = _unbox(layer.init(jax.random.key(0), x, deterministic=True))
    te_tree = te_flax.convert.to_transformer_engine(variables)
    te_names = {
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(te_tree["fp8_metas"])
    }
    assert "['attention']['qkv']['kernel_scale']" in te_names
    assert "['mlp']['grad_1_amax_history']" in te_names
    assert len(te_names) == 4 * 6  # qkv, out, and the MLP's two GEMMs, six variables each
    back = te_flax.convert.from_transformer_engine(te_tree)
    _equal_trees(back["params"], variables["params"])
    np.testing.assert_array_equal(
        layer.apply(back, x, deterministic=True), layer.apply(variables, x, deterministic=True)
    )
