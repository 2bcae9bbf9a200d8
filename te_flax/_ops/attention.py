"""The attention's stages, shared by the one-device and the context-parallel attention.

``logits`` is ``q . k`` in float32 with a backward in the operands' dtype; ``xla_attention`` is
the whole attention as XLA ops (float32 softmax with masks, sink, dropout, optional FP8 GEMMs);
``keep_mask`` turns TransformerEngine's mask types into the positions to attend. The argument
checks the attention modules share with ``te_flax.attention.dot_product_attention`` are here as
well. Tensors are ``[batch, seq, heads, head_dim]``; a keep-mask is True where a query attends a
key (the opposite of TE's masks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from te_flax._base import checks as check
from te_flax._ops.fp8_attention import AttentionQuantizers, fp8_context, fp8_logits
from te_flax.sharding import sharded_along

__all__ = [
    "broadcast_batch",
    "check_qkv",
    "check_window",
    "keep_mask",
    "logits",
    "sink_logit",
    "xla_attention",
]


def check_window(window_size: Sequence[int] | None) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)``, or None where it limits nothing."""
    if window_size is None:
        return None
    window = tuple(window_size)
    if len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window):
        raise ValueError(
            f"window_size must be None or (left, right) ints >= -1 (-1: unbounded), got "
            f"{window_size!r}"
        )
    return None if window == (-1, -1) else window


def broadcast_batch(query: Array, key: Array, value: Array) -> tuple[Array, Array, Array]:
    """The three with one batch where some have a batch of 1 (numpy's broadcasting, as
    TransformerEngine's attention): a row of queries rotated by a batch of packed positions
    meets its value row, for instance. Other mismatches are left to ``check_qkv``."""
    batches = {t.shape[0] for t in (query, key, value) if getattr(t, "ndim", 0) == 4}
    if len(batches) != 2 or 1 not in batches:
        return query, key, value
    batch = max(batches)
    return tuple(  # type: ignore[return-value]
        jnp.broadcast_to(t, (batch, *t.shape[1:])) if t.ndim == 4 else t
        for t in (query, key, value)
    )


def check_qkv(query: Array, key: Array, value: Array) -> None:
    """Raises a clear error unless the three are attention inputs of one dtype (GQA allowed)."""
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


def sink_logit(softmax_type: str, softmax_offset: Array | None, heads: int) -> Array | None:
    """The attention sink's logit ``[1, heads, 1, 1]`` in float32, or None (vanilla).

    Args:
      softmax_type: a canonical softmax type, ``"vanilla"``, ``"off_by_one"`` or
        ``"learnable"``.
      softmax_offset: the learned sink logit of each head (``"learnable"`` only), else None.
      heads: the number of query heads.
    """
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


def keep_mask(
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


def xla_attention(
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
    """Attention as plain XLA ops: float32 logits and softmax, optional probability dropout.

    The maths of ``jax.nn.dot_product_attention``'s XLA path, written with explicit dtypes:
    jax's own promotes the 16-bit inputs implicitly and pins a dot algorithm whose lowering
    does too, so it fails under strict dtype promotion; and it has no dropout.

    Args:
      query: ``[batch, q_len, heads, head_dim]``.
      key, value: ``[batch, kv_len, kv_heads, head_dim]`` (GQA: ``heads`` a multiple).
      keep: True where a query attends a key, broadcastable to ``[batch, 1, q_len, kv_len]``,
        or None (every key).
      bias: float32, added to the scaled logits, or None.
      scale: multiplies the logits.
      dropout: ``(rate, rng)`` of the probabilities' dropout, or None.
      score_mod: modifies the float32 scaled logits before the bias and the masks, or None.
      return_max_logit: also return the per-head maximum logit the softmax sees.
      sink: the softmax's sink logit ``[1, heads, 1, 1]`` (float32), or None.
      quantizers: the two GEMMs' quantizer sets (FP8 attention), or None (high precision).

    Returns:
      The output ``[batch, q_len, heads, head_dim]`` in the inputs' dtype, and the float32
      maximum logit per head ``[heads]`` (None without ``return_max_logit``).
    """
    kv_heads = key.shape[2]
    # [batch, q, heads, d] -> [batch, q, kv_heads, group, d]: query head n = k * group + g.
    grouped = einops.rearrange(query, "b q (k g) d -> b q k g d", k=kv_heads)
    scores = (  # [batch, kv_heads, group, q, kv], float32
        logits(grouped, key) if quantizers is None else fp8_logits(grouped, key, quantizers.qk)
    )
    scores = einops.rearrange(scores, "b k g q s -> b (k g) q s") * jnp.float32(scale)
    if score_mod is not None:  # where cuDNN's graph applies TE's: scaled, before bias and masks
        scores = score_mod(scores)
    if bias is not None:
        scores = scores + sharded_along(bias, scores)
    max_logit = None
    if return_max_logit:
        # The largest score the softmax sees per head (masked positions excluded), a statistic
        # without a gradient (TE's fused attention drops its cotangent).
        seen = scores if keep is None else jnp.where(keep, scores, -jnp.inf)
        max_logit = lax.stop_gradient(jnp.max(seen, axis=(0, 2, 3)))  # [heads]
    probs = _probabilities(scores, keep, sink, dropout)
    if quantizers is None:
        probs = probs.astype(value.dtype)
    probs = einops.rearrange(probs, "b (k g) q s -> b k g q s", k=kv_heads)
    if quantizers is None:
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, value)  # [batch, q, kv_heads, group, d]
    else:  # the float32 probabilities quantized directly (no 16-bit rounding first)
        out = fp8_context(probs, value, quantizers.pv)
    return einops.rearrange(out, "b q k g d -> b q (k g) d"), max_logit


def _probabilities(
    scores: Array, keep: Array | None, sink: Array | None, dropout: tuple[float, Array] | None
) -> Array:
    """The float32 softmax ``[batch, heads, q, kv]`` of the scores, masked, with the sink's
    probability dropped, and dropout applied."""
    if keep is not None:
        # A large finite negative, not -inf: a fully masked row (a padded query) stays finite.
        large_negative = jnp.float32(-0.7 * np.finfo(np.float32).max)
        scores = jnp.where(keep, scores, large_negative)
    if sink is None:
        probs = jax.nn.softmax(scores, axis=-1)  # [batch, heads, q, kv]
    else:
        # The sink is one more logit in every row; its probability is dropped, so a row's
        # probabilities sum to less than one. [batch, heads, q, kv + 1] -> [.., kv]
        sink_column = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)
        probs = probs[..., :-1]
    if keep is not None:
        # Masked positions get exactly zero, and so does every position of a fully masked row
        # (a padding query), as in TE: its output is zero and no gradient flows from it.
        probs = jnp.where(keep, probs, jnp.float32(0.0))
    if dropout is not None:
        rate, rng = dropout
        kept = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
        probs = jnp.where(kept, probs / jnp.float32(1.0 - rate), jnp.float32(0.0))
    return probs


@jax.custom_vjp
def logits(grouped: Array, key: Array) -> Array:
    """``q . k`` in float32, accumulated from the (16-bit) operands.

    Plain autodiff would multiply the float32 logits' gradient with the 16-bit operands, which
    XLA does as float32 GEMMs; the gradient is rounded to the operands' dtype first instead, as
    flash attention keeps it, so that every attention GEMM runs in the operands' dtype.

    Args:
      grouped: the queries ``[batch, q, kv_heads, group, head_dim]``.
      key: ``[batch, kv, kv_heads, head_dim]``.

    Returns:
      ``[batch, kv_heads, group, q, kv]`` float32.
    """
    return jnp.einsum("bqkgd,bskd->bkgqs", grouped, key, preferred_element_type=jnp.float32)


def _logits_forward(grouped: Array, key: Array) -> tuple[Array, tuple[Array, Array]]:
    return logits(grouped, key), (grouped, key)


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


logits.defvjp(_logits_forward, _logits_backward)
