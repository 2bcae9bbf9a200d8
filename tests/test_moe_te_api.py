"""TransformerEngine's functional MoE entry points (``te_flax.moe``, ``te_flax.ep``): ``moe`` with
TE's signature and parameter layout equals a dense reference written from the maths (every
expert applied to every token, weighted by the router's sparse probabilities) and te_flax's
``MoEBlock``, on one device and with the experts split over CPU devices."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import te_flax.linen as te_nn
from te_flax import ep as te_ep
from te_flax import moe as te_moe
from te_flax.moe import get_moe_recv_capacity_per_rank, moe
from te_flax.quantize import DelayedScaling, MXFP8BlockScaling, QuantizerFactory
from te_flax.router import fused_topk_with_score_function
from tests.helpers import FP8_FORWARD_TOLERANCE, assert_close, relative_error

E, H, F, K = 8, 32, 64, 2
BATCH, SEQ = 8, 4


def _arrays(seed: int = 0, bias: bool = False) -> dict:
    keys = jax.random.split(jax.random.key(seed), 8)
    arrays = {
        "x": jax.random.normal(keys[0], (BATCH, SEQ, H)),
        "gate_kernel": jax.random.normal(keys[1], (H, E)) / np.sqrt(H),
        "wi": jax.random.normal(keys[2], (E, H, 2 * F)) / np.sqrt(H),
        "wo": jax.random.normal(keys[3], (E, F, H)) / np.sqrt(F),
    }
    if bias:
        arrays["wi_0_bias"] = jax.random.normal(keys[4], (E, F)) / 4
        arrays["wi_1_bias"] = jax.random.normal(keys[5], (E, F)) / 4
        arrays["wo_bias"] = jax.random.normal(keys[6], (E, H)) / 4
    return arrays


def _reference(arrays: dict, expert_bias=None, early=False, **routing) -> jax.Array:
    """Every expert on every token (float32), combined with the router's dense probabilities;
    with early weighting TE adds the wo bias unweighted once per pick."""
    x = arrays["x"].reshape(-1, H)
    logits = jnp.matmul(x, arrays["gate_kernel"], precision="highest")
    probs, routing_map = fused_topk_with_score_function(
        logits, K, expert_bias=expert_bias, **routing
    )  # [T, E] sparse weights and the picks
    wi = arrays["wi"]
    gate = jnp.einsum("th,ehf->etf", x, wi[..., :F], precision="highest")  # [E, T, F]
    up = jnp.einsum("th,ehf->etf", x, wi[..., F:], precision="highest")
    if "wi_0_bias" in arrays:
        gate, up = gate + arrays["wi_0_bias"][:, None], up + arrays["wi_1_bias"][:, None]
    hidden = jax.nn.silu(gate) * up
    y = jnp.einsum("etf,efh->eth", hidden, arrays["wo"], precision="highest")  # [E, T, H]
    out = jnp.einsum("te,eth->th", probs, y)
    if "wo_bias" in arrays:
        scale = routing_map.astype(jnp.float32) if early else probs
        out = out + scale @ arrays["wo_bias"]
    return out.reshape(BATCH, SEQ, H)


def _call(arrays: dict, **options):
    return moe(**arrays, num_experts=E, num_experts_per_tok=K, ep_axis="ep", **options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"bias": True},
        {"bias": True, "early": True, "score_function": "sigmoid", "expert_bias": True},
        {"score_function": "sqrtsoftplus", "num_groups": 4, "group_topk": 2, "scaling": 2.5},
    ],
    ids=["softmax", "biases", "sigmoid-early-expert-bias", "grouped-scaled"],
)
def test_moe_equals_the_dense_reference(options):
    arrays = _arrays(bias=options.get("bias", False))
    score = options.get("score_function", "softmax")
    expert_bias = jnp.linspace(-0.5, 0.5, E) if options.get("expert_bias") else None
    routing = {"score_function": score, "scaling_factor": options.get("scaling", 1.0)}
    if "num_groups" in options:
        routing.update(num_groups=options["num_groups"], group_topk=options["group_topk"])
    early = options.get("early", False)

    def ours(arrays):
        return _call(arrays, expert_bias=expert_bias, apply_topk_weights_early=early, **routing)[0]

    def reference(arrays):
        return _reference(arrays, expert_bias=expert_bias, early=early, **routing)

    assert_close(jax.jit(ours)(arrays), reference(arrays), 1e-5, "output")
    cotangent = jax.random.normal(jax.random.key(9), (BATCH, SEQ, H))
    grads = jax.jit(jax.grad(lambda a: jnp.vdot(ours(a), cotangent)))(arrays)
    expected = jax.jit(jax.grad(lambda a: jnp.vdot(reference(a), cotangent)))(arrays)
    for name in arrays:
        assert_close(grads[name], expected[name], 1e-4, f"d{name}")


def test_moe_equals_te_flax_moe_block_and_returns_tes_extras():
    arrays = _arrays()
    block = te_nn.MoEBlock(num_experts=E, num_experts_per_tok=K, intermediate_dim=F)
    params = {
        "gate_kernel": arrays["gate_kernel"],
        "wi_kernel": arrays["wi"].reshape(E, H, 2, F),  # TE's [E, H, 2F], the gate half first
        "wo_kernel": arrays["wo"],
    }
    (expected, _), _ = block.apply({"params": params}, arrays["x"], mutable=["intermediates"])
    out, aux, received = _call(arrays, aux_loss_coeff=0.01)
    assert_close(out, expected, 1e-6, "moe against MoEBlock")
    # TE's aux loss: clean softmax scores against the tokens each expert got.
    logits = jnp.matmul(arrays["x"].reshape(-1, H), arrays["gate_kernel"], precision="highest")
    _, routing_map = fused_topk_with_score_function(logits, K)
    counts = jnp.sum(routing_map, 0).astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1)
    assert aux.dtype == jnp.float32 and aux.shape == ()
    expected_aux = E * 0.01 / (K * logits.shape[0] ** 2) * jnp.sum(jnp.sum(scores, 0) * counts)
    np.testing.assert_allclose(aux, expected_aux, rtol=1e-5)
    # One rank receives every pick, each expert's block rounded up to 128 slots.
    assert received.shape == (1, 1) and received.dtype == jnp.int32
    assert int(received[0, 0]) == 128 * int(jnp.sum(counts > 0))
    assert _call(arrays)[1] is None  # no aux loss asked for


def _mesh(data: int, ep: int) -> jax.sharding.Mesh:
    devices = np.array(jax.devices()[: data * ep]).reshape(data, ep)
    return jax.sharding.Mesh(devices, ("fsdp", "ep"))


@pytest.mark.parametrize("data, ep", [(1, 4), (2, 4)])
def test_expert_parallel_moe_equals_one_device(data, ep):
    arrays = _arrays(bias=True)
    cotangent = jax.random.normal(jax.random.key(9), (BATCH, SEQ, H))

    def loss(arrays, data_axes=()):
        out, aux, received = _call(arrays, data_parallelism_axes=data_axes, aux_loss_coeff=0.01)
        return jnp.vdot(out, cotangent) + aux, received

    (single, _), single_grads = jax.value_and_grad(loss, has_aux=True)(arrays)
    mesh = _mesh(data, ep)
    data_axes = ("fsdp",) if data > 1 else ()
    with jax.set_mesh(mesh):
        batch = NamedSharding(mesh, PartitionSpec((*data_axes, "ep")))
        placed = {**arrays, "x": jax.device_put(arrays["x"], batch)}
        step = jax.jit(jax.value_and_grad(lambda a: loss(a, data_axes), has_aux=True))
        (sharded, received), grads = step(placed)
        hlo = step.lower(placed).as_text()
    assert "all-to-all" in hlo or "all_to_all" in hlo  # the experts are split, tokens travel
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    for name in arrays:
        assert_close(grads[name], single_grads[name], 1e-4, f"d{name}")
    # Each rank (data group, expert shard) receives its group's picks of its experts.
    logits = jnp.matmul(arrays["x"].reshape(-1, H), arrays["gate_kernel"], precision="highest")
    _, routing_map = fused_topk_with_score_function(logits, K)
    counts = jnp.sum(routing_map.reshape(data, -1, E), axis=1)  # [data, E]
    slots = (counts + 127) // 128 * 128
    expected = jnp.sum(slots.reshape(data, ep, E // ep), -1).reshape(-1, 1)
    np.testing.assert_array_equal(received, expected)


def test_mxfp8_grouped_sets_as_maxtext_builds_them():
    """TE's grouped MXFP8 sets (x and dgrad over data x experts groups, kernel over experts):
    within FP8 error of the unquantized block; stateful sets and wrong group counts refused."""
    arrays = _arrays()

    def grouped(tokens: int, experts: int):
        token_set = QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling(), n_groups=tokens)
        expert_set = QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling(), n_groups=experts)
        return type(token_set)(x=token_set.x, kernel=expert_set.kernel, dgrad=token_set.dgrad)

    sets = (grouped(E, E), grouped(E, E))
    out = jax.jit(lambda a: _call(a, quantizer_sets=sets)[0])(arrays)
    error = relative_error(out, _call(arrays)[0])
    assert 0 < error < FP8_FORWARD_TOLERANCE, error
    with pytest.raises(ValueError, match="n_groups=4, but describes the global operation"):
        _call(arrays, quantizer_sets=(grouped(4, E), grouped(E, E)))
    delayed = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), n_groups=E)
    with pytest.raises(NotImplementedError, match="MoEBlock"):
        _call(arrays, quantizer_sets=(delayed, delayed))


def test_bad_calls_name_the_fix():
    arrays = _arrays()
    with pytest.raises(ValueError, match=r"wi must be \[num_experts, hidden, 2 \* intermediate\]"):
        _call({**arrays, "wi": arrays["wi"][..., :-1]})
    with pytest.raises(ValueError, match="multiple of 128"):
        _call(arrays, recv_capacity_per_rank=100)
    with jax.set_mesh(_mesh(1, 4)), pytest.raises(ValueError, match="mesh has axes"):
        moe(**arrays, num_experts=E, num_experts_per_tok=K, ep_axis="expert")
    with jax.set_mesh(_mesh(1, 4)), pytest.raises(ValueError, match="divisible by ep"):
        _call({**arrays, "x": arrays["x"][:2]})
    with pytest.raises(ValueError, match="both or neither"):
        _call({**arrays, "wi_0_bias": jnp.zeros((E, F))})
    with pytest.warns(UserWarning, match="ignores expert_bias"):
        te_moe._WARNED.discard("softmax")
        out = _call(arrays, expert_bias=jnp.ones(E))[0]
    np.testing.assert_array_equal(out, _call(arrays)[0])


def test_recv_capacity_is_tes():
    # Numbers from TransformerEngine 2.20.2's get_moe_recv_capacity_per_rank (parity checks more).
    cases = {
        (8, 2, 256, 2, None): 1536,
        (8, 2, 256, 2, 1.0): 512,
        (32, 4, 64, 1, None): 4096,
        (256, 8, 4096, 8, 1.5): 49152,
        (64, 6, 1000, 4, 1.25): 7680,
        (4, 4, 1, 4, None): 128,
    }
    for (experts, topk, tokens, ep, factor), expected in cases.items():
        got = get_moe_recv_capacity_per_rank(
            num_experts=experts,
            num_experts_per_tok=topk,
            max_tokens_per_rank=tokens,
            ep_size=ep,
            recv_capacity_factor=factor,
        )
        assert got == expected, (experts, topk, tokens, ep, factor, got)
    with pytest.raises(ValueError, match="divisible by ep_size"):
        get_moe_recv_capacity_per_rank(
            num_experts=6, num_experts_per_tok=2, max_tokens_per_rank=8, ep_size=4
        )


def test_bootstrap_is_a_checked_no_op_that_moe_honours():
    arrays = _arrays()
    te_ep._SAID.clear()
    with pytest.warns(te_ep.NoBootstrapNeededWarning, match="nothing to set up"):
        te_ep.ep_bootstrap(1, 0, E, BATCH * SEQ, 4096, H, max_token_dtype=jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        te_ep.ep_bootstrap(None, None, E, BATCH * SEQ, 4096, H)
    assert te_ep.bootstrap_config().max_tokens_per_rank == BATCH * SEQ
    try:
        te_moe.record_ep_bootstrap_signature_for_moe(E, BATCH * SEQ // 2, 4096, H, 1)
        with pytest.raises(ValueError, match="bootstrap again"):
            _call(arrays)  # 32 tokens per rank, bootstrapped for 16
        te_moe.record_ep_bootstrap_signature_for_moe(E, BATCH * SEQ, 4096, H, 1)
        _call(arrays)
    finally:
        te_moe._SIGNATURE.clear()
        te_ep.ep_finalize()
    assert te_ep.bootstrap_config() is None
    with pytest.raises(ValueError, match="num_experts must be"):
        te_ep.ep_bootstrap(1, 0, 0, 8, 128, H)
    with nn.logical_axis_rules(()):  # no effect: the rules the call brings are its own
        _call(arrays)
