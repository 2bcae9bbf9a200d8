"""TransformerEngine's functional mixture-of-experts block (``transformer_engine.jax.moe``).

``moe`` takes TransformerEngine's arguments (its parameter layout: ``gate_kernel [H, E]``,
``wi [E, H, 2 * F]`` with the gate half first, ``wo [E, F, H]``, split ``wi_0`` / ``wi_1``
biases) and runs te_flax's MoE block on them: the router (``te_flax.router``), the permutation
(``te_flax.permutation``), the two grouped GEMMs (``te_flax.dense.grouped_dense``) and, across
devices, the expert-parallel exchange of ``MoEBlock`` (``all_to_all`` over ``ep_axis`` inside
``jit``; no bootstrap, no buffers to size). Its results are TE's: the output, the aux loss
(TE's definition: the scores of a clean top-k against the tokens each expert actually got) and
each rank's received token slots (``total_recv_tokens``, per expert rounded up to TE's
128-token alignment), which te_flax reports but never drops at: its exchange holds every
routed token.

``get_moe_recv_capacity_per_rank`` computes TE's receive capacity, and
``record_ep_bootstrap_signature_for_moe`` records what a process gave ``ep_bootstrap``
(``te_flax.ep``), which ``moe`` then checks as TE does.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import PartitionSpec

from te_flax._base import checks as check
from te_flax._layers.moe import MoEBlockDescription
from te_flax.quantize import QuantizerSet, noop_quantizer_set
from te_flax.router import ScoreFunction, fused_moe_aux_loss, fused_topk_with_score_function
from te_flax.sharding import on_auto_axes, spec_of, with_logical_constraint

__all__ = [
    "ALIGN_SIZE",
    "get_moe_recv_capacity_per_rank",
    "moe",
    "record_ep_bootstrap_signature_for_moe",
]

# TransformerEngine's per-expert receive-slot alignment (its NCCL EP needs 128-token blocks).
ALIGN_SIZE = 128
_SIGNATURE: list[tuple[int, int, int, int, int]] = []  # recorded after ep_bootstrap
_WARNED: set[str] = set()


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def get_moe_recv_capacity_per_rank(
    *,
    num_experts: int,
    num_experts_per_tok: int,
    max_tokens_per_rank: int,
    ep_size: int,
    recv_capacity_factor: float | None = None,
    alignment: int = ALIGN_SIZE,
) -> int:
    """The aligned receive capacity of one expert-parallel rank, as TransformerEngine sizes it.

    ``recv_capacity_factor=None`` gives the dropless worst case; a finite factor >= 1 scales
    the capacity perfectly balanced routing needs (each local expert's share aligned on its
    own), capped at the worst case. te_flax's exchange needs no capacity (it never drops);
    this serves code that sizes TE's buffers, and ``moe`` checks its argument against it.

    Args:
      num_experts: the experts, a multiple of ``ep_size``.
      num_experts_per_tok: the experts each token picks (top-k).
      max_tokens_per_rank: the most tokens one rank sends in a step.
      ep_size: the ranks the experts are split over.
      recv_capacity_factor: None (default, the worst case) or a float >= 1.
      alignment: the per-expert slot alignment (default 128, TE's).

    Returns:
      The capacity, a multiple of ``alignment``.

    Example usage::

      >>> from te_flax.moe import get_moe_recv_capacity_per_rank
      >>> get_moe_recv_capacity_per_rank(
      ...     num_experts=8, num_experts_per_tok=2, max_tokens_per_rank=256, ep_size=2)
      1536
    """
    for name, value in (
        ("num_experts", num_experts),
        ("num_experts_per_tok", num_experts_per_tok),
        ("max_tokens_per_rank", max_tokens_per_rank),
        ("ep_size", ep_size),
        ("alignment", alignment),
    ):
        check.check_positive_int(value, name)
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by ep_size={ep_size}")
    if recv_capacity_factor is not None:
        recv_capacity_factor = float(recv_capacity_factor)
        if not math.isfinite(recv_capacity_factor) or recv_capacity_factor < 1.0:
            raise ValueError(
                "recv_capacity_factor must be finite and >= 1.0, or None for the worst case; "
                f"got {recv_capacity_factor}"
            )
    local_experts = num_experts // ep_size
    group_tokens = ep_size * max_tokens_per_rank  # what one rank may receive from its group
    assignments = group_tokens * min(num_experts_per_tok, local_experts)
    padded = assignments + (alignment - 1) * min(local_experts, assignments)
    worst_case = min(
        local_experts * _round_up(group_tokens, alignment), _round_up(padded, alignment)
    )
    if recv_capacity_factor is None:
        return worst_case
    balanced = -(-max_tokens_per_rank * num_experts_per_tok // local_experts)  # ceil
    balanced_aligned = local_experts * _round_up(balanced, alignment)
    requested = _round_up(math.ceil(balanced_aligned * recv_capacity_factor), alignment)
    return min(requested, worst_case)


def record_ep_bootstrap_signature_for_moe(
    num_experts: int,
    max_tokens_per_rank: int,
    recv_capacity_per_rank: int,
    hidden_dim: int,
    ep_size: int,
) -> None:
    """Records what this process gave ``ep_bootstrap``; ``moe`` then checks its calls against
    it as TransformerEngine does (same experts, hidden size and EP size; no more tokens or
    receive capacity). te_flax needs no bootstrap: without a record ``moe`` checks nothing."""
    values = (num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim, ep_size)
    names = ("num_experts", "max_tokens_per_rank", "recv_capacity_per_rank", "hidden_dim")
    for name, value in zip((*names, "ep_size"), values, strict=True):
        check.check_positive_int(value, name)
    _SIGNATURE[:] = [values]


class _Call(NamedTuple):
    """The static facts of one ``moe`` call, checked."""

    batch: int
    sequence: int
    hidden: int
    intermediate: int
    ep_size: int
    data_size: int
    recv_capacity: int


def moe(
    x: Array,
    gate_kernel: Array,
    wi: Array,
    wo: Array,
    wi_0_bias: Array | None = None,
    wi_1_bias: Array | None = None,
    wo_bias: Array | None = None,
    expert_bias: Array | None = None,
    *,
    num_experts: int,
    num_experts_per_tok: int,
    activation_type: str = "silu",
    score_function: str | ScoreFunction = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float = 1.0,
    aux_loss_coeff: float = 0.0,
    apply_topk_weights_early: bool = False,
    quantizer_sets: tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
    ep_axis: str,
    data_parallelism_axes: tuple[str, ...] = (),
    input_axes: tuple[str | None, ...] = (),
    gate_kernel_axes: tuple[str | None, ...] = (),
    wi_kernel_axes: tuple[str | None, ...] = ("exp", "embed", "mlp"),
    wo_kernel_axes: tuple[str | None, ...] = ("exp", "mlp", "embed"),
    dtype: Any = jnp.float32,
    recv_capacity_per_rank: int | None = None,
) -> tuple[Array, Array | None, Array]:
    """A mixture-of-experts block with TransformerEngine's signature and parameter layout.

    ``out[t] = sum_k w[t, k] * (act(x[t] . wi_e[:, :F] + b0_e) * (x[t] . wi_e[:, F:] + b1_e))
    . wo_e + bias``, ``e`` the ``k``-th expert token ``t`` picks; the wo bias adds
    ``w[t, k] * wo_bias[e]`` per pick, or ``wo_bias[e]`` unweighted with
    ``apply_topk_weights_early`` (as TE's early weighting does).

    Args:
      x: ``[batch, seq, hidden]`` tokens, floating point; the output has their dtype.
      gate_kernel: ``[hidden, E]`` router kernel (the logits are float32).
      wi: ``[E, hidden, 2 * F]`` first kernels, the gate half (through ``activation_type``)
        first, the linear half second.
      wo: ``[E, F, hidden]`` second kernels.
      wi_0_bias: ``[E, F]`` gate-half bias or None (default); with ``wi_1_bias``.
      wi_1_bias: ``[E, F]`` linear-half bias or None (default); with ``wi_0_bias``.
      wo_bias: ``[E, hidden]`` second bias or None (default).
      expert_bias: ``[E]`` routing bias (steers the choice, not the weights) or None
        (default); sigmoid and sqrtsoftplus scores only: with softmax TE's kernel ignores it,
        and so does this, with a warning.
      num_experts: E.
      num_experts_per_tok: the experts each token picks (k).
      activation_type: the gate half's activation (default ``"silu"``: SwiGLU), a name of
        ``flax.linen`` as in TE.
      score_function: ``"softmax"`` (default), ``"sigmoid"`` or ``"sqrtsoftplus"``.
      use_pre_softmax: softmax before the top-k (default False: after).
      num_groups: expert groups for group-limited routing (default None: none).
      group_topk: groups each token may pick from (default None).
      scaling_factor: multiplies the routing weights (default 1.0).
      aux_loss_coeff: the load-balancing loss's coefficient (default 0.0: no loss).
      apply_topk_weights_early: TE weights the FFN's intermediate instead of its output
        (default False); the same result here but for the wo bias (see above).
      quantizer_sets: the two grouped GEMMs' quantizer sets (default: no FP8): no-op sets or
        stateless ones (current scaling, MXFP8, NVFP4, blockwise FP8), grouped
        (``QuantizerFactory.create_set(n_groups=...)``: ``dp * E`` groups for ``x`` and
        ``dgrad``, ``E`` for ``kernel``, as TE describes them) or not. Per-expert delayed
        scaling is ``MoEBlock``'s (``te_flax.linen.MoEBlock``), as in TE.
      ep_axis: the mesh axis the experts are split over (a size-1 or absent mesh: one device).
      data_parallelism_axes: the mesh axes the batch is split over besides ``ep_axis``
        (default ``()``); the batch splits over ``(*data_parallelism_axes, ep_axis)``.
      input_axes: logical axes of ``x`` and the output (default ``()``: no constraint).
      gate_kernel_axes: logical axes of ``gate_kernel`` (default ``()``).
      wi_kernel_axes: logical axes of ``wi`` (default ``("exp", "embed", "mlp")``).
      wo_kernel_axes: logical axes of ``wo`` (default ``("exp", "mlp", "embed")``).
      dtype: the aux loss's dtype (default float32; TE also rounds the routing weights to it,
        te_flax keeps them in float32).
      recv_capacity_per_rank: TE's receive capacity per rank, a multiple of 128, or None
        (default: the dropless worst case); checked against ``ep_bootstrap``'s, never a
        limit here.

    Returns:
      ``(output [batch, seq, hidden], aux_loss [] or None, total_recv_tokens [ranks, 1])``:
      ``aux_loss`` is None when ``aux_loss_coeff`` is 0; ``total_recv_tokens`` (int32, not
      differentiated) counts the slots each rank ``(data, ep)`` receives, per expert rounded
      up to 128, as TE's does (above ``recv_capacity_per_rank``, TE would have dropped).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from te_flax.moe import moe
      >>> keys = jax.random.split(jax.random.key(0), 4)
      >>> x = jax.random.normal(keys[0], (2, 8, 32))
      >>> gate = jax.random.normal(keys[1], (32, 4))
      >>> wi = jax.random.normal(keys[2], (4, 32, 2 * 16)) / 6
      >>> wo = jax.random.normal(keys[3], (4, 16, 32)) / 4
      >>> out, aux, received = moe(
      ...     x, gate, wi, wo, num_experts=4, num_experts_per_tok=2, ep_axis="expert")
      >>> out.shape, aux, received.shape
      ((2, 8, 32), None, (1, 1))
    """
    call = _check_call(x, gate_kernel, wi, wo, num_experts, ep_axis, data_parallelism_axes)
    call = call._replace(recv_capacity=_recv_capacity(call, num_experts, num_experts_per_tok,
                                                      recv_capacity_per_rank))  # fmt: skip
    _check_bootstrap(call, num_experts)
    sets = _stateless_sets(quantizer_sets, num_experts, call.data_size)
    expert_bias = _routing_bias(expert_bias, score_function, num_experts)
    description = MoEBlockDescription(
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        intermediate_dim=call.intermediate,
        activations=(activation_type, "linear"),
        score_function=str(getattr(score_function, "name", score_function)).lower(),
        use_pre_softmax=use_pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        use_expert_routing_bias=expert_bias is not None,
        use_bias=wi_0_bias is not None,  # the wi biases; TE's wo bias is added below
    )
    x = with_logical_constraint(x, input_axes)
    params = _params(
        with_logical_constraint(gate_kernel, gate_kernel_axes),
        with_logical_constraint(wi, wi_kernel_axes),
        with_logical_constraint(wo, wo_kernel_axes),
        (wi_0_bias, wi_1_bias, expert_bias),
        num_experts,
    )
    with _expert_rules(ep_axis, tuple(data_parallelism_axes)):
        (out, _), _ = description.forward(params, x, sets)  # [B, S, H]
    extras = _RoutingExtras(
        description, aux_loss_coeff, apply_topk_weights_early, call, dtype, wo_bias is not None
    )
    tokens = x.reshape(-1, call.hidden)  # [T, H]
    scalar = PartitionSpec()
    bias, aux_loss, received = on_auto_axes(
        extras.compute, (spec_of(tokens), scalar, scalar), params, wo_bias, tokens
    )  # [T, H] (or [T, 1] zeros without a wo bias), [], [ranks, 1]
    out = out + bias.reshape(call.batch, call.sequence, -1).astype(out.dtype)
    out = with_logical_constraint(out, input_axes)
    return out, (aux_loss if aux_loss_coeff > 0 else None), received


def _check_call(
    x: Array,
    gate_kernel: Array,
    wi: Array,
    wo: Array,
    num_experts: int,
    ep_axis: str,
    data_axes: Sequence[str],
) -> _Call:
    check.check_floating(x, "moe's x")
    if x.ndim != 3:
        raise ValueError(f"moe's x must be [batch, seq, hidden], got shape {x.shape}")
    batch, sequence, hidden = x.shape
    experts = check.check_positive_int(num_experts, "num_experts")
    if wi.ndim != 3 or wi.shape[-1] % 2:
        raise ValueError(
            f"wi must be [num_experts, hidden, 2 * intermediate] (the gate half, then the linear "
            f"half), got shape {wi.shape}"
        )
    intermediate = wi.shape[-1] // 2
    for name, array, shape in (
        ("gate_kernel", gate_kernel, (hidden, experts)),
        ("wi", wi, (experts, hidden, 2 * intermediate)),
        ("wo", wo, (experts, intermediate, hidden)),
    ):
        check.check_shape(array, shape, name, f"num_experts={experts}, hidden={hidden} (x)")
    if not isinstance(ep_axis, str):
        raise TypeError(f"ep_axis must be a mesh axis name (str), got {ep_axis!r}")
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if not mesh.empty else {}
    for axis in (*data_axes, ep_axis):
        if sizes and axis not in sizes:
            raise ValueError(
                f"moe names mesh axis {axis!r} (ep_axis / data_parallelism_axes), but the active "
                f"mesh has axes {tuple(sizes)}; name one of those"
            )
    ep_size = int(sizes.get(ep_axis, 1))
    data_size = math.prod(int(sizes.get(axis, 1)) for axis in data_axes)
    if experts % ep_size:
        raise ValueError(f"num_experts={experts} must be divisible by EP size={ep_size}")
    if batch % (ep_size * data_size):
        raise ValueError(
            f"batch={batch} must be divisible by ep*dp={ep_size * data_size}: the batch splits "
            f"over {(*data_axes, ep_axis)}"
        )
    return _Call(batch, sequence, hidden, intermediate, ep_size, data_size, 0)


def _recv_capacity(call: _Call, num_experts: int, topk: int, capacity: int | None) -> int:
    if capacity is None:
        return get_moe_recv_capacity_per_rank(
            num_experts=num_experts,
            num_experts_per_tok=topk,
            max_tokens_per_rank=_tokens_per_rank(call),
            ep_size=call.ep_size,
        )
    if (
        isinstance(capacity, bool)
        or not isinstance(capacity, int)
        or capacity <= 0
        or (capacity % ALIGN_SIZE)
    ):
        raise ValueError(
            f"recv_capacity_per_rank must be a positive multiple of {ALIGN_SIZE}, got {capacity!r}"
        )
    return capacity


def _tokens_per_rank(call: _Call) -> int:
    return call.batch // (call.ep_size * call.data_size) * call.sequence


def _check_bootstrap(call: _Call, num_experts: int) -> None:
    """TE's check of a call against the recorded ``ep_bootstrap`` (none recorded: nothing)."""
    if not _SIGNATURE:
        return
    experts, max_tokens, capacity, hidden, ep_size = _SIGNATURE[0]
    needed = (num_experts, _tokens_per_rank(call), call.recv_capacity, call.hidden, call.ep_size)
    if (
        (num_experts, call.hidden, call.ep_size) != (experts, hidden, ep_size)
        or needed[1] > max_tokens
        or needed[2] > capacity
    ):
        raise ValueError(
            "ep_bootstrap was given (num_experts, max_tokens_per_rank, recv_capacity_per_rank, "
            f"hidden_dim, ep_size) = {_SIGNATURE[0]}, but this moe call needs {needed}; "
            "bootstrap again with these sizes (or larger token counts and capacity)"
        )


def _stateless_sets(
    quantizer_sets: object, num_experts: int, data_size: int
) -> tuple[QuantizerSet, QuantizerSet]:
    """The two GEMMs' sets, checked as TE describes them (global group counts)."""
    if not isinstance(quantizer_sets, tuple) or len(quantizer_sets) != 2:
        raise TypeError(
            "moe's quantizer_sets must be a tuple of the two GEMMs' QuantizerSets (wi, wo), got "
            f"{quantizer_sets!r}"
        )
    expected = {
        "x": data_size * num_experts,
        "kernel": num_experts,
        "dgrad": data_size * num_experts,
    }
    for gemm, quantizer_set in zip(("wi", "wo"), quantizer_sets, strict=True):
        if not isinstance(quantizer_set, QuantizerSet):
            raise TypeError(
                f"moe's {gemm} quantizer set must be a QuantizerSet, got {quantizer_set!r}"
            )
        for role, groups in expected.items():
            n_groups = getattr(getattr(quantizer_set, role), "n_groups", None)
            if n_groups is not None and n_groups != groups:
                raise ValueError(
                    f"moe's {gemm} {role} quantizer has n_groups={n_groups}, but describes the "
                    f"global operation as in TransformerEngine: {groups} groups (x and dgrad: "
                    f"data-parallel size {data_size} x {num_experts} experts; kernel: experts)"
                )
        if jax.tree.leaves(quantizer_set):
            raise NotImplementedError(
                f"moe's {gemm} quantizer set holds state ({type(quantizer_set.x).__name__}): "
                "moe takes no-op and stateless sets (current scaling, MXFP8, NVFP4, blockwise "
                "FP8), as TransformerEngine's; for per-expert delayed scaling use "
                "te_flax.linen.MoEBlock / te_flax.nnx.MoEBlock"
            )
    return quantizer_sets


def _routing_bias(bias: Array | None, score_function: object, num_experts: int) -> Array | None:
    if bias is None:
        return None
    name = str(getattr(score_function, "name", score_function)).lower()
    if name == "softmax":
        if "softmax" not in _WARNED:
            _WARNED.add("softmax")
            warnings.warn(
                "moe(score_function='softmax') ignores expert_bias, as TransformerEngine's "
                "router kernel does (the bias steers sigmoid and sqrtsoftplus routers only); "
                "add a bias to the logits before the call to have one",
                UserWarning,
                stacklevel=3,
            )
        return None
    check.check_shape(bias, (num_experts,), "expert_bias", f"num_experts={num_experts}")
    return bias


def _params(
    gate_kernel: Array,
    wi: Array,
    wo: Array,
    biases: tuple[Array | None, Array | None, Array | None],
    num_experts: int,
) -> dict[str, Array]:
    """TE's arrays as ``MoEBlockDescription``'s parameters (``wi [E, H, 2, F]``: gate half
    first)."""
    wi_0_bias, wi_1_bias, expert_bias = biases
    experts, hidden, double = wi.shape
    params = {
        "gate_kernel": gate_kernel,
        "wi_kernel": wi.reshape(experts, hidden, 2, double // 2),  # [E, H, 2F] -> [E, H, 2, F]
        "wo_kernel": wo,
    }
    if (wi_0_bias is None) != (wi_1_bias is None):
        raise ValueError("moe takes wi_0_bias and wi_1_bias together (both or neither)")
    if wi_0_bias is not None and wi_1_bias is not None:
        for name, bias in (("wi_0_bias", wi_0_bias), ("wi_1_bias", wi_1_bias)):
            check.check_shape(bias, (experts, double // 2), name, f"num_experts={num_experts}")
        params["wi_bias"] = jnp.stack([wi_0_bias, wi_1_bias], axis=1)  # [E, 2, F]
    if expert_bias is not None:
        params["expert_bias"] = expert_bias
    return params


@contextlib.contextmanager
def _expert_rules(ep_axis: str, data_axes: tuple[str, ...]) -> Iterator[None]:
    """The active logical rules with ``exp`` on ``ep_axis`` and ``batch`` on ``(*data, ep)``,
    which is how ``MoEBlock`` learns TE's physical axes."""
    batch = (*data_axes, ep_axis)
    ours = (("exp", ep_axis), ("batch", batch if len(batch) > 1 else ep_axis))
    rest = tuple(rule for rule in nn.get_logical_axis_rules() if rule[0] not in ("exp", "batch"))
    with nn.logical_axis_rules(ours + rest):
        yield


class _RoutingExtras(NamedTuple):
    """What TE's ``moe`` returns beside ``MoEBlock``'s output, from the same routing choice:
    the wo bias, TE's aux loss and the ranks' received slots."""

    description: MoEBlockDescription
    aux_loss_coeff: float
    early: bool
    call: _Call
    dtype: Any
    has_wo_bias: bool

    def compute(
        self, params: dict[str, Array], wo_bias: Array | None, tokens: Array
    ) -> tuple[Array, Array, Array]:
        description, call = self.description, self.call
        routed = description.route(params, tokens)  # the choice MoEBlock makes: [T, k]
        selected, weights = routed.selected, routed.weights
        bias = jnp.zeros((tokens.shape[0], 1), jnp.float32)
        if self.has_wo_bias and wo_bias is not None:
            scale = jnp.ones_like(weights) if self.early else weights  # [T, k]
            picked = wo_bias.astype(jnp.float32)[selected]  # [T, k, H]
            bias = jnp.einsum("tk,tkh->th", scale, picked)
        counts = _counts(selected.reshape(call.data_size, -1), description.num_experts)  # [dp, E]
        aux_loss = jnp.zeros((), self.dtype)
        if self.aux_loss_coeff > 0:
            logits = jnp.matmul(
                tokens.astype(jnp.float32),
                params["gate_kernel"].astype(jnp.float32),
                precision=lax.Precision.HIGHEST,
            )  # [T, H] x [H, E] -> [T, E], as the router computes them
            scores, _ = fused_topk_with_score_function(
                logits,
                description.num_experts_per_tok,
                score_function=description.score_function,
                compute_aux_scores=True,
            )
            aux = fused_moe_aux_loss(
                scores, jnp.sum(counts, 0), description.num_experts_per_tok, self.aux_loss_coeff
            )
            aux_loss = aux.astype(self.dtype)
        slots = _round_up_array(counts, ALIGN_SIZE)  # [dp, E]
        received = jnp.sum(slots.reshape(call.data_size, call.ep_size, -1), axis=-1)  # [dp, ep]
        return bias, aux_loss, lax.stop_gradient(received.reshape(-1, 1).astype(jnp.int32))


def _counts(selected: Array, num_experts: int) -> Array:
    """Assignments per expert of each row of ``selected`` (``[groups, n]`` -> ``[groups, E]``)."""
    return jax.vmap(lambda ids: jnp.bincount(ids, length=num_experts))(selected)


def _round_up_array(counts: Array, multiple: int) -> Array:
    return (counts + multiple - 1) // multiple * multiple
