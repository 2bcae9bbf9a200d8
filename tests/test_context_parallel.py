"""Context parallelism: DotProductAttention with the sequence sharded over a ``context`` mesh
axis (the all-gather and ring strategies, causal load balancing in each of TE's reorders,
packing) equals one device.

Small shapes on the 8 CPU devices; each case compiles one jitted loss-and-gradient function.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax.linen as te_nn
from te_flax.attention import (
    ReorderStrategy,
    SequenceDescriptor,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from te_flax.sharding import load_axis_rules, make_mesh

BATCH, SEQ, HEADS, HEAD_DIM = 2, 32, 2, 8
SWAP = ReorderStrategy.DualChunkSwap
STRIPED = ReorderStrategy.Striped


def _qkv() -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (BATCH, SEQ, HEADS, HEAD_DIM)) for k in keys)


def _packed() -> SequenceDescriptor:
    """Three documents per row, the second row ending in padding (id 0)."""
    ids = np.ones((BATCH, SEQ), np.int32)
    ids[:, 10:], ids[:, 25:], ids[1, 29:] = 2, 3, 0
    starts = np.array([0, 10, 25])
    pos = np.arange(SEQ) - starts[np.searchsorted(starts, np.arange(SEQ), side="right") - 1]
    pos = np.broadcast_to(pos, ids.shape)
    return SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids), jnp.asarray(pos))


def _one_document_per_row() -> SequenceDescriptor:
    """A descriptor of unpacked rows: segment ids 1, positions 0 .. SEQ - 1."""
    pos = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))
    return SequenceDescriptor.from_segment_ids_and_pos(
        jnp.ones((BATCH, SEQ), jnp.int32), jnp.asarray(pos)
    )


def _loss_and_grads(module, cp_size, balanced, packed, qkv=None, order=(SWAP, None)):
    """``(output, grads of (params, q, k, v))`` of a fixed weighted sum of the output, with the
    inputs reordered for load balancing by ``order`` = (strategy, stripe_size) (and the output
    put back) when ``balanced``; ``packed``: the descriptor, True for ``_packed()``'s
    documents, "rows" for one document per row, "seqlens" for rows of 32 and 23 tokens given
    by ``from_seqlens``, False for none; ``qkv``: the inputs (default ``_qkv()``). Segment ids
    and positions are given as MaxText gives them: reordered with the tensors, with the
    keywords of TE before 2.14 for a Striped order."""
    weights = jnp.sin(jnp.arange(BATCH * SEQ * HEADS * HEAD_DIM, dtype=jnp.float32))
    weights = weights.reshape(BATCH, SEQ, HEADS, HEAD_DIM)
    strategy, stripe_size = order

    def reorder(x):
        if not balanced:
            return x
        return reorder_causal_load_balancing(x, strategy, cp_size, 1, stripe_size)

    def loss(params, q, k, v):
        descriptor = None
        if packed == "seqlens":  # in the original order, whatever the tensors' order
            descriptor = SequenceDescriptor.from_seqlens(jnp.asarray([SEQ, 23]))
        elif packed:
            segments = _packed() if packed is True else _one_document_per_row()
            ids, pos = (reorder(t) for t in (segments.segment_ids[0], segments.segment_pos[0]))
            keywords = {}
            if strategy == STRIPED:
                keywords = dict(is_thd=True, is_segment_ids_reordered=balanced and cp_size > 1)
            descriptor = SequenceDescriptor.from_segment_ids_and_pos(ids, pos, **keywords)
        out = module.apply(params, *(reorder(t) for t in (q, k, v)), sequence_descriptor=descriptor)
        if balanced:
            out = inverse_reorder_causal_load_balancing(out, strategy, cp_size, 1, stripe_size)
        return jnp.sum(out * weights), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    params = {}
    if module.softmax_type == "learnable":  # a nonzero sink, so that its gradient is tested
        params = jax.tree.map(lambda p: p + 0.3, jax.jit(module.init)(jax.random.key(1), *_qkv()))
    (_, out), grads = step(params, *(_qkv() if qkv is None else qkv))
    return out, grads


def _mesh(cp_size: int) -> jax.sharding.Mesh:
    return make_mesh({"data": 8 // cp_size, "context": cp_size})


def _relative(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _module(strategy: str, balanced: bool, **attributes):
    return te_nn.DotProductAttention(
        head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        context_parallel_axis="context",
        context_parallel_strategy=strategy,
        context_parallel_causal_load_balanced=balanced,
        **attributes,
    )


@pytest.mark.parametrize(
    "cp_size, strategy, balanced, packed, attributes",
    [
        (8, "all_gather", True, False, {}),
        (8, "ring", True, True, {}),
        (2, "ring", False, False, {"window_size": (5, 0)}),
        (4, "all_gather", False, False, {"softmax_type": "learnable"}),
        (4, "ring", False, True, {"softmax_type": "learnable", "window_size": (7, 0)}),
    ],
    ids=["8-all-gather", "8-ring-packed", "2-ring-window", "4-all-gather-sink", "4-ring-all"],
)
def test_context_parallel_equals_one_device(cp_size, strategy, balanced, packed, attributes):
    """Outputs and the gradients of q, k, v (and the sink) within 1e-5 relative L2."""
    module = _module(strategy, balanced, **attributes)
    expected = _loss_and_grads(module, 1, False, packed)  # no mesh: one device
    with jax.set_mesh(_mesh(cp_size)):
        got = _loss_and_grads(module, cp_size, balanced, packed)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert _relative(ours, theirs) <= 1e-5
    if packed:  # the padding queries of row 1 get zero output and zero gradient
        np.testing.assert_array_equal(got[0][1, 29:], 0.0)
        np.testing.assert_array_equal(got[1][1][1, 29:], 0.0)


@functools.cache
def _one_device(packed, window):
    """One device's ``_loss_and_grads`` (no mesh: the strategy and balancing play no part)."""
    return _loss_and_grads(_module("ring", False, window_size=window), 1, False, packed)


@pytest.mark.parametrize(
    "order, cp_size, strategy, packed, window",
    [
        ((STRIPED, None), 2, "ring", True, None),
        ((STRIPED, None), 2, "all_gather", True, None),
        ((STRIPED, 1), 4, "ring", True, None),
        ((STRIPED, 2), 4, "all_gather", True, None),
        ((STRIPED, None), 8, "ring", True, None),
        ((STRIPED, None), 8, "all_gather", "rows", None),
        ((STRIPED, 2), 2, "ring", True, (5, 0)),
        ((SWAP, None), 4, "all_gather", True, (7, 0)),
        ((SWAP, None), 2, "ring", "seqlens", None),
    ],
    ids=[
        "striped-2-ring-packed",
        "striped-2-all-gather-packed",
        "striped-4-ring-packed",
        "striped2-4-all-gather-packed",
        "striped-8-ring-packed",
        "striped-8-all-gather-rows",
        "striped2-2-ring-window",
        "swap-4-all-gather-window",
        "swap-2-ring-seqlens",
    ],
)
def test_every_reorder_equals_one_device(order, cp_size, strategy, packed, window):
    """MaxText's packed batch reordered with ``Striped`` (TE's reorder for thd) or
    ``DualChunkSwap``, with the descriptor of its reordered segment ids and positions: output
    and q, k, v gradients within 1e-5 relative L2 of one device on the batch in its order."""
    module = _module(strategy, True, window_size=window)
    expected = _one_device(packed, window)
    with jax.set_mesh(_mesh(cp_size)):
        got = _loss_and_grads(module, cp_size, True, packed, order=order)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert _relative(ours, theirs) <= 1e-5
    if packed is True:  # the padding queries of row 1 get zero output and zero gradient
        np.testing.assert_array_equal(got[0][1, 29:], 0.0)
        np.testing.assert_array_equal(got[1][1][1, 29:], 0.0)


def test_load_balanced_packed_seqlens_and_offsets_are_refused():
    """Seqlens and offsets cannot say which reorder placed the tokens (TE refuses them too)."""
    q, k, v = _qkv()
    descriptor = SequenceDescriptor.from_seqlens_and_offsets(
        jnp.asarray([[10, 22], [10, 19]]), jnp.asarray([[0, 10, 32], [0, 10, 29]])
    )
    with jax.set_mesh(_mesh(2)):
        with pytest.raises(ValueError, match=r"needs a SequenceDescriptor of segment ids and pos"):
            _module("ring", True).apply({}, q, k, v, sequence_descriptor=descriptor)
        # Not load balanced, the tensors' order is the documents' order: accepted.
        _module("ring", False).apply({}, q, k, v, sequence_descriptor=descriptor)


def test_te_keywords_of_from_segment_ids_and_pos():
    """TE's keywords before 2.14: positions given are kept; without them, TE's default then
    (restarting at each run of one id for thd, along the row otherwise), refused for
    reordered ids."""
    ids = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 3]])
    pos = jnp.asarray([[5, 6, 7, 0, 1, 0, 0, 9]])
    kept = SequenceDescriptor.from_segment_ids_and_pos(
        ids, pos, is_thd=True, is_segment_ids_reordered=True
    )
    np.testing.assert_array_equal(kept.segment_pos[0], pos)
    thd = SequenceDescriptor.from_segment_ids_and_pos(
        ids, is_thd=True, is_segment_ids_reordered=False
    )
    np.testing.assert_array_equal(thd.segment_pos[1], [[0, 1, 2, 0, 1, 0, 1, 0]])
    bshd = SequenceDescriptor.from_segment_ids_and_pos(
        (ids, ids), is_thd=False, is_segment_ids_reordered=False
    )
    np.testing.assert_array_equal(bshd.segment_pos[0], [np.arange(8)])
    with pytest.raises(ValueError, match=r"is_segment_ids_reordered=True\) needs segment_pos"):
        SequenceDescriptor.from_segment_ids_and_pos(ids, is_thd=True, is_segment_ids_reordered=True)
    with pytest.raises(ValueError, match=r"needs segment_pos .* as in TransformerEngine"):
        SequenceDescriptor.from_segment_ids_and_pos(ids)


@pytest.mark.parametrize(
    "strategy, collective", [("all_gather", "all-gather"), ("ring", "collective-permute")]
)
def test_the_strategies_communicate_as_named(strategy, collective):
    """All-gather gathers K/V (no permutes); the ring passes them on in a loop of 4 steps for 4
    devices, and its training step on 2 devices is two loops (forward and backward rings), not
    unrolled into code where the backward would share the forward's score blocks."""
    q, k, v = _qkv()
    module = _module(strategy, True)
    with jax.set_mesh(_mesh(4)):
        hlo = jax.jit(lambda q, k, v: module.apply({}, q, k, v)).lower(q, k, v).compile().as_text()
    assert collective in hlo
    other = "collective-permute" if strategy == "all_gather" else "all-gather"
    assert other not in hlo
    if strategy == "ring":  # k, v and their positions and ids, in the loop of 4 steps
        assert hlo.count("collective-permute-start(") + hlo.count("collective-permute(") == 4
        assert hlo.count("while(") == 1
        # Load balanced causal blocks are all partly attended: none is tested for skipping;
        # without balancing each block is skipped where unattended.
        assert "conditional(" not in hlo
        plain = _module(strategy, False)
        with jax.set_mesh(_mesh(4)):
            lowered = jax.jit(lambda q, k, v: plain.apply({}, q, k, v)).lower(q, k, v)
        assert lowered.compile().as_text().count("conditional(") == 1  # in the loop

        def loss(q, k, v):
            return jnp.sum(module.apply({}, q, k, v))

        with jax.set_mesh(_mesh(2)):
            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        assert step.as_text().count("while(") == 2


def test_bf16_all_gather_gradients_are_summed_in_float32():
    """The key/value gradients' reduce-scatter runs in float32 (a bf16 one does not even
    compile on the CPU): bf16 gradients within bf16 rounding of one device's."""
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv())
    module = _module("all_gather", True)

    def grads(cp_size):
        def loss(k, v):
            k, v = (reorder_causal_load_balancing(t, SWAP, cp_size, 1) for t in (k, v))
            out = module.apply({}, reorder_causal_load_balancing(q, SWAP, cp_size, 1), k, v)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(k, v)

    expected = grads(1)
    with jax.set_mesh(_mesh(2)):
        got = grads(2)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == jnp.bfloat16
        assert _relative(ours.astype(jnp.float32), theirs.astype(jnp.float32)) < 1e-2


def test_a_context_axis_of_size_one_changes_nothing():
    q, k, v = _qkv()
    module = _module("ring", True)
    expected = module.apply({}, q, k, v)
    with jax.set_mesh(_mesh(1)):
        hlo = jax.jit(lambda q, k, v: module.apply({}, q, k, v)).lower(q, k, v)
        np.testing.assert_allclose(hlo.compile()(q, k, v), expected, rtol=1e-6, atol=1e-6)
    assert "collective-permute" not in hlo.as_text()


def test_transformer_layer_under_the_cp_rule_set_equals_one_device():
    """The cp rule set shards the activations' sequence over the context axis."""
    layer = te_nn.TransformerLayer(
        hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
        attention_dropout=0.0, self_attn_mask_type="causal",
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, 16))
    params = jax.jit(layer.init)(jax.random.key(3), x)
    expected = jax.jit(layer.apply)(params, x)
    rules = load_axis_rules("cp")
    assert dict(rules)["length"] == "context"
    with jax.set_mesh(_mesh(4)), nn.logical_axis_rules(rules):
        out = jax.jit(layer.apply)(params, x)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_context_parallel_inputs_are_refused_with_the_fix():
    q, k, v = _qkv()
    with jax.set_mesh(_mesh(4)):
        with pytest.raises(ValueError, match=r"divisible by 2 x cp_size = 8; got cp_size=4"):
            _module("ring", True).apply({}, q[:, :28], k[:, :28], v[:, :28])
        with pytest.raises(ValueError, match=r"got a bias: drop them"):
            _module("ring", True).apply({}, q, k, v, bias=jnp.zeros((1, HEADS, SEQ, SEQ)))
    with pytest.raises(ValueError, match=r"context_parallel_strategy must be one of"):
        _module("ulysses", True).apply({}, q, k, v)


def test_example_lm_flag_runs_its_attention_across_the_context_axis():
    """rules=cp mesh.context=4 model.context_parallel=ring: the example GPT's mesh gets a
    context axis, its attention passes K/V round it, and its logits are one device's."""
    from examples.lm.config import DEFAULT_CONFIG, load_config
    from examples.lm.model_linen import GPT
    from examples.lm.train import _mesh
    from tests.helpers import TINY_LM

    flags = ["rules=cp", "mesh.data=2", "mesh.context=4", "model.context_parallel=ring"]
    config = load_config(DEFAULT_CONFIG, [*TINY_LM, "model.layers=1", *flags])
    mesh = _mesh(config)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "context": 4}
    model = GPT(config.model)
    tokens = jax.random.randint(jax.random.key(5), (2, config.train.seq_len), 0, 256)
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(6), tokens))
    expected = jax.jit(model.apply)(variables, tokens)
    with jax.set_mesh(mesh), nn.logical_axis_rules(load_axis_rules(config.rules)):
        compiled = jax.jit(model.apply).lower(variables, tokens).compile()
        logits = compiled(variables, tokens)
    assert "collective-permute" in compiled.as_text()
    assert _relative(logits, expected) < 1e-2  # bf16 activations


@pytest.mark.parametrize(
    "strategy, balanced, packed",
    [("all_gather", True, False), ("ring", True, True), ("ring", False, False)],
    ids=["all-gather-balanced", "ring-balanced-packed", "ring"],
)
def test_context_parallel_on_explicit_axes_equals_one_device(strategy, balanced, packed):
    """JAX's default mesh (``jax.make_mesh``: ``Explicit`` axes), the batch placed on ``data``:
    the inputs are resharded for the context axis at the ``shard_map`` and the reorder keeps
    their sharding."""
    module = _module(strategy, balanced)
    expected = _loss_and_grads(module, 1, False, packed)
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    with jax.set_mesh(mesh):
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        qkv = jax.device_put(_qkv(), placed)
        got = _loss_and_grads(module, 4, balanced, packed, qkv)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert _relative(ours, theirs) <= 1e-5
