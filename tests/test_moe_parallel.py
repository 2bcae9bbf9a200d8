"""Expert parallelism on the 8 CPU devices equals one device: outputs, gradients, FP8 state;
the tokens crossing the dispatch all-to-all in float8 under an FP8 recipe; the expert kernels
sharded by FSDP, alone and with expert parallelism, on Auto and Explicit mesh axes."""

from __future__ import annotations

import contextlib
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import te_flax.linen as te_nn
from te_flax._tools.hlo import element_bytes, parse_collectives
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from te_flax.sharding import load_axis_rules, use_sharding
from te_flax.training import OVERWRITE_WITH_GRADIENT, merge_fp8_state
from te_flax.training import value_and_grad as linen_value_and_grad
from tests.helpers import normal, relative_error

HIDDEN, EXPERTS = 16, 8
X = normal(jax.random.key(1), (8, 6, HIDDEN))  # the batch splits 8 ways


def _layer(**attributes):
    return te_nn.MoEBlock(
        num_experts=EXPERTS, num_experts_per_tok=2, intermediate_dim=24, aux_loss_coeff=0.01,
        **attributes,
    )  # fmt: skip


def _step(layer):
    def loss(variables, x):
        out, aux_loss = layer.apply(merge_fp8_state(variables), x)
        return jnp.sum(jnp.sin(out)) + aux_loss, (out, aux_loss)

    @jax.jit
    def step(variables, x):
        (_, (out, aux_loss)), grads = linen_value_and_grad(loss, has_aux=True)(variables, x)
        return out, aux_loss, grads

    return step


def _input_step(layer):
    """The step with the input's gradient too: the dispatch's backward reaches the tokens."""

    def loss(variables, x):
        out, aux_loss = layer.apply(merge_fp8_state(variables), x)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))) + aux_loss, (out, aux_loss)

    @jax.jit
    def step(variables, x):
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, (out, aux_loss)), grads = grad(variables, x)
        return out, aux_loss, grads

    return step


def _shardings(variables, mesh):
    """The shardings the boxed ``variables``' logical axes give under the active rules."""
    specs = nn.get_partition_spec(variables)
    return nn.logical_to_mesh_sharding(specs, mesh, nn.get_logical_axis_rules())


def _sharded(variables, values, mesh):
    """``values`` placed as the boxed ``variables``' logical axes say under the active rules."""
    return jax.device_put(values, _shardings(variables, mesh))


def _compare(single, sharded, tolerance):
    for path, expected in jax.tree_util.tree_flatten_with_path(single)[0]:
        actual = dict(jax.tree_util.tree_flatten_with_path(sharded)[0])[path]
        name = jax.tree_util.keystr(path)
        if not np.any(np.asarray(expected)):
            np.testing.assert_array_equal(actual, expected, err_msg=name)
        else:
            assert relative_error(actual, expected) <= tolerance, name


@functools.cache
def _one_device(fp8=False):
    """The layer (delayed scaling or no FP8), its variables and its step on one device: shared
    by the cases that compare a sharded step with it, so that it is compiled and run once."""
    layer = _layer(recipe=DelayedScaling(amax_history_len=4)) if fp8 else _layer()
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    values = nn.meta.unbox(variables)
    return layer, variables, values, _step(layer)(values, X)


# 8 ways (and 4 x 2 with FP8 below) in the quick suite; 2 and 4 ways among the slow tests.
@pytest.mark.parametrize("ways", [pytest.param(w, marks=pytest.mark.slow) for w in (2, 4)] + [8])
def test_expert_parallel_equals_one_device(ways):
    layer, variables, values, single = _one_device()
    with use_sharding("ep", {"data": ways, "fsdp": 8 // ways}) as mesh:
        placed = _sharded(variables, values, mesh)
        step = _step(layer)  # one function: lowered from the call's trace, not traced again
        sharded = step(placed, X)
        hlo = step.lower(placed, X).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo
    _compare(single, sharded, 1e-6)


def test_expert_parallel_fp8_state_and_capacity_equal_one_device():
    layer = _layer(recipe=DelayedScaling(amax_history_len=4), capacity_factor=1.0)
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    values = nn.meta.unbox(variables)
    single = _step(layer)(values, X)
    with use_sharding("ep", {"data": 4, "fsdp": 2}) as mesh:
        sharded = _step(layer)(_sharded(variables, values, mesh), X)
    new_state = sharded[2][OVERWRITE_WITH_GRADIENT]
    assert new_state["x_0_amax_history"].shape == (EXPERTS, 4)
    # Per-expert amaxes over each expert's own rows (the last bits of the output gradient's
    # amax can differ: its float32 sums run in another order).
    _compare(single[2][OVERWRITE_WITH_GRADIENT], new_state, 1e-6)
    _compare(single, sharded, 1e-5)


# FP8 on the dispatch wire. Each recipe whose first expert GEMM scales row by row before any
# reduction over rows (per-tensor recipes: each expert's scale; MXFP8 and blockwise FP8: their
# own row blocks) gets back the wire's float8 values bit for bit, so the step is one device's
# to float32 rounding; its gradients flow back through the dispatch (a pre-norm and the input).
WIRE_RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "blockwise": Float8BlockScaling(),
}
WIRE_X = normal(jax.random.key(2), (8, 32, 128))  # blockwise FP8: rows in 128s on every device
QUICK_WIRE = {("delayed", 8), ("mxfp8", 4)}


def _wire_layer(recipe, **attributes):
    return te_nn.MoEBlock(
        num_experts=EXPERTS, num_experts_per_tok=2, intermediate_dim=128, aux_loss_coeff=0.01,
        enable_layernorm=True, recipe=WIRE_RECIPES[recipe], **attributes,
    )  # fmt: skip


def _wire_cases():
    for recipe in WIRE_RECIPES:
        for ways in (2, 4, 8):
            slow = () if (recipe, ways) in QUICK_WIRE else (pytest.mark.slow,)
            yield pytest.param(recipe, ways, id=f"{recipe}-{ways}", marks=slow)


def _dispatch(hlo_text, gradient=False):
    """The dispatch's all-to-alls of a compiled step (the forward's, or its transpose's)."""
    return [
        c
        for c in parse_collectives(hlo_text)
        if c.kind == "all-to-all"
        and "/dispatch/" in c.op_name
        and ("transpose(" in c.op_name) == gradient
    ]


@functools.cache
def _wire_one_device(recipe):
    """The layer, its variables and its step on one device, shared by the recipe's cases."""
    layer = _wire_layer(recipe)
    variables = jax.jit(layer.init)(jax.random.key(0), WIRE_X)
    values = nn.meta.unbox(variables)
    return layer, variables, values, _input_step(layer)(values, WIRE_X)


@pytest.mark.parametrize(("recipe", "ways"), list(_wire_cases()))
def test_fp8_wire_equals_one_device(recipe, ways):
    layer, variables, values, single = _wire_one_device(recipe)
    with use_sharding("ep", {"data": ways, "fsdp": 8 // ways}) as mesh:
        placed = _sharded(variables, values, mesh)
        step = _input_step(layer).lower(placed, WIRE_X).compile()  # compiled once: run, read
        sharded = step(placed, WIRE_X)
    hlo_text = step.as_text()
    # The rows crossed as float8 bytes; their gradient comes back in the compute dtype.
    assert {t for c in _dispatch(hlo_text) for t, _ in c.operands} >= {"u8"}
    assert {t for c in _dispatch(hlo_text, gradient=True) for t, _ in c.operands} == {"f32"}
    _compare(single, sharded, 1e-5)


def test_fp8_wire_keeps_the_amax_of_values_past_the_delayed_scale():
    """A delayed scale far too small for the tokens: the wire clips them as one device's GEMM
    does, and each block's exact amax travels with them, so the new amax history (and the
    scale that grows from it) is one device's, not the clipped value's."""
    layer, variables, values, _ = _wire_one_device("delayed")
    state = dict(values[OVERWRITE_WITH_GRADIENT])
    state["x_0_scale_inv"] = jnp.full_like(state["x_0_scale_inv"], 1e-4)  # clips |x| > 0.0448
    values = {**values, OVERWRITE_WITH_GRADIENT: state}
    single = _input_step(layer)(values, WIRE_X)
    with use_sharding("ep", {"data": 4, "fsdp": 2}) as mesh:
        sharded = _input_step(layer)(_sharded(variables, values, mesh), WIRE_X)
    new_state = sharded[2][0][OVERWRITE_WITH_GRADIENT]
    assert float(jnp.min(new_state["x_0_amax_history"][:, 0])) > 1.0  # the true amaxes
    _compare(single, sharded, 1e-5)


def _dispatch_bytes(recipe, fp8_dispatch=True):
    """The dispatch's bytes of a bfloat16 step at 4-way EP, as compiled for the CPU."""
    layer = te_nn.MoEBlock(
        num_experts=EXPERTS, num_experts_per_tok=2, intermediate_dim=128, dtype=jnp.bfloat16,
        recipe=recipe, fp8_dispatch=fp8_dispatch,
    )  # fmt: skip
    x = WIRE_X.astype(jnp.bfloat16)
    # Compiled, never run: the variables' shapes and shardings are all the compile takes.
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    values = nn.meta.unbox(variables)
    with use_sharding("ep", {"data": 4, "fsdp": 2}) as mesh:
        placed = jax.tree.map(
            lambda v, sharding: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding),
            values,
            _shardings(variables, mesh),
        )
        hlo_text = _input_step(layer).lower(placed, x).compile().as_text()
    collectives = _dispatch(hlo_text)
    # XLA:CPU widens a bfloat16 collective to float32 (a GPU keeps it 2 bytes, as the deviceless
    # H100 compile in tests/test_gpu_compile_moe_wire.py shows): floats count as bfloat16.
    return sum(
        math.prod(dims) * (2 if element.startswith("f") else element_bytes(element))
        for c in collectives
        for element, dims in c.operands
    )


def test_fp8_wire_moves_half_the_dispatch_bytes():
    bf16 = _dispatch_bytes(None)
    fp8 = _dispatch_bytes(DelayedScaling())
    # 128 float8 bytes and one bfloat16 amax per row of 128, and the row's int32 expert id,
    # against 256 + 4 bytes.
    assert fp8 / bf16 == pytest.approx((128 + 2 + 4) / (256 + 4))
    assert fp8 <= 0.55 * bf16
    # The opt-out sends the compute dtype, as without FP8.
    assert _dispatch_bytes(DelayedScaling(), fp8_dispatch=False) == bf16


def test_experts_not_dividing_the_expert_axis_are_refused():
    layer = te_nn.MoEBlock(num_experts=6, intermediate_dim=8)
    expected = "num_experts \\(6\\) must be divisible by the expert"
    with use_sharding("ep", {"data": 4, "fsdp": 2}), pytest.raises(ValueError, match=expected):
        layer.init(jax.random.key(0), X)


# FSDP of the expert kernels: wi_kernel's and wo_kernel's "embed" axis over the fsdp mesh
# axis, alone (configs/rules/fsdp.yaml: the experts replicated over the mesh) and with expert
# parallelism (ep.yaml: the experts over data), on Auto axes (te_flax.sharding.use_sharding) and
# on JAX's default Explicit axes (jax.make_mesh, jax.set_mesh and the same rules).
FSDP_MESHES = {"fsdp": {"data": 2, "fsdp": 4}, "ep": {"data": 4, "fsdp": 2}}
FSDP_KERNELS = {  # the stored shardings the rules give the kernels
    "fsdp": {"wi_kernel": P(None, "fsdp", None, None), "wo_kernel": P(None, None, "fsdp")},
    "ep": {"wi_kernel": P("data", "fsdp", None, None), "wo_kernel": P("data", None, "fsdp")},
}


@contextlib.contextmanager
def _mesh(rules, style):
    shape = FSDP_MESHES[rules]
    if style == "auto":
        with use_sharding(rules, shape) as mesh:
            yield mesh
        return
    mesh = jax.make_mesh(tuple(shape.values()), tuple(shape))
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}  # JAX's default
    with jax.set_mesh(mesh), nn.logical_axis_rules(load_axis_rules(rules)):
        yield mesh


def _fsdp_cases():
    for rules in FSDP_MESHES:
        for style in ("auto", "explicit"):
            yield pytest.param(rules, style, "fp8", id=f"{rules}-{style}-fp8")
    yield pytest.param("ep", "explicit", "bf16", id="ep-explicit-bf16")


@pytest.mark.parametrize(("rules", "style", "recipe"), list(_fsdp_cases()))
def test_fsdp_of_the_expert_kernels_equals_one_device(rules, style, recipe):
    """The kernels stay stored sharded, the step gathers their shards for the experts' GEMMs
    (an all-gather over fsdp), and the outputs, gradients and new FP8 state are one device's;
    every gradient comes back with its parameter's sharding (on Explicit axes, its type)."""
    fp8 = recipe == "fp8"
    layer, variables, values, single = _one_device(fp8)
    with _mesh(rules, style) as mesh:
        placed = _sharded(variables, values, mesh)
        x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))))
        step = _step(layer).lower(placed, x).compile()  # compiled once: run, read
        sharded = step(placed, x)
    hlo_text = step.as_text()
    for name, spec in FSDP_KERNELS[rules].items():
        kernel = placed["params"][name]
        assert kernel.sharding.spec == spec, name
        shard = kernel.sharding.shard_shape(kernel.shape)
        gathered = [
            c
            for c in parse_collectives(hlo_text)
            if c.kind == "all-gather" and any(dims == shard for _, dims in c.operands)
        ]
        assert gathered, f"no all-gather of the {name} shard {shard}"
    for path, grad in jax.tree_util.tree_flatten_with_path(sharded[2]["params"])[0]:
        param = dict(jax.tree_util.tree_flatten_with_path(placed["params"])[0])[path]
        same = grad.sharding.is_equivalent_to(param.sharding, param.ndim)
        assert same, (jax.tree_util.keystr(path), grad.sharding.spec, param.sharding.spec)
    if fp8:  # each expert's amax over its own rows, as on one device
        _compare(single[2][OVERWRITE_WITH_GRADIENT], sharded[2][OVERWRITE_WITH_GRADIENT], 1e-6)
    _compare(single, sharded, 1e-5)
