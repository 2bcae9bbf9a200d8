"""The attention core: masks, scaled dot-product attention, rotary and relative positions.

Functional and stateless, like the other ops; the attention modules (``te_flax.linen`` and
``te_flax.nnx``) call these. Tensors are ``[batch, seq, heads, head_dim]``. Masks follow
TransformerEngine's convention: ``True`` means *masked out*, and a padding mask is
``[batch, 1, q_len, kv_len]``.

Mask types (``attn_mask_type``):

* ``"no_mask"``: every query sees every key (a given mask is ignored).
* ``"padding"``: the given mask only.
* ``"causal"``: query ``i`` sees keys ``j <= i`` (aligned at the top left; a mask is ignored).
* ``"padding_causal"`` (also ``"causal_padding"``): both.
* ``"causal_bottom_right"`` / ``"padding_causal_bottom_right"``: causal aligned at the bottom
  right, query ``i`` sees keys ``j <= i + kv_len - q_len`` (the queries are the last ones).

``window_size=(left, right)`` further limits query ``i`` to keys ``i - left <= j <= i + right``
(``-1``: unbounded on that side). Bias types (``attn_bias_type``): ``"no_bias"``,
``"pre_scale_bias"`` (``softmax((q.k + bias) * scale)``) and ``"post_scale_bias"``
(``softmax(q.k * scale + bias)``, the default when a bias is given).

On GPUs the attention is cuDNN's fused flash attention (``jax.nn.dot_product_attention`` with
``implementation="cudnn"``) where it supports the case (bf16/f16, no attention dropout);
elsewhere it is the same maths as XLA ops written here (float32 logits and softmax), which also
do attention dropout and work under strict dtype promotion.

Two TransformerEngine options run on the XLA maths only, on every platform:

* ``score_mod(score, tensors)``: modifies the float32 scores ``[batch, heads, q_len, kv_len]``
  after the scale and before the bias and the masks (where cuDNN's graph applies TE's
  callback); ``score_mod_bprop(grad, tensors)``, if given, is its backward (the gradient of
  the modified scores to that of the scores), else autodiff differentiates ``score_mod``.
  TE's callbacks build a cuDNN graph (``score_mod(graph, score, tensors)``); te_flax's are the
  same functions on ``jax.Array`` s, without the graph.
* ``return_max_logit``: also returns the maximum of the scores ``[heads]`` (over batch,
  queries and the keys each query attends), as the softmax sees them, without a gradient.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from te_flax._base import checks as check
from te_flax._ops.fp8_attention import AttentionQuantizers, fp8_context, fp8_logits
from te_flax._ops.packing import SequenceDescriptor
from te_flax._parallel.context import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from te_flax.sharding import sharded_along

__all__ = [
    "BIAS_TYPES",
    "MASK_TYPES",
    "SOFTMAX_TYPES",
    "ReorderStrategy",
    "SequenceDescriptor",
    "canonical_bias_type",
    "canonical_mask_type",
    "canonical_softmax_type",
    "dot_product_attention",
    "inverse_reorder_causal_load_balancing",
    "relative_position_buckets",
    "reorder_causal_load_balancing",
    "rotary_pos_emb",
]

# score_mod(score, tensors) -> modified score; score_mod_bprop(grad, tensors) -> grad of score.
ScoreMod = Callable[[Array, dict[str, Any]], Array]

MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
)
_MASK_ALIASES = {
    "causal_padding": "padding_causal",
    "causal_padding_bottom_right": "padding_causal_bottom_right",
}
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
IMPLEMENTATIONS = (None, "xla", "cudnn")
# TE's softmax types: the plain softmax, and softmax with an attention sink, one more logit
# every query sees whose probability is dropped: 0 ("off_by_one": the denominator gets + 1) or
# a learned logit per head ("learnable", gpt-oss's sinks).
SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")


def canonical_mask_type(attn_mask_type: object) -> str:
    """One of ``MASK_TYPES``; TE's spellings (any case, ``causal_padding``) are accepted."""
    if isinstance(attn_mask_type, str):
        name = attn_mask_type.strip().lower()
        name = _MASK_ALIASES.get(name, name)
        if name in MASK_TYPES:
            return name
    raise ValueError(
        f"attn_mask_type must be one of {MASK_TYPES} (or 'causal_padding'), got {attn_mask_type!r}"
    )


def canonical_softmax_type(softmax_type: object) -> str:
    """One of ``SOFTMAX_TYPES``; TE's docstring spelling ``"off-by-one"`` is accepted."""
    if isinstance(softmax_type, str):
        name = softmax_type.strip().lower().replace("-", "_")
        if name in SOFTMAX_TYPES:
            return name
    raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")


def canonical_bias_type(attn_bias_type: object, bias: Array | None) -> str:
    """One of ``BIAS_TYPES``; None picks ``post_scale_bias`` with a bias, else ``no_bias``."""
    if attn_bias_type is None:
        return "no_bias" if bias is None else "post_scale_bias"
    name = attn_bias_type.strip().lower() if isinstance(attn_bias_type, str) else None
    if name not in BIAS_TYPES:
        raise ValueError(f"attn_bias_type must be None or one of {BIAS_TYPES}, got {name!r}")
    if (name == "no_bias") != (bias is None):
        raise ValueError(
            f"attn_bias_type={name!r} but a bias was {'not ' if bias is None else ''}given; "
            "pass a bias with 'pre_scale_bias' / 'post_scale_bias', none with 'no_bias', or "
            "leave attn_bias_type=None to follow the bias"
        )
    return name


def _check_window(window_size: Sequence[int] | None) -> tuple[int, int] | None:
    if window_size is None:
        return None
    window = tuple(window_size)
    if len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window):
        raise ValueError(
            f"window_size must be None or (left, right) ints >= -1 (-1: unbounded), got "
            f"{window_size!r}"
        )
    return None if window == (-1, -1) else window


def _keep_mask(
    padding: Array | None,
    causal: bool,
    q_len: int,
    kv_len: int,
    window: tuple[int, int] | None,
    q_offset: Array | int,
) -> Array | None:
    """The positions to attend as a boolean ``[batch or 1, 1, q_len, kv_len]`` (True: keep).

    ``padding`` is TE's mask (True: masked out) or None. ``q_offset`` is the position of the
    first query among the keys (a decoding step's cache index, or the bottom-right shift);
    causality and windows are measured from there.
    """
    keep = None if padding is None else jnp.logical_not(padding)
    query = jnp.arange(q_len)[:, None] + q_offset  # [q, 1] absolute positions
    keys = jnp.arange(kv_len)[None, :]  # [1, kv]
    limits = []
    if causal:
        limits.append(keys <= query)
    if window is not None:
        left, right = window
        if left >= 0:
            limits.append(keys >= query - left)
        if right >= 0:
            limits.append(keys <= query + right)
    for limit in limits:
        limit = limit[None, None]  # [1, 1, q, kv]
        keep = limit if keep is None else jnp.logical_and(keep, limit)
    return keep


def _broadcast_batch(query: Array, key: Array, value: Array) -> tuple[Array, Array, Array]:
    """The three with one batch where some have a batch of 1 (numpy's broadcasting, as
    TransformerEngine's attention): a row of queries rotated by a batch of packed positions
    meets its value row, for instance. Other mismatches are left to ``_check_qkv``."""
    batches = {t.shape[0] for t in (query, key, value) if getattr(t, "ndim", 0) == 4}
    if len(batches) != 2 or 1 not in batches:
        return query, key, value
    batch = max(batches)
    return tuple(  # type: ignore[return-value]
        jnp.broadcast_to(t, (batch, *t.shape[1:])) if t.ndim == 4 else t
        for t in (query, key, value)
    )


def _check_qkv(query: Array, key: Array, value: Array) -> None:
    for name, array in (("query", query), ("key", key), ("value", value)):
        check.check_floating(array, name)
        if array.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, seq, heads, head_dim], got shape {array.shape}; add "
                "the missing axes, e.g. split the hidden axis into heads x head_dim"
            )
    if key.shape != value.shape:
        raise ValueError(f"key {key.shape} and value {value.shape} must have the same shape")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query {query.shape} and key {key.shape} must agree in batch and head_dim"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"query has {query.shape[2]} heads, key/value {key.shape[2]}: the query heads must "
            "be a multiple of the key/value heads (GQA groups)"
        )
    if query.dtype != key.dtype or key.dtype != value.dtype:
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    bias: Array | None = None,
    *,
    attn_mask_type: str = "causal",
    attn_bias_type: str | None = None,
    scale_factor: float | None = None,
    window_size: tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    q_offset: Array | int = 0,
    implementation: str | None = None,
    score_mod: ScoreMod | None = None,
    score_mod_bprop: ScoreMod | None = None,
    score_mod_tensors: Mapping[str, Any] | None = None,
    score_mod_bprop_tensors: Mapping[str, Any] | None = None,
    return_max_logit: bool = False,
    softmax_type: str = "vanilla",
    softmax_offset: Array | None = None,
    quantizers: AttentionQuantizers | None = None,
) -> Array | tuple[Array, Array]:
    """``softmax(q.k * scale + bias, masked) . v`` per head, with GQA.

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key, value: ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` must be a multiple of
        ``kv_heads`` (query head ``n`` reads key/value head ``n // (heads // kv_heads)``).
      mask: True (or nonzero) = masked out, broadcastable to ``[batch, 1, q_len, kv_len]``
        (TE's rank-5 ``[batch, 1, 1, q_len, kv_len]`` too); needed by the padding mask types,
        ignored by the others.
      bias: broadcastable to ``[batch, heads, q_len, kv_len]``, or None.
      attn_mask_type, attn_bias_type, window_size: see the module docstring.
      scale_factor: multiplies the logits (default ``1 / sqrt(head_dim)``).
      dropout_rate, dropout_rng: dropout of the attention probabilities, applied when the rate
        is positive and a key is given.
      q_offset: the position of the first query among the keys (an autoregressive cache
        index); keys past a query's position are then never attended.
      implementation: None (cuDNN on a GPU where it applies, else XLA), ``"xla"`` or
        ``"cudnn"``. ``score_mod`` and ``return_max_logit`` need ``"xla"`` (None picks it).
      score_mod: ``score_mod(score, tensors)`` returns the modified float32 scores ``[batch,
        heads, q_len, kv_len]`` (scaled, before bias and masks); None: no modification.
      score_mod_bprop: ``score_mod_bprop(grad, tensors)``, the backward of ``score_mod``; None:
        autodiff of ``score_mod``. ``score_mod`` runs again just before it in the backward
        (as in cuDNN), so that a callable object can keep what its backward needs.
      score_mod_tensors, score_mod_bprop_tensors: dicts of arrays or numbers handed to the two
        callbacks as ``tensors`` (default empty); no gradient flows into them (as in TE).
      return_max_logit: also return the per-head maximum score (default False).
      softmax_type: ``"vanilla"`` (default), ``"off_by_one"`` or ``"learnable"``: the softmax
        of each query row gets one more logit, the attention sink, whose probability is
        dropped (0 for ``off_by_one``, ``softmax_offset`` for ``learnable``), so that a query
        can attend to nothing; a fully masked row then gives zeros. Runs on the XLA attention.
      softmax_offset: the learned sink logit of each head, broadcastable to ``[1, heads, 1,
        1]`` (TE's ``softmax_offset`` parameter), for ``softmax_type="learnable"`` only.
      quantizers: FP8 attention (a recipe's ``fp8_dpa``): the quantizer sets of the two
        attention GEMMs, ``q . k`` and ``p . v`` (see ``te_flax._ops.fp8_attention``); None
        (default): high precision. Runs on the XLA attention.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in the dtype of ``query``; with
      ``return_max_logit``, ``(output, max_logit)`` with ``max_logit`` ``[heads]`` in that dtype.
    """
    query, key, value = _broadcast_batch(query, key, value)
    _check_qkv(query, key, value)
    mask_type = canonical_mask_type(attn_mask_type)
    bias_type = canonical_bias_type(attn_bias_type, bias)
    window = _check_window(window_size)
    check.check_rate(dropout_rate, "dropout_rate")
    batch, q_len, heads = query.shape[:3]
    kv_len = key.shape[1]
    if bias is not None:
        check.check_floating(bias, "bias")
        check.check_broadcastable(
            bias, (batch, heads, q_len, kv_len), "bias", "[batch, heads, q_len, kv_len]"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    modify = _score_modifier(score_mod, score_mod_bprop, score_mod_tensors, score_mod_bprop_tensors)
    check.check_bool(return_max_logit, "return_max_logit")
    sink = _sink_logit(canonical_softmax_type(softmax_type), softmax_offset, heads)
    xla_only = modify is not None or return_max_logit or sink is not None
    if xla_only and implementation == "cudnn":
        raise ValueError(
            "score_mod, return_max_logit and the softmax types with a sink run on the XLA "
            "attention only; use implementation='xla' or None"
        )
    if quantizers is not None and implementation == "cudnn":
        raise ValueError(
            "FP8 attention (a recipe with fp8_dpa=True) runs on the XLA attention, whose two "
            "GEMMs take float8 operands: jax has no public entry to cuDNN's FP8 fused "
            "attention. Use implementation='xla' or None, or leave fp8_dpa=False for cuDNN's "
            "16-bit flash attention"
        )
    xla_only = xla_only or quantizers is not None
    if "padding" in mask_type and mask is None:
        raise ValueError(
            f"attn_mask_type={mask_type!r} needs a mask ([batch, 1, q_len, kv_len], True = "
            "masked out); pass one, or use 'causal' / 'no_mask'"
        )
    if mask is not None and mask.ndim == 5 and mask.shape[1:3] == (1, 1):
        mask = mask[:, 0]  # TE's rank-5 form [batch, 1, 1, q_len, kv_len]
    if mask is not None and "padding" in mask_type:
        if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise TypeError(
                f"mask must be boolean or integer (True / nonzero = masked out), got {mask.dtype}"
            )
        if batch == 1 and mask.ndim == 4 and mask.shape[0] > 1:
            # As TransformerEngine: one row of queries broadcasts against the mask's batch
            # (MaxText initialises its attention on one dummy row with the real batch's
            # sequence descriptor); the output has the mask's batch.
            batch = mask.shape[0]
            query, key, value = (
                jnp.broadcast_to(t, (batch, *t.shape[1:])) for t in (query, key, value)
            )
        check.check_broadcastable(
            mask, (batch, 1, q_len, kv_len), "mask", "[batch, 1, q_len, kv_len]"
        )
        mask = mask.astype(jnp.bool_)  # TE's examples pass uint8 0/1 masks
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale_factor is None else float(scale_factor)
    if bias is not None:
        bias = bias.astype(jnp.float32)
        if bias_type == "pre_scale_bias":
            # (q.k + bias) * scale == q.k * scale + bias * scale.
            bias = bias * jnp.float32(scale)
    shift = kv_len - q_len if mask_type.endswith("bottom_right") else 0
    decoding = not (isinstance(q_offset, int) and q_offset == 0)
    padding = mask if "padding" in mask_type else None
    # A decoding step is causal whatever the type: cached keys past its position are empty.
    causal = "causal" in mask_type or decoding
    top_left_causal = causal and shift == 0 and not decoding
    if top_left_causal:
        # Left to jax as is_causal / local_window_size, so that cuDNN can use its own masks.
        keep = _keep_mask(padding, False, q_len, kv_len, None, 0)
        jax_window = None if window is None else _jax_window(window, q_len, kv_len)
    else:
        keep = _keep_mask(padding, causal, q_len, kv_len, window, q_offset + shift)
        jax_window = None
    if keep is not None:
        keep = jnp.broadcast_to(keep, (keep.shape[0], 1, q_len, kv_len))
    dropout = (
        (dropout_rate, dropout_rng) if dropout_rate > 0.0 and dropout_rng is not None else None
    )
    chosen = implementation or _fused_implementation(query)
    if xla_only:
        chosen = "xla"
    if chosen == "cudnn" and dropout is None:
        try:
            return jax.nn.dot_product_attention(
                query,
                key,
                value,
                bias,
                keep,
                scale=scale,
                is_causal=top_left_causal,
                local_window_size=jax_window,
                implementation="cudnn",
            )
        except (ValueError, NotImplementedError):
            if implementation == "cudnn":  # asked for explicitly: say why it does not apply
                raise
    elif chosen == "cudnn" and implementation == "cudnn":
        raise ValueError("implementation='cudnn' has no attention dropout; use 'xla' or None")
    if top_left_causal:
        keep = _and(keep, _keep_mask(None, True, q_len, kv_len, window, 0))
    out, max_logit = _xla_attention(
        query, key, value, keep, bias, scale, dropout, modify, return_max_logit, sink, quantizers
    )
    if max_logit is None:
        return out
    return out, max_logit.astype(query.dtype)


def _sink_logit(softmax_type: str, softmax_offset: Array | None, heads: int) -> Array | None:
    """The attention sink's logit ``[1, heads, 1, 1]`` in float32, or None (vanilla)."""
    if softmax_type != "learnable":
        if softmax_offset is not None:
            raise ValueError(
                f"softmax_offset is the learned sink of softmax_type='learnable'; with "
                f"softmax_type={softmax_type!r} pass softmax_offset=None"
            )
        return None if softmax_type == "vanilla" else jnp.zeros((1, 1, 1, 1), jnp.float32)
    if softmax_offset is None:
        raise ValueError(
            "softmax_type='learnable' needs softmax_offset, the sink logit of each head "
            f"([1, {heads}, 1, 1]; the attention modules create it as a parameter)"
        )
    softmax_offset = jnp.asarray(softmax_offset)
    check.check_floating(softmax_offset, "softmax_offset")
    if softmax_offset.size not in (1, heads):
        raise ValueError(
            f"softmax_offset must hold one logit per head ({heads}) or one for all, got shape "
            f"{softmax_offset.shape}"
        )
    return jnp.reshape(softmax_offset.astype(jnp.float32), (1, -1, 1, 1))


def _check_callback(callback: object, name: str, arguments: str) -> None:
    """Raises a clear error unless ``callback`` can be called as ``name(<arguments>)``."""
    if not callable(callback):
        raise TypeError(f"{name} must be a function {name}({arguments}) or None, got {callback!r}")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(*arguments.split(", "))
    except TypeError:
        raise TypeError(
            f"{name} must take two arguments, {name}({arguments}), and return the float32 "
            f"scores' {'gradient' if 'grad' in arguments else 'modification'}, but its "
            f"signature is {name}{signature}. TransformerEngine's callbacks build a cuDNN graph "
            f"({name}(graph, ...)); in te_flax write the same function on jax.Arrays, without "
            "the graph (e.g. graph.mul(score, t['s']) becomes score * t['s'])"
        ) from None


def _tensors(tensors: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if tensors is None:
        return {}
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{name} must be a dict of arrays or numbers, or None, got {tensors!r}")
    # As in TE, the tensors are auxiliary inputs: no gradient flows into them.
    return {k: lax.stop_gradient(jnp.asarray(v)) for k, v in tensors.items()}


def _score_modifier(
    score_mod: object,
    score_mod_bprop: object,
    score_mod_tensors: Mapping[str, Any] | None,
    score_mod_bprop_tensors: Mapping[str, Any] | None,
) -> Callable[[Array], Array] | None:
    """The float32 scores -> modified scores, with ``score_mod_bprop`` as its backward."""
    if score_mod is None:
        given = [
            name
            for name, value in (
                ("score_mod_bprop", score_mod_bprop),
                ("score_mod_tensors", score_mod_tensors),
                ("score_mod_bprop_tensors", score_mod_bprop_tensors),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)} given without score_mod; pass score_mod too")
        return None
    _check_callback(score_mod, "score_mod", "score, tensors")
    tensors = _tensors(score_mod_tensors, "score_mod_tensors")
    forward = cast(ScoreMod, score_mod)
    if score_mod_bprop is None:
        return lambda score: _modified(forward, score, tensors)
    _check_callback(score_mod_bprop, "score_mod_bprop", "grad, tensors")
    bprop_tensors = _tensors(score_mod_bprop_tensors, "score_mod_bprop_tensors")
    backward = cast(ScoreMod, score_mod_bprop)
    return lambda score: _modified_with_bprop(forward, backward, score, tensors, bprop_tensors)


def _modified(score_mod: ScoreMod, score: Array, tensors: dict[str, Any]) -> Array:
    modified = jnp.asarray(score_mod(score, tensors))
    if modified.shape != score.shape:
        raise ValueError(
            f"score_mod must return scores of the shape it was given, {score.shape} ([batch, "
            f"heads, q_len, kv_len]), got {modified.shape}"
        )
    return modified.astype(jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _modified_with_bprop(
    score_mod: ScoreMod,
    score_mod_bprop: ScoreMod,
    score: Array,
    tensors: dict[str, Any],
    bprop_tensors: dict[str, Any],
) -> Array:
    return _modified(score_mod, score, tensors)


def _modified_forward(
    score_mod: ScoreMod,
    score_mod_bprop: ScoreMod,
    score: Array,
    tensors: dict[str, Any],
    bprop_tensors: dict[str, Any],
) -> tuple[Array, tuple[Array, dict[str, Any], dict[str, Any]]]:
    return _modified(score_mod, score, tensors), (score, tensors, bprop_tensors)


def _modified_backward(
    score_mod: ScoreMod,
    score_mod_bprop: ScoreMod,
    residuals: tuple[Array, dict[str, Any], dict[str, Any]],
    grad: Array,
) -> tuple[Array, dict[str, Any], dict[str, Any]]:
    score, tensors, bprop_tensors = residuals
    # cuDNN builds the forward modification again before the backward one: a callable object
    # may keep what its backward needs (XLA drops the recomputation when nothing reads it).
    _modified(score_mod, score, tensors)
    d_score = jnp.asarray(score_mod_bprop(grad, bprop_tensors))
    if d_score.shape != score.shape:
        raise ValueError(
            f"score_mod_bprop must return the scores' gradient, of shape {score.shape}, got "
            f"{d_score.shape}"
        )
    return d_score.astype(jnp.float32), _no_gradient(tensors), _no_gradient(bprop_tensors)


def _no_gradient(tree: dict[str, Any]) -> dict[str, Any]:
    def zero(value: Array) -> Array | np.ndarray:
        if jnp.issubdtype(value.dtype, jnp.inexact):
            return jnp.zeros_like(value)
        return np.zeros(value.shape, jax.dtypes.float0)

    return {name: zero(value) for name, value in tree.items()}


_modified_with_bprop.defvjp(_modified_forward, _modified_backward)


def _fused_implementation(query: Array) -> str:
    """cuDNN flash attention on GPUs for 16-bit inputs (what it supports), XLA elsewhere."""
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and query.dtype in (jnp.bfloat16, jnp.float16) else "xla"


def _jax_window(window: tuple[int, int], q_len: int, kv_len: int) -> tuple[int, int]:
    left, right = window
    unbounded = q_len + kv_len
    return (unbounded if left < 0 else left, unbounded if right < 0 else right)


def _and(a: Array | None, b: Array | None) -> Array | None:
    if a is None or b is None:
        return b if a is None else a
    return jnp.logical_and(a, b)


def _xla_attention(
    query: Array,
    key: Array,
    value: Array,
    keep: Array | None,
    bias: Array | None,
    scale: float,
    dropout: tuple[float, Array] | None,
    score_mod: Callable[[Array], Array] | None = None,
    return_max_logit: bool = False,
    sink: Array | None = None,
    quantizers: AttentionQuantizers | None = None,
) -> tuple[Array, Array | None]:
    """Attention as plain XLA ops: float32 logits and softmax, optional probability dropout;
    returns the output and, with ``return_max_logit``, the per-head maximum logit ``[heads]``.
    With ``quantizers`` the two GEMMs take float8 operands (FP8 attention).

    The maths of ``jax.nn.dot_product_attention``'s XLA path, written with explicit dtypes:
    jax's own promotes the 16-bit inputs implicitly and pins a dot algorithm whose lowering
    does too, so it fails under strict dtype promotion; and it has no dropout.
    """
    kv_heads = key.shape[2]
    # [batch, q, heads, d] -> [batch, q, kv_heads, group, d]: query head n = k * group + g.
    grouped = einops.rearrange(query, "b q (k g) d -> b q k g d", k=kv_heads)
    if quantizers is None:
        logits = _logits(grouped, key)  # [batch, kv_heads, group, q, kv], float32
    else:
        logits = fp8_logits(grouped, key, quantizers.qk)
    logits = einops.rearrange(logits, "b k g q s -> b (k g) q s") * jnp.float32(scale)
    if score_mod is not None:  # where cuDNN's graph applies TE's: scaled, before bias and masks
        logits = score_mod(logits)
    if bias is not None:
        logits = logits + sharded_along(bias, logits)
    max_logit = None
    if return_max_logit:
        # The largest score the softmax sees per head (masked positions excluded), a statistic
        # without a gradient (TE's fused attention drops its cotangent).
        seen = logits if keep is None else jnp.where(keep, logits, -jnp.inf)
        max_logit = lax.stop_gradient(jnp.max(seen, axis=(0, 2, 3)))  # [heads]
    if keep is not None:
        # A large finite negative, not -inf: a fully masked row (a padded query) stays finite.
        large_negative = jnp.float32(-0.7 * np.finfo(np.float32).max)
        logits = jnp.where(keep, logits, large_negative)
    if sink is None:
        probs = jax.nn.softmax(logits, axis=-1)  # [batch, heads, q, kv]
    else:
        # The sink is one more logit in every row; its probability is dropped, so a row's
        # probabilities sum to less than one. [batch, heads, q, kv + 1] -> [.., kv]
        sink_column = jnp.broadcast_to(sink, (*logits.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink_column], axis=-1), axis=-1)
        probs = probs[..., :-1]
    if keep is not None:
        # Masked positions get exactly zero, and so does every position of a fully masked row
        # (a padding query), as in TE: its output is zero and no gradient flows from it.
        probs = jnp.where(keep, probs, jnp.float32(0.0))
    if dropout is not None:
        rate, rng = dropout
        kept = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
        probs = jnp.where(kept, probs / jnp.float32(1.0 - rate), jnp.float32(0.0))
    if quantizers is None:
        probs = probs.astype(value.dtype)
    probs = einops.rearrange(probs, "b (k g) q s -> b k g q s", k=kv_heads)
    if quantizers is None:
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, value)  # [batch, q, kv_heads, group, d]
    else:  # the float32 probabilities quantized directly (no 16-bit rounding first)
        out = fp8_context(probs, value, quantizers.pv)
    return einops.rearrange(out, "b q k g d -> b q (k g) d"), max_logit


@jax.custom_vjp
def _logits(grouped: Array, key: Array) -> Array:
    """``q . k`` in float32, accumulated from the (16-bit) operands.

    Plain autodiff would multiply the float32 logits' gradient with the 16-bit operands, which
    XLA does as float32 GEMMs; the gradient is rounded to the operands' dtype first instead, as
    flash attention keeps it, so that every attention GEMM runs in the operands' dtype.
    """
    return jnp.einsum("bqkgd,bskd->bkgqs", grouped, key, preferred_element_type=jnp.float32)


def _logits_forward(grouped: Array, key: Array) -> tuple[Array, tuple[Array, Array]]:
    return _logits(grouped, key), (grouped, key)


def _logits_backward(residuals: tuple[Array, Array], cotangent: Array) -> tuple[Array, Array]:
    grouped, key = residuals
    cotangent = cotangent.astype(grouped.dtype)
    d_grouped = jnp.einsum(
        "bkgqs,bskd->bqkgd", cotangent, key, preferred_element_type=jnp.float32
    )  # [batch, q, kv_heads, group, d]
    d_key = jnp.einsum(
        "bkgqs,bqkgd->bskd", cotangent, grouped, preferred_element_type=jnp.float32
    )  # [batch, kv, kv_heads, d]
    return d_grouped.astype(grouped.dtype), d_key.astype(key.dtype)


_logits.defvjp(_logits_forward, _logits_backward)


# ----------------------------------------------------------------------------- positions


def rotary_pos_emb(
    x: Array,
    windows: Sequence[float] = (1, 10000),
    transpose_batch_sequence: bool = False,
    group_method: str = "consecutive",
    positions: Array | None = None,
) -> Array:
    """Rotary position embedding of ``x`` ``[batch, seq, ..., head_dim]`` (TE's convention).

    Feature pair ``i`` (of ``head_dim / 2``) turns by the angle ``position / timescale_i``,
    ``timescale_i = min * (max / min) ** (2i / head_dim)`` with ``(min, max) = windows``.
    ``group_method="consecutive"`` pairs features ``2i`` and ``2i + 1``; ``"alternate"`` pairs
    ``i`` and ``i + head_dim / 2``. Computed in float32, returned in ``x.dtype``.

    Args:
      x: ``[batch, seq, ..., head_dim]`` (``[seq, batch, ...]`` with
        ``transpose_batch_sequence``); ``head_dim`` must be even.
      windows: the ``(min, max)`` timescales.
      transpose_batch_sequence: the sequence axis is axis 0 rather than axis 1.
      group_method: ``"consecutive"`` or ``"alternate"``.
      positions: integer positions ``[seq]`` or ``[batch, seq]`` (default ``0 .. seq - 1``),
        e.g. offset by a decoding cache index, or restarting at each packed document.
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    method = group_method.strip().lower().replace("-", "").replace("_", "")
    if method not in ("consecutive", "alternate"):
        raise ValueError(
            f"rotary_pos_emb_group_method must be 'consecutive' or 'alternate', got "
            f"{group_method!r}"
        )
    low, high = (float(w) for w in windows)
    seq_axis = 0 if transpose_batch_sequence else 1
    if positions is None:
        positions = jnp.arange(x.shape[seq_axis])
    fraction = 2 * np.arange(head_dim // 2) / head_dim
    timescale = jnp.asarray(low * (high / low) ** fraction, jnp.float32)  # [head_dim / 2]
    turns = positions.astype(jnp.float32)[..., None]  # [(batch,) seq, 1]
    angle = turns / timescale.reshape((1,) * positions.ndim + (-1,))
    # angle: [(batch,) seq, head_dim / 2]
    # Broadcast over every axis but the (batch,) sequence and the features.
    shape = [1] * x.ndim
    shape[seq_axis], shape[-1] = x.shape[seq_axis], head_dim // 2
    if positions.ndim == 2:  # per-row positions, e.g. restarting at each packed document
        shape[1 - seq_axis] = positions.shape[0]
        angle = jnp.swapaxes(angle, 0, 1) if transpose_batch_sequence else angle
    sin, cos = jnp.sin(angle).reshape(shape), jnp.cos(angle).reshape(shape)
    # Split the features into the two members of each rotated pair.
    pairs = "(two half)" if method == "alternate" else "(half two)"
    first, second = einops.rearrange(x.astype(jnp.float32), f"... {pairs} -> two ... half", two=2)
    rotated = jnp.stack([first * cos - second * sin, second * cos + first * sin])
    return einops.rearrange(rotated, f"two ... half -> ... {pairs}").astype(x.dtype)


def relative_position_buckets(
    q_len: int, k_len: int, num_buckets: int, max_distance: int, bidirectional: bool = True
) -> np.ndarray:
    """T5's relative position buckets ``[q_len, k_len]`` (int32), computed at trace time.

    Half the buckets (all of them when not bidirectional) hold exact distances up to half
    their count; the rest grow logarithmically up to ``max_distance``, beyond which all
    distances share the last bucket. Keys after the query get the upper half when
    bidirectional, and bucket 0 otherwise.
    """
    relative = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]  # key - query
    distance = -relative
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (distance < 0).astype(np.int64) * num_buckets
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        log_ratio = np.log(distance.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
    large = max_exact + (
        log_ratio / np.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets.astype(np.int32)
