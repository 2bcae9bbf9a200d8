"""FP8 for Flax's own layers by one argument: make_dot_general_cls (Linen), DotGeneral and
EinsumOp (NNX), wrap_function_in_te_state_module, make_grouped_dense_cls,
extend_logical_axis_rules, and the product planning behind them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax import training
from te_flax._quantize_model.products import fp8_reason, plan_product, run_plan
from te_flax.dense import dense, grouped_dense, grouped_quantizer_set
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    QuantizerFactory,
    noop_quantizer_set,
)
from tests.helpers import FP8_FORWARD_TOLERANCE

RECIPE = DelayedScaling(amax_history_len=4)
OWG = "_overwrite_with_gradient"


def _inputs(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _relative(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _two_steps(loss, variables, x):
    """Two steps of the FP8 state update rule (parameters fixed): the states and grads."""
    step = jax.jit(training.value_and_grad(loss))
    _, grads = step(variables, x)
    second = {**variables, OWG: grads[OWG]}
    _, grads2 = step(second, 2 * x)
    return grads, grads2


def test_linen_dense_general_with_dot_general_cls_equals_te_dense_general():
    x = _inputs((4, 8, 32))
    stock = nn.DenseGeneral(16, use_bias=False, dot_general_cls=te_nn.make_dot_general_cls(RECIPE))
    te_layer = te_nn.DenseGeneral(16, use_bias=False, recipe=RECIPE)
    stock_vars = jax.jit(stock.init)(jax.random.key(0), x)
    te_vars = jax.jit(te_layer.init)(jax.random.key(0), x)
    te_vars = {**te_vars, "params": {"kernel": stock_vars["params"]["kernel"]}}
    wrapper = stock_vars[OWG]["TEWrapper_dot_general_0"]
    assert sorted(wrapper) == sorted(te_vars[OWG])

    def loss(module):
        return lambda variables, x: jnp.sum(module.apply(variables, x) ** 2)

    stock_steps = _two_steps(loss(stock), stock_vars, x)
    te_steps = _two_steps(loss(te_layer), te_vars, x)
    np.testing.assert_array_equal(
        jax.jit(stock.apply)(stock_vars, x), jax.jit(te_layer.apply)(te_vars, x)
    )
    for stock_grads, te_grads in zip(stock_steps, te_steps, strict=True):
        np.testing.assert_array_equal(stock_grads["params"]["kernel"], te_grads["params"]["kernel"])
        for name, value in te_grads[OWG].items():
            np.testing.assert_array_equal(stock_grads[OWG]["TEWrapper_dot_general_0"][name], value)
    # The state moves: step 2's history holds both steps' amax, newest first.
    history = stock_steps[1][OWG]["TEWrapper_dot_general_0"]["x_amax_history"]
    np.testing.assert_allclose(history[:2], [2 * jnp.max(jnp.abs(x)), jnp.max(jnp.abs(x))])


def test_linen_dot_general_cls_refuses_batch_dimensions():
    layer = nn.DenseGeneral(
        16, axis=-1, batch_dims=(0,), dot_general_cls=te_nn.make_dot_general_cls(RECIPE)
    )
    with pytest.raises(ValueError, match="batch dimensions"):
        layer.init(jax.random.key(0), jnp.ones((2, 4, 32)))


def test_nnx_linear_with_dot_general_equals_linen_and_updates_state():
    x = _inputs((8, 32))
    linear = nnx.Linear(
        32, 16, use_bias=False, dot_general=te_nnx.DotGeneral(RECIPE), rngs=nnx.Rngs(0)
    )
    stock = nn.Dense(16, use_bias=False, dot_general_cls=te_nn.make_dot_general_cls(RECIPE))
    variables = jax.jit(stock.init)(jax.random.key(0), x)
    variables = {**variables, "params": {"kernel": linear.kernel[...]}}
    np.testing.assert_array_equal(
        nnx.jit(lambda m, x: m(x))(linear, x), jax.jit(stock.apply)(variables, x)
    )
    # Checkpointable state: the Fp8Meta variables of the dot_general child.
    state = nnx.state(linear, te_nnx.Fp8Meta)["dot_general"]
    assert sorted(state) == sorted(variables[OWG]["TEWrapper_dot_general_0"])

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    step = nnx.jit(te_nnx.value_and_grad(loss, update_fp8_state=True))
    _, grads = step(linear, x)
    _, linen_grads = jax.jit(training.value_and_grad(lambda v, x: jnp.sum(stock.apply(v, x) ** 2)))(
        variables, x
    )
    np.testing.assert_array_equal(grads["kernel"][...], linen_grads["params"]["kernel"])
    np.testing.assert_array_equal(
        linear.dot_general.grad_amax_history[...],
        linen_grads[OWG]["TEWrapper_dot_general_0"]["grad_amax_history"],
    )
    step(linear, 3 * x)
    np.testing.assert_allclose(
        linear.dot_general.x_amax_history[...][:2], [3 * jnp.max(jnp.abs(x)), jnp.max(jnp.abs(x))]
    )


def test_nnx_einsum_with_einsum_op_runs_in_fp8():
    x = _inputs((4, 2, 32))
    layer = nnx.Einsum(
        "btd,dhk->bthk",
        (32, 2, 16),
        einsum_op=te_nnx.EinsumOp(Float8CurrentScaling()),
        rngs=nnx.Rngs(0),
    )
    reference = jnp.einsum("btd,dhk->bthk", x, layer.kernel[...])
    out = nnx.jit(lambda m, x: m(x))(layer, x)
    assert out.shape == (4, 2, 2, 16)
    error = _relative(out, reference)
    assert 0 < error < FP8_FORWARD_TOLERANCE  # quantized, not exact


def test_wrap_function_in_te_state_module_gives_postfixed_state():
    def two_gemms(generate_quantizer_set, x, first, second):
        hidden = dense(x, first, quantizer_set=generate_quantizer_set(postfix="_0"))
        return dense(hidden, second, quantizer_set=generate_quantizer_set(postfix="_1"))

    cls = te_nn.wrap_function_in_te_state_module(two_gemms, RECIPE, name="mlp")
    assert cls.__name__ == "TEWrapper_mlp"
    x, first, second = _inputs((8, 32)), _inputs((32, 16), 1), _inputs((16, 32), 2)
    variables = jax.eval_shape(cls().init, jax.random.key(0), x, first, second)
    assert {name.split("_amax")[0] for name in variables[OWG] if "amax" in name} == {
        "x_0", "kernel_0", "grad_0", "x_1", "kernel_1", "grad_1"
    }  # fmt: skip


def test_make_grouped_dense_cls_equals_grouped_dense_with_per_group_state():
    x, kernel = _inputs((32, 32)), _inputs((2, 32, 16), 1)
    sizes = jnp.array([12, 20], jnp.int32)
    grouped = te_nn.make_grouped_dense_cls(RECIPE)
    variables = jax.jit(grouped.init)(jax.random.key(0), x, kernel, sizes)
    assert variables[OWG]["x_amax_history"].shape == (2, 4)
    qs = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=RECIPE), 2)
    np.testing.assert_array_equal(
        jax.jit(grouped.apply)(variables, x, kernel, sizes),
        jax.jit(grouped_dense)(x, kernel, sizes, quantizer_set=qs),
    )


def test_extend_logical_axis_rules_adds_the_layers_names():
    rules = te_nn.extend_logical_axis_rules([("batch", "data"), ["mlp", ["fsdp", "tensor"]]])
    assert rules[:2] == (("batch", "data"), ("mlp", ("fsdp", "tensor")))
    assert ("embed", None) in rules and ("heads", None) in rules
    assert len({name for name, _ in rules}) == len(rules)
    with pytest.raises(ValueError, match="pair"):
        te_nn.extend_logical_axis_rules([("batch",)])
    with pytest.raises(ValueError, match="mesh axis"):
        te_nn.extend_logical_axis_rules([("batch", 3)])


@pytest.mark.parametrize(
    ("op", "spec", "lhs_shape", "rhs_shape"),
    [
        ("einsum", "td,edf->tef", (8, 32), (2, 32, 16)),  # experts as a free axis
        ("einsum", "bd,fd->fb", (8, 32), (16, 32)),  # transposed kernel and output
        ("einsum", "...d,df", (2, 4, 32), (32, 16)),  # ellipsis, implicit output
        ("einsum", "tef,efd->td", (8, 2, 16), (2, 16, 32)),  # two contracted axes
        ("dot_general", (((0,), (1,)), ((), ())), (32, 8), (16, 32)),
        ("dot", None, (2, 4, 32), (3, 32, 16)),
        ("matmul", None, (2, 4, 32), (32, 16)),
    ],
)
def test_planned_products_equal_jax_without_quantization(op, spec, lhs_shape, rhs_shape):
    lhs, rhs = _inputs(lhs_shape), _inputs(rhs_shape, 1)
    plan = plan_product(op, lhs, rhs, spec)
    assert not isinstance(plan, str), plan
    expected = {
        "einsum": lambda: jnp.einsum(spec, lhs, rhs),
        "dot_general": lambda: jax.lax.dot_general(lhs, rhs, spec),
        "dot": lambda: jnp.dot(lhs, rhs),
        "matmul": lambda: jnp.matmul(lhs, rhs),
    }[op]()
    np.testing.assert_allclose(
        jax.jit(lambda a, b: run_plan(plan, a, b, noop_quantizer_set))(lhs, rhs),
        expected,
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    ("op", "spec", "lhs", "rhs", "reason"),
    [
        ("einsum", "bqd,bkd->bqk", (2, 8, 32), (2, 8, 32), "batch dimensions"),
        ("einsum", "ij,jk,kl->il", (2, 2), (2, 2), "operands"),
        ("einsum", "ii,ij->j", (16, 16), (16, 16), "diagonal"),
        ("einsum", "td,df->t", (8, 32), (32, 16), "sums an axis"),
        ("dot", None, (8, 32), (32,), "vector"),
        ("einsum", "td,df->tf", (8, 24), (24, 16), "contracting size 24"),
    ],
)
def test_products_fp8_cannot_take_are_named(op, spec, lhs, rhs, reason):
    lhs_array, rhs_array = jnp.ones(lhs), jnp.ones(rhs)
    plan = plan_product(op, lhs_array, rhs_array, spec)
    assert reason in fp8_reason(plan, lhs_array, rhs_array, RECIPE)
    ints = jnp.ones((8, 32), jnp.int32)
    assert "not floating" in fp8_reason(plan_product("dot", ints, ints.T), ints, ints.T, RECIPE)
