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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from te_flax._base import checks as check
from te_flax._ops.attention import (
    broadcast_batch,
    check_qkv,
    check_window,
    keep_mask,
    sink_logit,
    xla_attention,
)
from te_flax._ops.fp8_attention import AttentionQuantizers
from te_flax._ops.packing import SequenceDescriptor
from te_flax._ops.score_mod import ScoreMod as ScoreMod
from te_flax._ops.score_mod import score_modifier
from te_flax._parallel.context import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

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
    # The arguments, checked and put in canonical form.
    query, key, value = broadcast_batch(query, key, value)
    check_qkv(query, key, value)
    mask_type = canonical_mask_type(attn_mask_type)
    bias_type = canonical_bias_type(attn_bias_type, bias)
    window = check_window(window_size)
    check.check_rate(dropout_rate, "dropout_rate")
    _check_bias(bias, query, key)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    modify = score_modifier(score_mod, score_mod_bprop, score_mod_tensors, score_mod_bprop_tensors)
    check.check_bool(return_max_logit, "return_max_logit")
    sink = sink_logit(canonical_softmax_type(softmax_type), softmax_offset, query.shape[2])
    xla_only = _xla_only(implementation, modify, return_max_logit, sink, quantizers)
    # What the logits go through: scale, bias, masks, dropout.
    padding, (query, key, value) = _padding_mask(mask, mask_type, query, key, value)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale_factor is None else float(scale_factor)
    bias = _float32_bias(bias, bias_type, scale)
    masks = _masks(padding, mask_type, window, q_offset, query.shape[1], key.shape[1])
    dropout = (
        (dropout_rate, dropout_rng) if dropout_rate > 0.0 and dropout_rng is not None else None
    )
    # cuDNN's fused attention where it applies, else the XLA attention.
    chosen = "xla" if xla_only else implementation or _fused_implementation(query)
    if chosen == "cudnn":
        fused = _cudnn_attention(query, key, value, bias, masks, scale, dropout, implementation)
        if fused is not None:
            return fused
    out, max_logit = xla_attention(
        query, key, value, masks.keep, bias, scale, dropout, modify, return_max_logit, sink,
        quantizers,
    )  # fmt: skip
    if max_logit is None:
        return out
    return out, max_logit.astype(query.dtype)


def _check_bias(bias: Array | None, query: Array, key: Array) -> None:
    if bias is not None:
        batch, q_len, heads = query.shape[:3]
        check.check_floating(bias, "bias")
        check.check_broadcastable(
            bias, (batch, heads, q_len, key.shape[1]), "bias", "[batch, heads, q_len, kv_len]"
        )


def _xla_only(
    implementation: str | None,
    score_mod: Callable[[Array], Array] | None,
    return_max_logit: bool,
    sink: Array | None,
    quantizers: AttentionQuantizers | None,
) -> bool:
    """Whether the options need the XLA attention; refuses them with ``"cudnn"``."""
    xla_only = score_mod is not None or return_max_logit or sink is not None
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
    return xla_only or quantizers is not None


def _padding_mask(
    mask: Array | None, mask_type: str, query: Array, key: Array, value: Array
) -> tuple[Array | None, tuple[Array, Array, Array]]:
    """The boolean padding mask (True: masked out) of a padding mask type, broadcastable to
    ``[batch, 1, q_len, kv_len]`` (None for the other types), and the query, key and value,
    broadcast to the mask's batch where they have a batch of 1."""
    if "padding" in mask_type and mask is None:
        raise ValueError(
            f"attn_mask_type={mask_type!r} needs a mask ([batch, 1, q_len, kv_len], True = "
            "masked out); pass one, or use 'causal' / 'no_mask'"
        )
    if mask is None or "padding" not in mask_type:
        return None, (query, key, value)
    if mask.ndim == 5 and mask.shape[1:3] == (1, 1):
        mask = mask[:, 0]  # TE's rank-5 form [batch, 1, 1, q_len, kv_len]
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(
            f"mask must be boolean or integer (True / nonzero = masked out), got {mask.dtype}"
        )
    batch, q_len = query.shape[:2]
    if batch == 1 and mask.ndim == 4 and mask.shape[0] > 1:
        # As TransformerEngine: one row of queries broadcasts against the mask's batch
        # (MaxText initialises its attention on one dummy row with the real batch's
        # sequence descriptor); the output has the mask's batch.
        batch = mask.shape[0]
        query, key, value = (
            jnp.broadcast_to(t, (batch, *t.shape[1:])) for t in (query, key, value)
        )
    check.check_broadcastable(
        mask, (batch, 1, q_len, key.shape[1]), "mask", "[batch, 1, q_len, kv_len]"
    )
    return mask.astype(jnp.bool_), (query, key, value)  # TE's examples pass uint8 0/1 masks


def _float32_bias(bias: Array | None, bias_type: str, scale: float) -> Array | None:
    """The bias to add to the scaled logits, in float32."""
    if bias is None:
        return None
    bias = bias.astype(jnp.float32)
    if bias_type == "pre_scale_bias":
        # (q.k + bias) * scale == q.k * scale + bias * scale.
        bias = bias * jnp.float32(scale)
    return bias


class _Masks(NamedTuple):
    """The masks of one attention call, as the XLA attention and cuDNN's take them."""

    keep: Array | None  # every position to attend, [batch or 1, 1, q_len, kv_len], or None
    # cuDNN's: a top-left causal mask and its window are left to jax (is_causal /
    # local_window_size) so that cuDNN can use its own masks; the rest is cudnn_keep.
    cudnn_keep: Array | None
    is_causal: bool
    cudnn_window: tuple[int, int] | None


def _masks(
    padding: Array | None,
    mask_type: str,
    window: tuple[int, int] | None,
    q_offset: Array | int,
    q_len: int,
    kv_len: int,
) -> _Masks:
    """The masks of a mask type, a padding mask (True: masked out, or None), a window and the
    queries' offset among the keys."""
    shift = kv_len - q_len if mask_type.endswith("bottom_right") else 0
    decoding = not (isinstance(q_offset, int) and q_offset == 0)
    # A decoding step is causal whatever the type: cached keys past its position are empty.
    causal = "causal" in mask_type or decoding
    if not causal or shift != 0 or decoding:
        keep = keep_mask(padding, causal, q_len, kv_len, window, q_offset + shift)
        keep = _full_keep(keep, q_len, kv_len)
        return _Masks(keep, keep, is_causal=False, cudnn_window=None)
    padding_keep = _full_keep(keep_mask(padding, False, q_len, kv_len, None, 0), q_len, kv_len)
    keep = _and(padding_keep, keep_mask(None, True, q_len, kv_len, window, 0))
    cudnn_window = None if window is None else _jax_window(window, q_len, kv_len)
    return _Masks(keep, padding_keep, is_causal=True, cudnn_window=cudnn_window)


def _full_keep(keep: Array | None, q_len: int, kv_len: int) -> Array | None:
    return None if keep is None else jnp.broadcast_to(keep, (keep.shape[0], 1, q_len, kv_len))


def _cudnn_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    masks: _Masks,
    scale: float,
    dropout: tuple[float, Array] | None,
    implementation: str | None,
) -> Array | None:
    """cuDNN's fused attention, or None where it does not apply (the XLA attention runs then),
    unless ``implementation="cudnn"`` asked for it: then the reason is raised."""
    if dropout is not None:
        if implementation == "cudnn":
            raise ValueError("implementation='cudnn' has no attention dropout; use 'xla' or None")
        return None
    try:
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            bias,
            masks.cudnn_keep,
            scale=scale,
            is_causal=masks.is_causal,
            local_window_size=masks.cudnn_window,
            implementation="cudnn",
        )
    except (ValueError, NotImplementedError):
        if implementation == "cudnn":  # asked for explicitly: say why it does not apply
            raise
        return None


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
