"""The experts' activation gradient quantized in one pass (``activation_grad_rows``): the kernel
against its XLA stage in Mosaic GPU's interpret mode, the grouped op that takes the activation
in, where it does, and ``MoEBlock``'s FP8 step through it against the step without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.grouped import activation_grad_by_xla
from te_flax._ops.grouped_activation import activation_grad_quantized, fuses
from te_flax._ops.kernels import kernel_checks, pallas_kernels
from te_flax._ops.kernels.activation_grad_rows_mosaic import activation_grad_rows
from te_flax.dense import grouped_dense_activated, grouped_quantizer_set
from te_flax.linen import MoEBlock
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, QuantizerFactory
from tests.helpers import USERS_OPTIMIZATION

interpreted = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="Mosaic GPU's interpret mode needs jax 0.11 or newer"
)
E4M3, E5M2, BF16, F16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16
GATED, SINGLE = ("silu", "linear"), ("gelu",)


def _operands(rows, intermediate, activation_type, dtype, sizes, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    width = len(activation_type) * intermediate
    pre = (2 * jax.random.normal(keys[0], (rows, width))).astype(dtype)
    grad = (50 * jax.random.normal(keys[1], (rows, intermediate))).astype(dtype)
    scale_inv = jnp.array([2.0**-7, 0.5, 2.0**-4, 1.0][: len(sizes)], jnp.float32)
    return pre, grad, jnp.array(sizes, jnp.int32), scale_inv


def _both(operands, activation_type, q_dtype):
    """The kernel (interpret mode) and its XLA stage, each compiled as a user's program is (the
    test run's lower optimization level computes tanh differently)."""
    options = {"compiler_options": USERS_OPTIMIZATION}

    def kernel(*operands):
        return activation_grad_rows(*operands, activation_type, q_dtype, interpret=True)

    def xla(*operands):
        return activation_grad_by_xla(*operands, activation_type, q_dtype)

    return jax.jit(kernel, **options)(*operands), jax.jit(xla, **options)(*operands)


def _assert_same(actual, expected):
    """The float8 data bit for bit, the amax exactly (NaN where NaN)."""
    (data, amax), (want_data, want_amax) = actual, expected
    assert data.dtype == want_data.dtype
    np.testing.assert_array_equal(
        np.asarray(data).view(np.uint8), np.asarray(want_data).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(want_amax))


@interpreted
@pytest.mark.parametrize(
    "sizes",
    [(70, 0, 150), (256, 0, 0), (64, 64, 100), (10, 20, 30, 40)],
    ids=["empty group, rows past", "one group", "tile edges", "four in one tile"],
)
@pytest.mark.parametrize(
    ("activation_type", "dtype", "q_dtype"),
    [(GATED, BF16, E5M2), (GATED, F16, E4M3), (SINGLE, BF16, E5M2)],
    ids=["silu-linear bf16 e5m2", "silu-linear f16 e4m3", "gelu bf16 e5m2"],
)
def test_the_kernel_is_its_xla_stage(sizes, activation_type, dtype, q_dtype):
    """Each group's rows quantized with its scale (those past the groups with 1, out of every
    amax), a row tile shared by several groups, an empty group: the XLA stage's bits."""
    _assert_same(
        *_both(_operands(256, 128, activation_type, dtype, sizes), activation_type, q_dtype)
    )


@interpreted
def test_a_nan_reaches_its_groups_amax_and_data():
    pre, grad, sizes, scale_inv = _operands(128, 64, GATED, BF16, (40, 60))
    grad = grad.at[50, 3].set(jnp.nan)  # a row of group 1
    (data, amax), expected = _both((pre, grad, sizes, scale_inv), GATED, E5M2)
    assert np.isnan(amax[1]) and not np.isnan(amax[0])
    assert np.isnan(np.asarray(data[50].astype(jnp.float32))).any()
    _assert_same((data, amax), expected)


@interpreted
def test_the_first_use_check_of_the_kernel_agrees():
    """The configuration's probe (three groups, one empty, rows past them) passes its check:
    the stage runs the kernel, not the XLA stage it would fall back to."""
    operands = _operands(128, 64, GATED, BF16, (40, 60))
    with pallas_kernels("1"), kernel_checks("1"):
        result = activation_grad_quantized(operands, GATED, E5M2, activation_grad_by_xla)
    _assert_same(result, activation_grad_by_xla(*operands, GATED, E5M2))


def _delayed_set(groups, **recipe):
    recipe = DelayedScaling(**recipe)
    return grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), groups)


def test_where_the_op_takes_the_activation_in():
    x = jnp.zeros((128, 64), BF16)
    dgrad = _delayed_set(4).dgrad.quantizer
    with pallas_kernels("auto"):  # a CPU process: the activation stays apart
        assert not fuses(x, 128, GATED, None, dgrad)
    with pallas_kernels("1"):
        assert fuses(x, 128, GATED, None, dgrad) == mosaic_gpu_interpreted()
        assert not fuses(x, 128, GATED, None, None)  # no FP8
        assert not fuses(x.astype(jnp.float32), 128, GATED, None, dgrad)  # float32 rows
        assert not fuses(x[:100], 128, GATED, None, dgrad)  # rows not whole tiles
        assert not fuses(x, 192, GATED, None, dgrad)  # F = 96
        assert not fuses(x, 128, ("relu", "linear"), None, dgrad)  # not a kernel activation
        current = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling()).dgrad
        assert not fuses(x, 128, GATED, None, current)


def _moe_step():
    """Two FP8 training steps of a dropless MoEBlock under ``pallas_kernels("1")`` (the FP8
    state of the first's gradient given to the second, whose scales its amaxes set): the
    second's loss and gradients, and its program."""
    layer = MoEBlock(
        num_experts=4, num_experts_per_tok=2, intermediate_dim=64, recipe=DelayedScaling()
    )
    x = jax.random.normal(jax.random.key(1), (64, 64)).astype(BF16)
    variables = layer.init(jax.random.key(0), x)

    def loss(variables, x):
        out, aux = layer.apply(variables, x)
        return jnp.sum(jnp.square(out.astype(jnp.float32))) + aux

    with pallas_kernels("1"):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        _, (grads, _) = step(variables, x)
        variables = {**variables, "_overwrite_with_gradient": grads["_overwrite_with_gradient"]}
        return step(variables, x), str(jax.make_jaxpr(step)(variables, x))


@interpreted
def test_moe_blocks_fp8_step_through_the_kernel_is_the_step_without_it(monkeypatch):
    """MoEBlock's dropless FP8 step with every kernel in interpret mode: with the activation
    inside the first expert GEMM's op (its gradient quantized by the kernel) and with the
    activation apart (XLA's backward, then the grouped stage's quantization), the same loss,
    gradients and new FP8 state, bit for bit."""
    import te_flax.dense

    (loss, grads), program = _moe_step()
    monkeypatch.setattr(te_flax.dense, "fuses", lambda *args: False)
    (want_loss, want_grads), want_program = _moe_step()
    assert "te_flax_activation_grad_rows" in program
    assert "te_flax_activation_grad_rows" not in want_program
    assert float(loss) == float(want_loss)
    for (path, actual), want in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_array_equal(actual, want, err_msg=jax.tree_util.keystr(path))


def test_grouped_dense_activated_without_fp8_is_the_two_ops():
    """Where the op does not take the activation in (here no FP8), the result is the grouped
    GEMM followed by the activation, as MoEBlock computed it before."""
    from te_flax._ops.activations import rounded_once_activation
    from te_flax.dense import grouped_dense

    x = jax.random.normal(jax.random.key(0), (96, 64)).astype(BF16)
    kernel = jax.random.normal(jax.random.key(1), (3, 64, 2 * 32)) * 0.1
    sizes = jnp.array([30, 0, 50], jnp.int32)
    out = grouped_dense_activated(x, kernel, sizes, GATED)
    pre = grouped_dense(x, kernel, sizes).reshape(96, 2, 32)
    np.testing.assert_array_equal(out, rounded_once_activation(pre, GATED))
