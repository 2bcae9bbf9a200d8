"""TransformerEngine's expert-parallel bootstrap (``transformer_engine.jax.ep``), for code that
calls it.

TransformerEngine's expert parallelism runs its own NCCL communicator, which a process sets up
once, eagerly, before any jitted MoE call (``ep_bootstrap``, with the sizes of its send and
receive buffers). te_flax's has nothing to set up: ``te_flax.moe.moe`` and ``MoEBlock`` send
tokens with ``jax.lax.all_to_all`` inside ``jit``, over the mesh axis named at the call, sized
by XLA from the shapes. So ``ep_bootstrap`` checks its arguments, keeps them
(``bootstrap_config``) and says once that it has nothing else to do; ``ep_finalize`` forgets
them. TE's buffer-level API (``ep_prepare``, ``ep_dispatch``, ``ep_combine``, ...) has no
te_flax twin: docs/porting.md says what to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from te_flax._base.checks import check_bool, check_dtype, check_positive_int
from te_flax.sharding import global_mesh_resource

__all__ = [
    "EpBootstrapConfig",
    "NoBootstrapNeededWarning",
    "bootstrap_config",
    "ep_bootstrap",
    "ep_finalize",
]


class NoBootstrapNeededWarning(UserWarning):
    """``ep_bootstrap`` has nothing to set up in te_flax (said once per process)."""


class EpBootstrapConfig(NamedTuple):
    """The sizes a process gave ``ep_bootstrap`` (TransformerEngine's arguments)."""

    world_size: int | None
    rank: int | None
    num_experts: int
    max_tokens_per_rank: int
    recv_capacity_per_rank: int
    hidden_dim: int
    max_token_dtype: Any
    max_num_sms: int
    drop_on_overflow: bool


_CONFIG: list[EpBootstrapConfig] = []  # the process's bootstrap, if any
_SAID: list[bool] = []


def _optional_count(value: object, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return value


def ep_bootstrap(
    world_size: int | None,
    rank: int | None,
    num_experts: int,
    max_tokens_per_rank: int,
    recv_capacity_per_rank: int,
    hidden_dim: int,
    max_token_dtype: Any = jnp.bfloat16,
    max_num_sms: int = 0,
    drop_on_overflow: bool = False,
) -> None:
    """TransformerEngine's ``ep_bootstrap``: checks and keeps the sizes; sets nothing up.

    te_flax's expert parallelism needs no communicator or buffers (``jax.lax.all_to_all``
    inside ``jit``), so this only checks the arguments as TransformerEngine does, keeps them
    for ``te_flax.moe.moe`` to compare (``bootstrap_config``), and warns once
    (``NoBootstrapNeededWarning``) that it has nothing else to do. Unlike TE's, it runs with
    one process (``world_size`` 1) and any token dtype.

    Args:
      world_size: the number of devices, or None (TE: the active mesh's).
      rank: the calling process's rank, or None (TE: ``jax.process_index()``).
      num_experts: the experts of the expert-parallel group; with an active ``MeshResource``
        whose ``ep_resource`` names a mesh axis, a multiple of its size.
      max_tokens_per_rank: the most tokens one rank dispatches in a step.
      recv_capacity_per_rank: the most tokens one rank receives in a step
        (``te_flax.moe.get_moe_recv_capacity_per_rank``).
      hidden_dim: the tokens' feature size.
      max_token_dtype: the widest dtype dispatched (default ``bfloat16``).
      max_num_sms: TE's SM budget for its kernels (default 0); kept, without effect.
      drop_on_overflow: TE's choice of dropping tokens past the capacity (default False); kept,
        without effect: te_flax's exchange never drops.

    Example usage::

      >>> import warnings
      >>> from te_flax.ep import bootstrap_config, ep_bootstrap, ep_finalize
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")  # the one-time note that nothing is set up
      ...     ep_bootstrap(1, 0, 8, 256, 1024, 64)
      >>> bootstrap_config().recv_capacity_per_rank
      1024
      >>> ep_finalize()
    """
    config = EpBootstrapConfig(
        world_size=_optional_count(world_size, "world_size", 1),
        rank=_optional_count(rank, "rank", 0),
        num_experts=check_positive_int(num_experts, "num_experts"),
        max_tokens_per_rank=check_positive_int(max_tokens_per_rank, "max_tokens_per_rank"),
        recv_capacity_per_rank=check_positive_int(recv_capacity_per_rank, "recv_capacity_per_rank"),
        hidden_dim=check_positive_int(hidden_dim, "hidden_dim"),
        max_token_dtype=check_dtype(max_token_dtype, "max_token_dtype"),
        max_num_sms=_optional_count(max_num_sms, "max_num_sms", 0) or 0,
        drop_on_overflow=check_bool(drop_on_overflow, "drop_on_overflow"),
    )
    _check_experts(num_experts)
    _CONFIG[:] = [config]
    if not _SAID:
        _SAID.append(True)
        warnings.warn(
            "ep_bootstrap has nothing to set up in te_flax: its expert parallelism is "
            "jax.lax.all_to_all inside jit over the mesh axis the MoE call names, with no "
            "communicator or buffers; the sizes are checked and kept for te_flax.moe.moe "
            "(said once per process)",
            NoBootstrapNeededWarning,
            stacklevel=2,
        )


def _check_experts(num_experts: int) -> None:
    """TE's check: the experts split evenly over the active resource's expert axis."""
    try:
        ep_resource = global_mesh_resource().ep_resource
    except ValueError:  # no MeshResource active: nothing to check against
        return
    if ep_resource is None:
        return
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or ep_resource not in mesh.axis_names:
        return
    size = int(mesh.shape[ep_resource])
    if num_experts % size:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel mesh axis "
            f"{ep_resource!r} of size {size} (MeshResource.ep_resource); choose a multiple of "
            f"{size} experts"
        )


def bootstrap_config() -> EpBootstrapConfig | None:
    """The sizes given to ``ep_bootstrap`` in this process (None before it or after
    ``ep_finalize``)."""
    return _CONFIG[0] if _CONFIG else None


def ep_finalize() -> None:
    """TransformerEngine's ``ep_finalize``: forgets the bootstrap's sizes (nothing to release)."""
    _CONFIG.clear()
