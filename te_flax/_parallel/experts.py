"""Expert parallelism for ``MoEBlock``: ``shard_map`` with ``all_to_all`` over the expert axis.

The mesh axis is the one the active logical axis rules map ``"exp"`` to (``configs/rules/ep.yaml``
maps it to ``data``). Each device holds ``num_experts / size`` experts and a slice of the
batch, whose mesh axes (the rules' ``"batch"`` axes) must include the expert axis; the other
batch axes are data parallel for the experts (and FSDP shards the kernels' ``embed`` axis:
``shard_map`` gathers them at its boundary under ``jit``). Per device: route the local tokens,
sort their copies by expert, send each device the rows of its experts (one fixed-size
``all_to_all``; float8 rows and their scales under an FP8 recipe, ``te_flax._parallel.wire``),
run the local experts' grouped GEMMs, send the rows back in the compute dtype and combine.
Nothing runs outside ``jit``: no bootstrap, no library outside JAX.

Equal to one device, by construction: the aux loss and the routing counts sum over the batch
axes (``psum``); the capacity drops are decided on the whole batch's choices (an
``all_gather`` of ``[tokens, topk]`` ids and weights, not of the tokens); an expert receives
its rows in the global token order; the per-expert FP8 state of an expert replicated over
data-parallel axes merges its replicas' updates by max (the state fans out with a custom VJP
that takes the max, not the sum ``shard_map`` would take).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.spmd import logical_to_mesh_axes
from jax import Array, lax
from jax.sharding import PartitionSpec as P

from te_flax._base.explicit_sharding import placed_for_shard_map
from te_flax._parallel.wire import expert_scales, fp8_all_to_all, wire_format
from te_flax.permutation import pure_jax_token_combine, pure_jax_token_dispatch, sort_rows
from te_flax.quantize import Quantizer, QuantizerSet, float32_state, scaling
from te_flax.router import drop_over_capacity

__all__ = [
    "ExpertLayer",
    "Routed",
    "RoutingStats",
    "check_expert_count",
    "expert_axis",
    "expert_parallel_forward",
    "expert_parallel_size",
    "shards_the_tokens",
]

EXPERT_PARAMS = ("wi_kernel", "wo_kernel", "wi_bias", "wo_bias")


class RoutingStats(NamedTuple):
    """What the router did in one call (not differentiated)."""

    tokens_per_expert: Array  # int32 [E], assignments each expert computed (after drops)
    tokens_dropped: Array  # int32 [], assignments dropped by the capacity


class Routed(NamedTuple):
    """The router's choice for each token."""

    tokens: Array  # [T, H] the (normalised) GEMM input
    selected: Array  # int32 [T, k]; num_experts marks a dropped assignment
    weights: Array  # float32 [T, k]
    aux_loss: Array  # float32 []


class ExpertLayer(Protocol):
    """What the expert-parallel path needs of a mixture-of-experts layer
    (``MoEBlockDescription``)."""

    num_experts: int
    num_experts_per_tok: int
    drop_policy: str
    fp8_dispatch: bool

    def capacity(self, num_tokens: int) -> int | None: ...

    def route(self, params: dict[str, Array], tokens: Array, token_axes: Any = None) -> Routed: ...

    def expert_ffn(
        self,
        params: dict[str, Array],
        rows: Array,
        group_sizes: Array,
        quantizer_sets: Sequence[QuantizerSet],
        capacity: int | None,
    ) -> Array: ...

    def stats(self, selected: Array, token_axes: Any = None) -> RoutingStats: ...


def _axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the active rules map ``logical`` to (empty without rules or mesh)."""
    rules = nn.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return ()
    spec = logical_to_mesh_axes((logical,), rules)
    assert spec is not None, "rules are active, so the logical axes map to a spec"
    entry = spec[0]
    if entry is None:
        return ()
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(name for name in names if name not in mesh.manual_axes)


def expert_axis() -> str | None:
    """The mesh axis the experts are split over, or None."""
    names = _axes("exp")
    if len(names) > 1:
        raise ValueError(
            f"the logical axis 'exp' maps to the mesh axes {names}, but expert parallelism "
            "runs over one mesh axis; map 'exp' to one axis in the logical axis rules"
        )
    return names[0] if names else None


def expert_parallel_size() -> int:
    """How many ways the experts are split (1: no expert parallelism)."""
    axis = expert_axis()
    return 1 if axis is None else int(jax.sharding.get_abstract_mesh().shape[axis])


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fan_out(state: Array, copies: int) -> Array:
    """``copies`` copies of ``state`` along a new leading axis; their updates merge by max."""
    return jnp.broadcast_to(state, (copies, *state.shape))


def _fan_out_forward(state: Array, copies: int) -> tuple[Array, None]:
    return _fan_out(state, copies), None


def _fan_out_backward(copies: int, _: None, new_states: Array) -> tuple[Array]:
    return (jnp.max(new_states, axis=0),)


_fan_out.defvjp(_fan_out_forward, _fan_out_backward)


def check_expert_count(num_experts: int) -> None:
    """Refuses an expert count that the expert-parallel mesh axis does not divide."""
    ep, size = expert_axis(), expert_parallel_size()
    if num_experts % size:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel mesh axis "
            f"{ep!r} of size {size}: each device holds num_experts / {size} experts; choose a "
            f"multiple of {size} experts or a mesh axis whose size divides {num_experts}"
        )


def _check(layer: ExpertLayer, x: Array, ep: str, token_axes: tuple[str, ...]) -> None:
    mesh = jax.sharding.get_abstract_mesh()
    check_expert_count(layer.num_experts)
    if ep not in token_axes:
        raise ValueError(
            f"expert parallelism over mesh axis {ep!r} needs the batch split over it too, but "
            f"the logical axis rules map 'batch' to {token_axes}; add {ep!r} to the 'batch' "
            "rule (see configs/rules/ep.yaml)"
        )
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if x.ndim < 2 or x.shape[0] % shards:
        raise ValueError(
            f"MoEBlock's input {x.shape} is split over the mesh axes {token_axes} ({shards} "
            "ways) along its leading (batch) axis, which must be divisible by that; change "
            "the batch size"
        )


def shards_the_tokens(x: Array, kernel_axes: Sequence[tuple[str | None, ...]]) -> bool:
    """Whether ``MoEBlock`` runs per device inside ``shard_map`` without expert parallelism:
    the rules split the batch (data parallelism, FSDP) and no mesh axis splits the expert
    kernels' axes but ``"exp"`` and ``"embed"`` (an FSDP axis, gathered at the boundary). Each
    device then routes its own tokens and runs every expert on them, the data-parallel program
    FSDP means; left to XLA, the routing's sort over every token would put every token's rows
    on every device. Tensor-parallel experts (``"mlp"`` over a mesh axis) stay XLA's, as does
    a batch the mesh does not divide."""
    token_axes = _axes("batch")
    if not token_axes:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    split = {name for axes in kernel_axes for name in axes if name not in (None, "exp", "embed")}
    if any(_axes(name) for name in split):
        return False
    shards = math.prod(mesh.shape[a] for a in token_axes)
    return x.ndim >= 2 and x.shape[0] % shards == 0


def expert_parallel_forward(
    layer: ExpertLayer, params: dict[str, Array], x: Array, quantizer_sets: tuple[QuantizerSet, ...]
) -> tuple[tuple[Array, Array], RoutingStats]:
    """``MoEBlockDescription.forward`` inside ``shard_map`` over the batch axes: the experts split
    over the expert mesh axis, or (without one, ``shards_the_tokens``) each device's tokens
    through every expert, the kernels gathered at the boundary."""
    ep = expert_axis() if expert_parallel_size() > 1 else None
    token_axes = _axes("batch")
    if ep is not None:
        _check(layer, x, ep, token_axes)
    mesh = jax.sharding.get_abstract_mesh()
    data_axes = tuple(a for a in token_axes if a != ep)
    data_copies = math.prod(mesh.shape[a] for a in data_axes)
    experts = layer.num_experts
    local_experts = experts // expert_parallel_size()

    def state_spec(leaf: Array) -> P:
        return P(data_axes or None, ep) if _is_expert_state(leaf, experts) else P()

    # float32 copies: a max-merged state's dtype does not cross shard_map.
    sets = jax.tree.map(
        lambda leaf: _fan_out(leaf, data_copies) if _is_expert_state(leaf, experts) else leaf,
        float32_state(quantizer_sets),
    )
    param_specs = {name: P(ep) if name in EXPERT_PARAMS else P() for name in params}
    capacity = layer.capacity(math.prod(x.shape[:-1]))
    # The tokens cross to their experts in float8 under an FP8 recipe (te_flax._parallel.wire).
    fp8_wire = layer.fp8_dispatch and not all(s.is_noop for s in quantizer_sets)

    def local(params: dict[str, Array], x: Array, sets: Any) -> Any:
        sets = jax.tree.map(
            lambda leaf: leaf[0] if _is_expert_state(leaf, local_experts, 2) else leaf, sets
        )
        out, stats = _local_forward(layer, params, x, sets, ep, token_axes, capacity, fp8_wire)
        return out, stats

    out_specs = ((P(token_axes), P()), P())
    in_specs = (param_specs, P(token_axes), jax.tree.map(state_spec, quantizer_sets))
    body = jax.shard_map(local, in_specs=in_specs, out_specs=out_specs)
    args = placed_for_shard_map((params, x, sets), in_specs)
    result: tuple[tuple[Array, Array], RoutingStats] = body(*args)
    return result


def _is_expert_state(leaf: Any, experts: int, axis_count: int = 1) -> bool:
    """A per-expert FP8 state leaf (``[E, ...]``, or ``[1, E_local, ...]`` inside)."""
    shape = jnp.shape(leaf)
    return len(shape) > axis_count and shape[axis_count - 1] == experts


def _local_forward(
    layer: ExpertLayer,
    params: dict[str, Array],
    x: Array,
    sets: tuple[QuantizerSet, ...],
    ep: str | None,
    token_axes: tuple[str, ...],
    capacity: int | None,
    fp8_wire: bool,
) -> tuple[tuple[Array, Array], RoutingStats]:
    """One device's part: its tokens, and its experts (``ep``: sent there, as float8 with
    ``fp8_wire``) or every expert (``ep`` None)."""
    experts, k = layer.num_experts, layer.num_experts_per_tok
    tokens = x.reshape(-1, x.shape[-1])  # [T_local, H]
    routed = layer.route(params, tokens, token_axes)
    selected, weights = routed.selected, routed.weights
    if capacity is not None:
        # Which assignments fit is decided on the whole batch, as on one device.
        everyone = lax.all_gather(selected, token_axes, axis=0, tiled=True)  # [T, k]
        everyone_weights = lax.all_gather(
            lax.stop_gradient(weights), token_axes, axis=0, tiled=True
        )
        kept, _ = drop_over_capacity(
            everyone, everyone_weights, experts, capacity, layer.drop_policy
        )
        start = lax.axis_index(token_axes) * tokens.shape[0]
        selected = lax.dynamic_slice_in_dim(kept, start, tokens.shape[0])  # [T_local, k]
        weights = jnp.where(selected < experts, weights, jnp.zeros((), weights.dtype))
    rows, perm_state, group_sizes = pure_jax_token_dispatch(routed.tokens, selected, experts, k)
    if ep is None:
        # Every expert here; the ragged lowering (the drops are decided above). The amaxes
        # combine over every batch axis, as one device's over the whole batch.
        expert_out = layer.expert_ffn(params, rows, group_sizes, sets, None)  # [R, H]
    else:
        exchange = _Exchange(ep, token_axes, capacity, fp8_wire)
        expert_out = exchange.run(layer, params, rows, group_sizes, sets)
    out = pure_jax_token_combine(expert_out, perm_state, weights, k, 1, tokens.shape[0])
    return (out.reshape(x.shape), routed.aux_loss), layer.stats(selected, token_axes)


class _Exchange(NamedTuple):
    """The expert-parallel part of one device's forward: its rows to their experts' devices,
    the local experts, the rows back."""

    ep: str
    token_axes: tuple[str, ...]
    capacity: int | None
    fp8_wire: bool

    def run(
        self,
        layer: ExpertLayer,
        params: dict[str, Array],
        rows: Array,
        group_sizes: Array,
        sets: tuple[QuantizerSet, ...],
    ) -> Array:
        """``rows [R, H]`` sorted by expert -> the experts' outputs ``[R, H]``, zero for a
        dropped row."""
        ep, experts = self.ep, layer.num_experts
        ep_size = lax.axis_size(ep)
        local_experts = experts // ep_size
        count = rows.shape[0]  # T_local * k
        # Rows sent to each device: at most all of them, or its experts' capacity.
        width = count if self.capacity is None else min(count, local_experts * self.capacity)
        ends = jnp.cumsum(group_sizes)  # [E]
        row_expert = jnp.searchsorted(ends, jnp.arange(count), side="right")  # [R]; E: dropped
        device_count = jnp.sum(group_sizes.reshape(ep_size, local_experts), axis=1)  # [ep]
        device_start = (ends - group_sizes)[::local_experts]  # [ep]
        slot = jnp.arange(width)
        source = jnp.clip(device_start[:, None] + slot[None, :], 0, count - 1)  # [ep, W]
        valid = slot[None, :] < device_count[:, None]  # [ep, W]
        send = jnp.where(valid[:, :, None], rows[source], jnp.zeros((), rows.dtype))  # [ep, W, H]
        first_expert = (jnp.arange(ep_size) * local_experts)[:, None]
        send_ids = jnp.where(valid, row_expert[source] - first_expert, local_experts)  # [ep, W]
        with jax.named_scope("dispatch"):
            received_ids = lax.all_to_all(send_ids, ep, 0, 0)  # [ep (source), W]
            # [ep (destination), W, H] -> [ep (source), W, H]; float8 under FP8.
            if self.fp8_wire:
                send_experts = jnp.where(valid, row_expert[source], experts)  # [ep, W]
                wire = (send_experts, received_ids, sets[0].x, self.token_axes, experts)
                received = _fp8_dispatch(send, ep, *wire)
            else:
                received = lax.all_to_all(send, ep, 0, 0)
            received_ids = received_ids.reshape(-1)  # [ep * W]
        order = jnp.argsort(received_ids, stable=True)  # by local expert, source, token
        local_rows = sort_rows(received.reshape(ep_size * width, -1), order)
        local_sizes = jax.ops.segment_sum(
            jnp.ones_like(received_ids), received_ids, num_segments=local_experts
        ).astype(jnp.int32)
        # Each device holds other experts: their FP8 amaxes combine over the data-parallel
        # axes only. The ragged lowering keeps that for its backward (the capacity one would
        # not).
        with scaling.distinct_over((ep,)):
            local_out = layer.expert_ffn(params, local_rows, local_sizes, sets, None)
        back = sort_rows(local_out, jnp.argsort(order)).reshape(ep_size, width, -1)
        with jax.named_scope("combine"):  # in the compute dtype
            returned = lax.all_to_all(back, ep, 0, 0)  # [ep (destination), W, H]
        device = jnp.clip(row_expert // local_experts, 0, ep_size - 1)  # [R]
        position = jnp.clip(jnp.arange(count) - device_start[device], 0, width - 1)
        valid_rows = (row_expert < experts)[:, None]
        return jnp.where(valid_rows, returned[device, position], jnp.zeros((), rows.dtype))


def _fp8_dispatch(
    send: Array,
    ep: str,
    send_experts: Array,
    received_ids: Array,
    quantizer: Quantizer | None,
    token_axes: tuple[str, ...],
    experts: int,
) -> Array:
    """The dispatch ``all_to_all`` of ``send [ep, W, H]`` in float8 (``te_flax._parallel.wire``):
    on each row's expert scale under a per-tensor recipe, so that the expert GEMM's
    quantization gives back the wire's values; on each block's own scale otherwise.

    ``send_experts``: int32 ``[ep, W]``, each row's expert (``experts`` for padding);
    ``received_ids``: int32 ``[ep, W]``, each received row's local expert; ``quantizer``: the
    first expert GEMM's x quantizer (this device's experts).
    """
    hidden = send.shape[-1]
    table = expert_scales(
        quantizer, send.reshape(-1, hidden), send_experts.reshape(-1), experts, ep, token_axes
    )  # [E] or None
    form = wire_format(quantizer)
    if table is None:
        return fp8_all_to_all(send, None, None, ep, form)
    local_experts = experts // lax.axis_size(ep)
    first = lax.axis_index(ep) * local_experts
    received_experts = jnp.where(received_ids < local_experts, first + received_ids, experts)
    send_scale = jnp.take(table, send_experts, mode="fill", fill_value=1.0)  # [ep, W]
    receive_scale = jnp.take(table, received_experts, mode="fill", fill_value=1.0)
    return fp8_all_to_all(send, send_scale, receive_scale, ep, form)
