"""A 2-layer ``nn.scan`` stack of ``TransformerLayer`` on 8 CPU devices equals the single-device
stack, under the ``dp_fsdp_tp`` and ``tp_sp`` rule sets, and its parameters are placed as the
rules say.

One jitted training step (``value_and_grad`` over the whole variable dict, FP8 state merged
with ``merge_fp8_state`` as in tests/test_multidevice.py) gives the loss, the output, every
parameter gradient and, under delayed scaling, the new FP8 state of both layers. Without FP8 the
sharded step agrees with the single-device one to float32 summation order. With FP8 the amaxes,
and so the new FP8 state, still agree that closely (under ``jit`` an amax of a sharded tensor is
global), but the values do not: the attention's float32 sums run in another order on a device's
share of the batch, and where such a last-bit difference straddles an e4m3 rounding boundary
one element of a GEMM input rounds to the neighbouring float8 value, 1/16 to 1/8 of its size
away. With the inputs below that happens to one token of 128 in the second layer (the first
layer's output is bit for bit the same): the output moves by 6.6e-4, the loss and the MLP
kernels' gradients by 1.1e-3 (normwise), while without FP8 nothing moves by 1e-6. The
FP8 values are therefore compared normwise with ``SHARDED_FP8_TOLERANCE``.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import DelayedScaling
from te_flax.sharding import load_axis_rules, make_mesh, with_logical_constraint
from te_flax.training import OVERWRITE_WITH_GRADIENT, merge_fp8_state
from tests.helpers import SHARDED_FP8_TOLERANCE, assert_close, normal, relative_error
from tests.test_multidevice import VALUE_TOLERANCE, _place, _spec

LAYERS, BATCH, SEQ, HIDDEN, HEADS, MLP = 2, 8, 16, 64, 4, 128
DELAYED = DelayedScaling(amax_history_len=4)

# name -> (mesh shape, enable_sequence_parallel). Both split the 4 heads, the 64 = 4 x 16
# projection features, the 128 MLP features and (tp_sp) the 16 positions evenly over tensor.
LAYOUTS = {
    "dp_fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, False),
    "tp_sp": ({"data": 2, "tensor": 4}, True),
}

# The parameters' PartitionSpecs the rules give (the scan's leading "layers" axis is replicated):
# the qkv kernel [layers, embed, qkv, heads] column-parallel, the out kernel [layers, heads,
# embed] and wo row-parallel, embed over fsdp where the rules shard it.
_DP_FSDP_TP_SPECS = {
    "attention/qkv/kernel": (None, "fsdp", None, "tensor"),
    "attention/qkv/scale": (None, "fsdp"),
    "attention/qkv/ln_bias": (None, "fsdp"),
    "attention/out/kernel": (None, "tensor", "fsdp"),
    "mlp/scale": (None, "fsdp"),
    "mlp/ln_bias": (None, "fsdp"),
    "mlp/wi_kernel": (None, "fsdp", None, "tensor"),
    "mlp/wo_kernel": (None, "tensor", "fsdp"),
    "relpos_bias/rel_embedding": (None, "tensor", None),
}
EXPECTED_PARAMETER_SPECS = {
    "dp_fsdp_tp": _DP_FSDP_TP_SPECS,
    # tp_sp leaves embed replicated.
    "tp_sp": {
        name: tuple(None if axis == "fsdp" else axis for axis in spec)
        for name, spec in _DP_FSDP_TP_SPECS.items()
    },
}
EXPECTED_INPUT_SPECS = {
    "dp_fsdp_tp": (("data", "fsdp"), None, None),
    "tp_sp": ("data", "tensor", None),
}
KERNELS = ("attention/qkv/kernel", "attention/out/kernel", "mlp/wi_kernel", "mlp/wo_kernel")


class _Block(nn.Module):
    """One scanned layer: carry in, carry out."""

    recipe: DelayedScaling | None
    sequence_parallel: bool

    @nn.compact
    def __call__(self, x, _):
        layer = te_nn.TransformerLayer(
            hidden_size=HIDDEN,
            mlp_hidden_size=MLP,
            num_attention_heads=HEADS,
            enable_sequence_parallel=self.sequence_parallel,
            recipe=self.recipe,
            name="layer",
        )
        return layer(x, deterministic=True), None


class _Stack(nn.Module):
    recipe: DelayedScaling | None
    sequence_parallel: bool = False

    @nn.compact
    def __call__(self, x):  # [batch, seq, hidden] -> the same
        stack = nn.scan(
            _Block,
            variable_axes={"params": 0, OVERWRITE_WITH_GRADIENT: 0},
            split_rngs={"params": True},
            length=LAYERS,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return stack(self.recipe, self.sequence_parallel, name="layers")(x, None)[0]


def _residual_axes(sequence_parallel: bool) -> tuple:
    # The layers' residual stream: [batch, seq, hidden], seq split under sequence parallelism.
    return ("batch", "length" if sequence_parallel else None, "act_embed")


def _flat(tree: dict) -> dict:
    """``{"attention/qkv/kernel": leaf, ...}`` of one stacked layer's parameter tree."""
    return {
        "/".join(key.key for key in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree["layers"]["layer"])
    }


def _run(recipe, layout: str | None):
    """One step: ``(loss, output, parameter gradients, new FP8 state, placement)``; placement
    (None on one device) holds the PartitionSpecs of x, the parameters and their gradients."""
    mesh_shape, sequence_parallel = LAYOUTS[layout] if layout else ({}, False)
    stack = _Stack(recipe, sequence_parallel)
    axes = _residual_axes(sequence_parallel)
    keys = jax.random.split(jax.random.key(1), 2)
    x = normal(keys[0], (BATCH, SEQ, HIDDEN))
    cotangent = normal(keys[1], (BATCH, SEQ, HIDDEN))

    def loss(variables, x, cotangent):
        out = stack.apply(merge_fp8_state(variables), x)
        out = with_logical_constraint(out, axes)  # laid out as the next layer's input
        return jnp.sum(out * cotangent), out

    def step(variables, x, cotangent):
        (value, out), grads = jax.value_and_grad(loss, has_aux=True)(variables, x, cotangent)
        return value, out, grads["params"], grads.get(OVERWRITE_WITH_GRADIENT, {})

    context = contextlib.nullcontext()
    mesh = rules = None
    if layout is not None:
        mesh, rules = make_mesh(mesh_shape), load_axis_rules(layout)
        context = contextlib.ExitStack()
        context.enter_context(jax.set_mesh(mesh))
        context.enter_context(nn.logical_axis_rules(rules))
    with context:
        if mesh is None:
            variables = nn.meta.unbox(jax.jit(stack.init)(jax.random.key(0), x))
        else:
            x, cotangent = (_place(a, axes, mesh, rules) for a in (x, cotangent))
            abstract = jax.eval_shape(stack.init, jax.random.key(0), x)
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
            init = jax.jit(stack.init, out_shardings=shardings)
            variables = nn.meta.unbox(init(jax.random.key(0), x))
        value, out, grads, fp8 = jax.jit(step)(variables, x, cotangent)
    placement = None
    if mesh is not None:
        placement = {
            "x": _spec(x),
            "params": {name: _spec(p) for name, p in _flat(variables["params"]).items()},
            "grads": {name: _spec(g) for name, g in _flat(grads).items()},
        }
    as_numpy = lambda tree: jax.tree.map(np.asarray, _flat(tree) if tree else {})  # noqa: E731
    return float(value), np.asarray(out), as_numpy(grads), as_numpy(fp8), placement


_SINGLE_DEVICE: dict = {}


def _single_device(recipe):
    # Without rules and mesh the constraints do nothing: the sequence-parallel stack computes
    # the same as the other, so one single-device run serves both layouts.
    key = recipe is not None
    if key not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[key] = _run(recipe, None)[:4]
    return _SINGLE_DEVICE[key]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "nofp8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scanned_transformer_stack_step_on_a_mesh_equals_the_single_device_step(layout, fp8):
    recipe = DELAYED if fp8 else None
    expected_loss, expected_out, expected_grads, expected_fp8 = _single_device(recipe)
    loss, out, grads, new_fp8, placement = _run(recipe, layout)

    assert placement["x"] == EXPECTED_INPUT_SPECS[layout]
    assert placement["params"] == EXPECTED_PARAMETER_SPECS[layout]
    for name in KERNELS:  # the ops constrain a kernel's gradient with the kernel's axes
        assert placement["grads"][name] == placement["params"][name], name

    assert sorted(grads) == sorted(expected_grads)
    assert sorted(new_fp8) == sorted(expected_fp8)
    assert bool(new_fp8) == fp8
    for name, state in new_fp8.items():
        # Each layer has its own state, and the step recorded an amax (the newest entry) in it.
        assert state.shape[0] == LAYERS and np.all(state[:, 0] > 0), name
        np.testing.assert_allclose(state, expected_fp8[name], rtol=1e-6, err_msg=name)
    if not fp8:
        assert_close(loss, expected_loss, VALUE_TOLERANCE, "loss")
        assert_close(out, expected_out, VALUE_TOLERANCE, "output")
        for name, grad in grads.items():
            assert_close(grad, expected_grads[name], VALUE_TOLERANCE, f"d {name}")
        return
    errors = {"loss": abs(loss - expected_loss) / abs(expected_loss)}
    errors["output"] = relative_error(out, expected_out)
    errors.update({f"d {n}": relative_error(g, expected_grads[n]) for n, g in grads.items()})
    too_large = {what: error for what, error in errors.items() if error > SHARDED_FP8_TOLERANCE}
    assert not too_large, f"normwise errors above {SHARDED_FP8_TOLERANCE}: {too_large}"


def test_nnx_transformer_layer_shards_on_every_shipped_rule_set():
    # NNX keeps a logical name no rule mentions as a mesh axis name; the rule sets replicate
    # every name of te_flax's layers explicitly, the relative position table's buckets too.
    layer = te_nnx.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS, rngs=nnx.Rngs(0)
    )
    params = nnx.state(layer, nnx.Param)
    mesh = make_mesh(LAYOUTS["dp_fsdp_tp"][0])
    for rule_set in ("dp", "fsdp", "tp", "tp_sp", "dp_fsdp_tp"):
        rules = load_axis_rules(rule_set)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            shardings = nnx.to_pure_dict(nnx.get_named_sharding(params, mesh))
        table = tuple(shardings["relpos_bias"]["rel_embedding"].spec)
        assert table == (("tensor", None) if "tp" in rule_set else (None, None)), rule_set
        # The same specs as Linen's for the same logical axes.
        kernel = shardings["attention"]["qkv"]["kernel"].spec
        assert kernel == nn.logical_to_mesh_axes(("embed", "qkv", "heads"), rules), rule_set
