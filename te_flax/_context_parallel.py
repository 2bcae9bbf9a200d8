"""Causal load balancing for context parallelism: TransformerEngine's token reorderings.

Under a causal mask the last tokens of a sequence attend far more keys than the first, so a
sequence split into ``cp_size`` contiguous shards gives the last device most of the work. TE
reorders the tokens before sharding so that every device holds early and late tokens alike:

* ``ReorderStrategy.DualChunkSwap``: the sequence is cut into ``2 * cp_size`` chunks and device
  ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` (needs ``seq % (2 * cp_size) == 0``).
* ``ReorderStrategy.Striped``: device ``r`` holds stripes ``r, r + cp_size, ...`` of
  ``stripe_size`` tokens (needs ``seq % (cp_size * stripe_size) == 0``).

``reorder_causal_load_balancing(x, strategy, cp_size, seq_dim)`` gives the reordered tensor
(its ``cp_size`` contiguous shards are the devices' tokens) and
``inverse_reorder_causal_load_balancing`` undoes it, with TE's signatures and orders.
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np
from jax import Array

__all__ = [
    "ReorderStrategy",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
]


class ReorderStrategy(enum.Enum):
    """TransformerEngine's token orders for causal load balancing (same names and values)."""

    DualChunkSwap = 0
    Striped = 1


def _order(strategy: object, cp_size: int, length: int, stripe_size: int | None) -> np.ndarray:
    """The reordered tensor's token ``i`` is the original token ``order[i]``."""
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    tokens = np.arange(length)
    if strategy == ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(
                f"ReorderStrategy.DualChunkSwap takes no stripe_size, got {stripe_size!r}; "
                "leave it None (stripes belong to ReorderStrategy.Striped)"
            )
        if cp_size == 1:
            return tokens
        if cp_size % 2 or length % (2 * cp_size):
            raise ValueError(
                f"DualChunkSwap load balancing needs an even cp_size and a sequence length "
                f"divisible by 2 x cp_size = {2 * cp_size}; got cp_size={cp_size} and length "
                f"{length}: pad the sequence to a multiple of {2 * cp_size}"
            )
        chunks = tokens.reshape(2 * cp_size, -1)
        pairs = [chunks[[rank, 2 * cp_size - 1 - rank]] for rank in range(cp_size)]
        return np.concatenate(pairs).reshape(-1)
    if strategy == ReorderStrategy.Striped:
        stripe = 1 if stripe_size is None else stripe_size
        if not isinstance(stripe, int) or stripe < 1 or length % (cp_size * stripe):
            raise ValueError(
                f"Striped load balancing needs a positive stripe_size and a sequence length "
                f"divisible by cp_size x stripe_size; got cp_size={cp_size}, stripe_size="
                f"{stripe_size!r}, length {length}: pad the sequence to a multiple of "
                f"{cp_size * max(int(stripe), 1)}"
            )
        # [rounds, cp_size, stripe] -> [cp_size, rounds, stripe]: device r's stripes together.
        return tokens.reshape(-1, cp_size, stripe).swapaxes(0, 1).reshape(-1)
    raise ValueError(
        f"strategy must be ReorderStrategy.DualChunkSwap or ReorderStrategy.Striped, got "
        f"{strategy!r}"
    )


def reorder_causal_load_balancing(
    tensor: Array, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
    stripe_size: int | None = None,
) -> Array:  # fmt: skip
    """``tensor`` with its ``seq_dim`` reordered for causal load balancing over ``cp_size``."""
    order = _order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return jnp.take(tensor, jnp.asarray(order), axis=seq_dim)


def inverse_reorder_causal_load_balancing(
    tensor: Array, strategy: ReorderStrategy, cp_size: int, seq_dim: int,
    stripe_size: int | None = None,
) -> Array:  # fmt: skip
    """Undoes ``reorder_causal_load_balancing`` (the same arguments)."""
    order = _order(strategy, cp_size, tensor.shape[seq_dim], stripe_size)
    return jnp.take(tensor, jnp.asarray(np.argsort(order)), axis=seq_dim)
