"""Low-rank adaptation: a small piece that adds ``x . A . B * scale`` beside a GEMM.

TransformerEngine's layout: for a GEMM contracting ``x[..., K...]`` with
``kernel[K..., F..., F_last]``, ``A`` is ``[K..., F..., rank]`` (initialised like the kernel)
and ``B`` is ``[F..., rank, F_last]`` (initialised to zero, so that a new adapter leaves the
output unchanged). The update is scaled by ``alpha / rank`` (1 when alpha is None). It reads the
same input as the main GEMM.
"""

from __future__ import annotations

import string

import jax.numpy as jnp
from jax import Array, lax

from te_flax._base.checks import check_positive_int

__all__ = ["lora_delta", "lora_shapes"]


def lora_shapes(
    in_features: tuple[int, ...], features: tuple[int, ...], rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``A`` and ``B`` for a GEMM ``[..., in_features] -> [..., features]``."""
    check_positive_int(rank, "low_rank_adaptation_dim", "e.g. low_rank_adaptation_dim=8")
    *groups, last = features
    return (*in_features, *groups, rank), (*groups, rank, last)


def lora_delta(
    x: Array, a: Array, b: Array, n_contract: int, rank: int, alpha: float | None
) -> Array:
    """``x[batch..., K...] . A[K..., G..., r] . B[G..., r, F]`` -> ``[batch..., G..., F]``."""
    letters = iter(string.ascii_letters)
    batch = "".join(next(letters) for _ in range(x.ndim - n_contract))
    contract = "".join(next(letters) for _ in range(n_contract))
    groups = "".join(next(letters) for _ in range(a.ndim - n_contract - 1))
    r, f = next(letters), next(letters)
    # Full precision for the two thin GEMMs: their cost is small next to the main GEMM's.
    low_rank = jnp.einsum(
        f"{batch}{contract},{contract}{groups}{r}->{batch}{groups}{r}",
        x,
        a.astype(x.dtype),
        precision=lax.Precision.HIGHEST,
    )
    delta = jnp.einsum(
        f"{batch}{groups}{r},{groups}{r}{f}->{batch}{groups}{f}",
        low_rank,
        b.astype(x.dtype),
        precision=lax.Precision.HIGHEST,
    )
    scale = 1.0 if alpha is None else alpha / rank
    return delta * jnp.asarray(scale, delta.dtype)
