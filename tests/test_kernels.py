"""The Pallas kernels in interpret mode against the XLA stages they replace, and the switch.

Bit-exact for float8 data, scales and amax histories; within 1e-6 (relative to the RMS) for
float32 outputs. Shapes include rows and hidden sizes that are not multiples of the blocks
(partial blocks are masked). Each case traces a new function: ``jit`` caches by function, and
the switch is read when a function is traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._ops import gemm as _gemm
from te_flax._ops import gemm_operands as _operands
from te_flax._ops import mlp as _mlp
from te_flax._ops import norm as _norm
from te_flax._ops.kernels import ENV_VAR, mode, pallas_kernels, traced_in_scan
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    LEADING,
    TRAILING,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    QuantizerFactory,
)
from tests.helpers import USERS_OPTIMIZATION, normal

# (shape of x, dtype): whole blocks, then partial row blocks and a hidden size padded to 128.
SHAPES = [((4, 16, 128), jnp.float32), ((3, 5, 100), jnp.bfloat16), ((37, 96), jnp.float32)]
NORMS = [("layernorm", False), ("rmsnorm", True)]
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


def _bits(value) -> np.ndarray:
    """An array's raw bits, so that float8 data compares bit for bit (NaN included)."""
    value = np.asarray(value)
    return value.view(f"u{value.dtype.itemsize}") if value.dtype.itemsize else value


def assert_same_bits(actual, expected) -> None:
    for path_value, other in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True
    ):
        path, value = path_value
        assert value.dtype == other.dtype and value.shape == other.shape, path
        np.testing.assert_array_equal(_bits(value), _bits(other), jax.tree_util.keystr(path))


def both(function, *args):
    """``function(*args)`` jitted with the kernels off and on (interpret mode on a CPU), both
    compiled at XLA's default optimization level: the comparisons are bit for bit."""
    results = []
    for switch in ("0", "1"):
        with pallas_kernels(switch):
            jitted = jax.jit(lambda *a: function(*a), compiler_options=USERS_OPTIMIZATION)
            results.append(jitted(*args))
    return results


def _inputs(shape, dtype, norm_type, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    # A large mean against the spread, as the one-pass statistics must handle.
    x = (normal(keys[0], shape) * 3.0 + 2.0).astype(dtype)
    gamma = normal(keys[1], shape[-1:])
    beta = normal(keys[2], shape[-1:]) if norm_type == "layernorm" else None
    return x, gamma, beta


def _quantizer(recipe: str, fp8_format: Format = Format.HYBRID):
    factory_recipe = RECIPES[recipe]
    quantizers = QuantizerFactory.create_set(
        fp8_recipe=type(factory_recipe)(fp8_format=fp8_format)
        if recipe == "current"
        else DelayedScaling(fp8_format=fp8_format, amax_history_len=4)
    )
    quantizer = quantizers.x
    if recipe == "delayed":  # a scale other than 1, from a previous step's amax
        quantizer = quantizer.update(jnp.float32(5.0))
    return quantizer


def assert_f32_close(actual, expected) -> None:
    """Equal dtypes and shapes; values within 1e-6 of the expected RMS (float32 sum order)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        scale = float(np.sqrt(np.mean(np.square(e)))) or 1.0
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-6 * scale)


def assert_step_close(
    actual, expected, norm_gradients: tuple[int, ...], summed: tuple[str, ...] = ()
) -> None:
    """A training step with every kernel against the XLA stages: float8 data, scales, the FP8
    state and every gradient the norm backward does not touch bit for bit; the gradients of
    x, gamma and beta (the norm backward's, at ``norm_gradients`` in the gradient tuple)
    within 1e-3 normwise in float32 and 2**-8 in bfloat16.

    Not closer: XLA:CPU's own norm backward is off by up to 5e-4 of the RMS against a float64
    reference in the current-scaling step (measured: dgamma 3.5e-5 off at a 0.065 maximum),
    where the kernel is within 1e-7 (and its bfloat16 dx 1.7e-3 normwise from float64, XLA's
    2.5e-3); the kernel-level tests compare at 1e-6 where XLA is exact. Float32 sums that a
    kernel adds in another order (a bias gradient: the gradients at the paths ``summed``)
    within 1e-6 of the RMS.
    """
    paths = jax.tree_util.tree_flatten_with_path(actual)[0]
    for (path, a), e in zip(paths, jax.tree.leaves(expected), strict=True):
        name = jax.tree_util.keystr(path)
        assert a.dtype == e.dtype and a.shape == e.shape, name
        if name in summed:
            assert_f32_close(a, e)
        elif name.startswith(tuple(f"[1][{index}]" for index in norm_gradients)):
            a32, e32 = np.asarray(a, np.float64), np.asarray(e, np.float64)
            # bfloat16 dx: each side rounded once to 8 bits (2**-9 relative), apart by two.
            tol = 1e-3 if a.dtype == jnp.float32 else 2**-8
            assert np.linalg.norm(a32 - e32) <= tol * np.linalg.norm(e32), name
        else:
            np.testing.assert_array_equal(_bits(a), _bits(e), name)


# ----------------------------------------------------------------------------- kernel (1)


def _cases(*axes: list) -> list:
    """Every combination of the axes' values; those beyond a covering set marked slow.

    The fast set takes the i-th value of every axis in case i (cycling), so each value of each
    axis is tested by default; CI runs the whole product.
    """
    import itertools

    length = max(len(axis) for axis in axes)
    fast = {tuple(axis[i % len(axis)] for axis in axes) for i in range(length)}
    cases = []
    for combination in itertools.product(*axes):
        flat = tuple(value for part in combination for value in part)
        marks = () if combination in fast else (pytest.mark.slow,)
        cases.append(pytest.param(*flat, marks=marks))
    return cases


@pytest.mark.parametrize(
    ("shape", "dtype", "norm_type", "zero_centered", "recipe"),
    _cases(SHAPES, NORMS, [(r,) for r in sorted(RECIPES)]),
)
def test_norm_quantize_matches_xla_stage(shape, dtype, norm_type, zero_centered, recipe):
    config = _norm.NormConfig(norm_type, zero_centered, 1e-6)
    x, gamma, beta = _inputs(shape, dtype, norm_type)

    def operand(x, gamma, beta, quantizer):
        _, stats = _norm.normalize(x, gamma, beta, config)
        return _norm.norm_operand(x, stats, gamma, beta, config, quantizer, None)

    expected, actual = both(operand, x, gamma, beta, _quantizer(recipe))
    assert actual[0].data.dtype == jnp.float8_e4m3fn
    assert_same_bits(actual, expected)


def test_norm_quantize_e5m2_saturation_and_nonfinite():
    """e5m2 data; values beyond the format's range (a stale delayed scale) saturate; a NaN
    row stays NaN and makes the amax NaN (Triton's maximum would drop it)."""
    config = _norm.NormConfig("layernorm", False, 1e-6)
    x, gamma, beta = _inputs((9, 64), jnp.float32, "layernorm", seed=1)
    x = x.at[4, 10].set(jnp.nan)
    for fp8_format, scale_inv in ((Format.E4M3, 1e-3), (Format.HYBRID, 1.0)):
        quantizer = _quantizer("delayed", fp8_format)
        quantizer = quantizer.__class__(
            jnp.full((1,), scale_inv, jnp.float32),
            quantizer.amax_history,
            quantizer.q_dtype,
            quantizer.margin,
            quantizer.amax_compute_algo,
        )

        def operand(x, gamma, beta, quantizer):
            _, stats = _norm.normalize(x, gamma, beta, config)
            return _norm.norm_operand(x, stats, gamma, beta, config, quantizer, None)

        expected, actual = both(operand, x, gamma, beta, quantizer)
        assert_same_bits(actual, expected)


def test_norm_quantize_leaves_other_quantizers_to_xla():
    """No quantizer (bf16 GEMMs): the kernel is not used, and the stage's result is unchanged."""
    config = _norm.NormConfig("layernorm", False, 1e-6)
    x, gamma, beta = _inputs((4, 32), jnp.bfloat16, "layernorm")

    def operand(x, gamma, beta):
        _, stats = _norm.normalize(x, gamma, beta, config)
        return _norm.norm_operand(x, stats, gamma, beta, config, None, None)

    with pallas_kernels("1"):
        lowered = jax.jit(lambda *a: operand(*a)).lower(x, gamma, beta).as_text()
    assert "te_flax_norm_quantize" not in lowered
    assert_same_bits(*both(operand, x, gamma, beta))


# ----------------------------------------------------------------------------- kernel (2)

# (shape, split, dtype): one whole tile; partial tiles in both axes; three axes split after
# two (the matrix [37 * 5, 9]); a narrow matrix; a kernel of LayerNormMLP ([hidden, n_act,
# intermediate]) with several tiles per axis.
TILED = [
    ((64, 64), 1, jnp.float32),
    ((100, 70), 1, jnp.bfloat16),
    ((37, 5, 9), 2, jnp.float32),
    ((3, 130), 1, jnp.bfloat16),
    ((96, 2, 80), 1, jnp.float32),
]


def _transposed_reference(data, split):
    return jnp.transpose(data, (*range(split, data.ndim), *range(split)))


@pytest.mark.parametrize(
    ("shape", "split", "dtype", "recipe", "for_backward"),
    _cases(TILED, [(r,) for r in sorted(RECIPES)], [(True,), (False,)]),
)
def test_quantize_matches_xla_stage(shape, split, dtype, recipe, for_backward):
    """The float8 data in both layouts, the scale and the new state, bit for bit."""
    x = (normal(jax.random.key(5), shape) * 3.0).astype(dtype)

    def operand(x, quantizer):
        return _operands.kernel_operand(x, quantizer, dtype, split, for_backward, None)

    (expected, expected_state), (actual, actual_state) = both(operand, x, _quantizer(recipe))
    assert expected.transposed is None  # the XLA stage leaves the layouts to XLA
    assert actual.data.dtype == jnp.float8_e4m3fn
    assert_same_bits(
        (actual.data, actual.scale_inv, actual.transposed, actual_state),
        (
            expected.data,
            expected.scale_inv,
            _transposed_reference(expected.data, split),
            expected_state,
        ),
    )


def test_quantize_e5m2_saturation_and_nonfinite():
    """e5m2 data; values beyond the range (a stale scale) saturate; a NaN reaches the data
    and the amax, which the state then records as 0, as in the XLA stage."""
    x = normal(jax.random.key(6), (40, 72)) * 50.0
    x = x.at[3, 7].set(jnp.nan)
    for fp8_format in (Format.E4M3, Format.HYBRID):
        quantizer = _quantizer("delayed", fp8_format)
        quantizer = dataclasses.replace(quantizer, scale_inv=jnp.full((1,), 1e-2, jnp.float32))

        def operand(x, quantizer):
            return _operands.kernel_operand(x, quantizer, jnp.float32, 1, True, None)

        (expected, expected_state), (actual, actual_state) = both(operand, x, quantizer)
        assert_same_bits(
            (actual.data, actual.transposed, actual_state),
            (expected.data, expected.data.T, expected_state),
        )


@pytest.mark.parametrize("recipe", [None, "mxfp8"])
def test_quantize_leaves_other_quantizers_to_xla(recipe):
    """No quantizer (a cast) and block scaling: the kernel is not used."""
    kernel = normal(jax.random.key(8), (64, 96))
    quantizer = None
    if recipe == "mxfp8":
        quantizer = QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling()).kernel

    def operand(kernel, quantizer):
        return _operands.kernel_operand(kernel, quantizer, jnp.bfloat16, 1, True, None)

    with pallas_kernels("1"):
        lowered = jax.jit(operand).lower(kernel, quantizer).as_text()
    assert "te_flax_quantize" not in lowered
    assert_same_bits(*both(operand, kernel, quantizer))


def test_gemm_takes_the_transposed_layout():
    """A GEMM contracting an operand's leading axes reads its ``transposed`` data, already in
    the layout with those axes last, and gives the product of ``data``."""
    from te_flax.quantize import ScaledTensor

    keys = jax.random.split(jax.random.key(9), 2)
    lhs = normal(keys[0], (6, 16))
    kernel = normal(keys[1], (16, 2, 5))
    transposed = jnp.transpose(kernel, (1, 2, 0))
    contracting = ((1,), (0,))  # lhs's last axis with the kernel's first
    default = jax.lax.Precision.DEFAULT
    plain, _ = _gemm.gemm(
        ScaledTensor(lhs), ScaledTensor(kernel), contracting, jnp.float32, default
    )
    # Poisoned data: only the transposed layout can give the right product.
    both_layouts = ScaledTensor(jnp.full_like(kernel, jnp.nan), None, transposed)
    product, _ = _gemm.gemm(ScaledTensor(lhs), both_layouts, contracting, jnp.float32, default)
    np.testing.assert_allclose(product, plain, rtol=1e-6)
    assert ScaledTensor(kernel, None, transposed).keep(TRAILING).transposed is None
    assert ScaledTensor(kernel, None, transposed).keep(LEADING).transposed is transposed


# ----------------------------------------------------------------------------- kernel (2), MLP

# (tokens shape, intermediate, activation type, dtype, bias dtype): one tile; partial tiles
# with a gated pair and a bias; several tiles of a float32 gated GELU.
ACTIVATION_GRADS = [
    ((4, 16), 64, ("gelu",), jnp.bfloat16, None),
    ((37,), 70, ("silu", "linear"), jnp.bfloat16, jnp.float32),
    ((3, 50), 130, ("gelu", "linear"), jnp.float32, jnp.bfloat16),
    ((2, 9), 40, ("quick_gelu",), jnp.bfloat16, jnp.float32),
]


def _activation_grad_prepared(grad, pre_activation, activation_type, quantizer, bias_dtype):
    """The stage's result as the GEMM stage uses it (the XLA stage leaves it in bf16)."""
    result = _mlp.activation_grad(grad, pre_activation, activation_type, quantizer, bias_dtype)
    if isinstance(result, _operands.GradOperand):
        return result
    return _operands.grad_operand(result, quantizer, 2, bias_dtype)


@pytest.mark.parametrize(
    ("tokens", "intermediate", "activation_type", "dtype", "bias_dtype", "recipe"),
    _cases(ACTIVATION_GRADS, [(r,) for r in sorted(RECIPES)]),
)
def test_activation_grad_matches_xla_stage(
    tokens, intermediate, activation_type, dtype, bias_dtype, recipe
):
    """The activation's backward quantized: float8 data in both layouts, the scale and the
    state bit for bit; the bias gradient within 1e-6 (float32 sums in another order)."""
    keys = jax.random.split(jax.random.key(12), 2)
    n_act = len(activation_type)
    pre_activation = (normal(keys[0], (*tokens, n_act, intermediate)) * 2.0).astype(dtype)
    grad = normal(keys[1], (*tokens, intermediate)).astype(dtype)
    quantizer = _quantizer(recipe, Format.HYBRID)
    if recipe == "delayed":  # the output gradient's e5m2 quantizer
        quantizer = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe]).dgrad
        quantizer = quantizer.update(jnp.float32(3.0))

    def prepared(grad, pre_activation, quantizer):
        return _activation_grad_prepared(
            grad, pre_activation, activation_type, quantizer, bias_dtype
        )

    expected, actual = both(prepared, grad, pre_activation, quantizer)
    assert expected.operand.transposed is None
    n_batch = len(tokens)
    assert_same_bits(
        (actual.operand.data, actual.operand.scale_inv, actual.operand.transposed),
        (
            expected.operand.data,
            expected.operand.scale_inv,
            jnp.transpose(expected.operand.data, (n_batch, n_batch + 1, *range(n_batch))),
        ),
    )
    assert_same_bits(actual.quantizer, expected.quantizer)
    if bias_dtype is None:
        assert actual.bias is None and expected.bias is None
    else:
        assert actual.bias.dtype == expected.bias.dtype == bias_dtype
        if bias_dtype == jnp.float32:
            assert_f32_close(actual.bias, expected.bias)
        else:
            np.testing.assert_allclose(
                np.asarray(actual.bias, np.float32),
                np.asarray(expected.bias, np.float32),
                rtol=2**-7,
            )


@pytest.mark.parametrize(
    ("tokens", "intermediate", "activation_type", "dtype", "recipe", "for_backward"),
    [
        ((4, 16), 64, ("gelu",), jnp.bfloat16, "delayed", True),
        ((37,), 70, ("silu", "linear"), jnp.bfloat16, "current", True),
        ((3, 50), 130, ("gelu", "linear"), jnp.float32, "delayed", False),
        ((2, 9), 40, ("quick_gelu",), jnp.bfloat16, "delayed", True),
    ],
)
def test_activation_quantize_matches_xla_stage(
    tokens, intermediate, activation_type, dtype, recipe, for_backward
):
    """The forward activation quantized for GEMM 2: float8 data in the layouts asked for, the
    scale and the new state bit for bit; the high-precision activation is not written."""
    n_act = len(activation_type)
    pre_activation = normal(jax.random.key(15), (*tokens, n_act, intermediate)) * 2.0
    pre_activation = pre_activation.astype(dtype)
    uses = _operands.input_uses(for_backward)

    def operand(pre_activation, quantizer):
        return _mlp.activation_operand(
            pre_activation, activation_type, None, quantizer, dtype, uses
        )

    quantizer = _quantizer(recipe)
    (expected, expected_state), (actual, actual_state) = both(operand, pre_activation, quantizer)
    assert expected.transposed is None
    n_batch = len(tokens)
    expected_transposed = jnp.transpose(expected.data, (n_batch, *range(n_batch)))
    assert_same_bits(
        (actual.data, actual.scale_inv, actual_state),
        (expected.data, expected.scale_inv, expected_state),
    )
    if for_backward:  # only the kernel writes the transposed layout
        assert_same_bits(actual.transposed, expected_transposed)
    else:
        assert actual.transposed is None


@pytest.mark.parametrize(
    "activation_type", [("relu",), ("squared_relu", "linear"), ("gelu_exact",)]
)
def test_activation_grad_leaves_other_activations_to_xla(activation_type):
    """ReLU (Triton's maximum drops NaN) and the exact GELU (no erf in Triton): the XLA stage."""
    n_act = len(activation_type)
    pre_activation = normal(jax.random.key(13), (8, n_act, 32))
    grad = normal(jax.random.key(14), (8, 32))
    quantizer = QuantizerFactory.create_set(fp8_recipe=RECIPES["delayed"]).dgrad

    def prepared(grad, pre_activation, quantizer):
        return _activation_grad_prepared(grad, pre_activation, activation_type, quantizer, None)

    with pallas_kernels("1"):
        lowered = jax.jit(prepared).lower(grad, pre_activation, quantizer).as_text()
    assert "te_flax_activation_grad" not in lowered
    assert_same_bits(*both(prepared, grad, pre_activation, quantizer))


def test_activation_backward_in_float32():
    """The XLA stage computes the activation's backward in float32 and rounds once: bfloat16
    within one rounding (2**-8 relative) of the float32 derivative of the same inputs. The
    bfloat16 chain it replaced rounded after every operation: 12% mean relative error here,
    where ``1 + tanh`` cancels for negative inputs."""
    from te_flax._ops.activations import activation_backward, activation_forward

    activation_type = ("gelu", "linear")
    pre = (normal(jax.random.key(15), (64, 2, 48)) * 3.0).astype(jnp.bfloat16)
    grad = normal(jax.random.key(16), (64, 48)).astype(jnp.bfloat16)
    once = activation_backward(grad, pre, activation_type)
    assert once.dtype == jnp.bfloat16
    _, vjp = jax.vjp(lambda p: activation_forward(p, activation_type), pre.astype(jnp.float32))
    reference = np.asarray(vjp(grad.astype(jnp.float32))[0], np.float64)
    error = np.abs(np.asarray(once, np.float64) - reference)
    assert np.all(error <= 2**-8 * np.abs(reference))
    _, chain_vjp = jax.vjp(lambda p: activation_forward(p, activation_type), pre)
    chain_error = np.abs(np.asarray(chain_vjp(grad)[0], np.float64) - reference)
    assert np.linalg.norm(chain_error) > 2 * np.linalg.norm(error)


# ----------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("current", marks=pytest.mark.slow)])
def test_layernorm_dense_step_same_with_kernels(recipe):
    """A training step of ``layernorm_dense`` with every kernel: the same loss, gradients and
    FP8 state."""
    x, gamma, beta = _inputs((2, 24, 64), jnp.bfloat16, "layernorm")
    kernel = normal(jax.random.key(3), (64, 48)) * 0.1
    quantizer_set = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe])

    def step(x, kernel, gamma, beta, quantizer_set):
        def loss(*args):
            out = layernorm_dense(*args[:4], quantizer_set=args[4])
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(
            x, kernel, gamma, beta, quantizer_set
        )

    expected, actual = both(step, x, kernel, gamma, beta, quantizer_set)
    assert_step_close(actual, expected, norm_gradients=(0, 2, 3))


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("current", marks=pytest.mark.slow)])
def test_dense_step_same_with_kernels(recipe):
    """A training step of ``dense`` with a kernel of two contracted axes: every result bit for
    bit (the GEMMs read the kernel's layouts from the quantize kernel)."""
    x = normal(jax.random.key(10), (3, 8, 4, 16)).astype(jnp.bfloat16)
    kernel = normal(jax.random.key(11), (4, 16, 40)) * 0.1
    quantizer_set = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe])

    def step(x, kernel, quantizer_set):
        def loss(x, kernel, quantizer_set):
            out = dense(x, kernel, contracting_dims=((2, 3), (0, 1)), quantizer_set=quantizer_set)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, kernel, quantizer_set)

    expected, actual = both(step, x, kernel, quantizer_set)
    assert_step_close(actual, expected, norm_gradients=())


@pytest.mark.slow
def test_layernorm_mlp_step_same_with_kernels():
    x, gamma, beta = _inputs((2, 16, 64), jnp.bfloat16, "layernorm", seed=2)
    keys = jax.random.split(jax.random.key(4), 2)
    kernels = [normal(keys[0], (64, 2, 96)) * 0.1, normal(keys[1], (96, 64)) * 0.1]
    biases = [jnp.zeros((2, 96)), jnp.zeros((64,))]
    quantizer_sets = QuantizerFactory.create_set(2, fp8_recipe=RECIPES["delayed"])

    def step(x, gamma, beta, kernels, biases, quantizer_sets):
        def loss(x, gamma, beta, kernels, biases, quantizer_sets):
            out = layernorm_mlp(
                x,
                gamma,
                beta,
                kernels,
                biases,
                "layernorm",
                activation_type=("silu", "linear"),
                quantizer_sets=quantizer_sets,
            )
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=tuple(range(6)))(
            x, gamma, beta, kernels, biases, quantizer_sets
        )

    expected, actual = both(step, x, gamma, beta, kernels, biases, quantizer_sets)
    # The first bias' gradient: the activation-gradient kernel's column sums.
    assert_step_close(actual, expected, norm_gradients=(0, 1, 2), summed=("[1][4][0]",))


def test_accumulation_quantizing_once_same_with_kernels():
    """``accumulate_gradients(..., quantize_once=True)`` hoists what depends only on the
    variables (the kernels' quantization, now a kernel call) out of the microbatch loop: the
    same loss, gradients and FP8 state with every kernel (the norm backward's float32 sums
    within 1e-6)."""
    import te_flax
    import te_flax.linen as te_nn
    from te_flax.accumulate import accumulate_gradients
    from te_flax.training import merge_fp8_state

    model = te_nn.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"))
    microbatches = normal(jax.random.key(17), (3, 2, 8, 32)).astype(jnp.bfloat16)
    with te_flax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        variables = model.init(jax.random.key(18), microbatches[0])

        def loss_fn(variables, batch):
            out, _ = model.apply(merge_fp8_state(variables), batch)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        def step(variables, microbatches):
            return accumulate_gradients(loss_fn, variables, microbatches, quantize_once=True)

        expected, actual = both(step, variables, microbatches)
    assert_f32_close(actual, expected)


# ----------------------------------------------------------------------------- the switch


def test_switch_reads_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert mode() == "auto"
    monkeypatch.setenv(ENV_VAR, "off")
    assert mode() == "0"
    with pallas_kernels("1"):
        assert mode() == "1"  # the context wins over the variable
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=r"TE_FLAX_PALLAS must be one of auto, 0, 1.*'sometimes'"):
        mode()


def test_auto_traces_the_xla_stages_on_cpu():
    """Without a GPU ``auto`` traces exactly the program of ``0``: CPU programs are unchanged."""
    config = _norm.NormConfig("layernorm", False, 1e-6)
    x, gamma, beta = _inputs((8, 32), jnp.float32, "layernorm")

    def step(x, gamma, beta, quantizer):
        _, stats = _norm.normalize(x, gamma, beta, config)
        operand, _ = _norm.norm_operand(x, stats, gamma, beta, config, quantizer, None)
        grads = _norm.normalize_backward(x, x, stats, gamma, beta, config)
        kernel, _ = _operands.kernel_operand(x, quantizer, x.dtype, 1, True, None)
        return operand, grads, kernel

    programs = []
    for switch in ("0", "auto"):
        with pallas_kernels(switch):
            lowered = jax.jit(lambda *a: step(*a)).lower(x, gamma, beta, _quantizer("delayed"))
        programs.append(lowered.as_text(debug_info=False))
    assert programs[0] == programs[1]
    assert "cond" not in programs[1] and "case" not in programs[1]


# ----------------------------------------------------------------------------- kernel (3)


@pytest.mark.parametrize(
    ("shape", "dtype", "norm_type", "zero_centered"),
    _cases([*SHAPES, ((2100, 64), jnp.float32)], NORMS),
)
def test_norm_backward_matches_xla_stage(shape, dtype, norm_type, zero_centered):
    """dx in x's dtype, dgamma and dbeta in float32; (2100, 64) has several row blocks per
    program and a partial last one."""
    config = _norm.NormConfig(norm_type, zero_centered, 1e-6)
    x, gamma, beta = _inputs(shape, dtype, norm_type)
    d_out = normal(jax.random.key(7), shape).astype(dtype)

    def grads(d_out, x, gamma, beta):
        _, stats = _norm.normalize(x, gamma, beta, config)
        return _norm.normalize_backward(d_out, x, stats, gamma, beta, config)

    expected, actual = both(grads, d_out, x, gamma, beta)
    if dtype == jnp.float32:
        assert_f32_close(actual, expected)
    else:
        # dx is rounded to bfloat16 from float32 values that agree within float32 rounding:
        # at most one bfloat16 step apart, and almost always equal.
        np.testing.assert_allclose(
            np.asarray(actual[0], np.float32), np.asarray(expected[0], np.float32), rtol=2**-7
        )
        assert np.mean(np.asarray(actual[0] != expected[0])) < 0.01
        assert_f32_close(actual[1:], expected[1:])


@pytest.mark.parametrize(("norm_type", "zero_centered"), NORMS)
def test_norm_backward_applies_a_deferred_scale(norm_type, zero_centered):
    """``d_out_scale`` (a dgrad GEMM's scale left to the norm backward) gives the gradients of
    the scaled ``d_out``, with the kernel (on gamma and the partial sums) and the XLA stage."""
    config = _norm.NormConfig(norm_type, zero_centered, 1e-6)
    shape = (4, 16, 128)
    x, gamma, beta = _inputs(shape, jnp.float32, norm_type)
    d_out = normal(jax.random.key(7), shape) * 1e4  # an unscaled FP8 product's magnitude
    scale = jnp.array([3.1e-5], jnp.float32)

    def grads(d_out, x, gamma, beta, scale):
        _, stats = _norm.normalize(x, gamma, beta, config)
        return _norm.normalize_backward(d_out, x, stats, gamma, beta, config, scale)

    def prescaled(d_out, x, gamma, beta, scale):
        return grads(d_out * scale[0], x, gamma, beta, None)

    for result in both(grads, d_out, x, gamma, beta, scale):
        expected = jax.jit(prescaled)(d_out, x, gamma, beta, scale)
        assert all(a is None for a in result[2:]) == (beta is None)
        # The scale meets gamma before d_out: float32 rounding of another order.
        for a, e in zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True):
            assert a.dtype == e.dtype and a.shape == e.shape
            np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6 * np.sqrt(np.mean(e * e)))


def test_identical_kernel_calls_are_lowered_once():
    """Two calls of a kernel with the same shapes and settings (a model's repeated layers) are
    one lowered function called twice: the Pallas kernel is traced and lowered once."""
    config = _norm.NormConfig("rmsnorm", False, 1e-6)
    x, gamma, _ = _inputs((64, 128), jnp.float32, "rmsnorm")

    def twice(d_out, x, gamma):
        _, stats = _norm.normalize(x, gamma, None, config)
        first = _norm.normalize_backward(d_out, x, stats, gamma, None, config)
        return first, _norm.normalize_backward(d_out * 2.0, x, stats, gamma, None, config)

    with pallas_kernels("1"):
        text = jax.jit(twice).lower(x, x, gamma).as_text()
    assert text.count("func.func private @norm_backward(") == 1
    assert text.count("call @norm_backward(") == 2


def test_traced_in_scan_tells_a_scanned_kernel_from_a_closed_over_one():
    import flax.linen as nn

    seen: dict[str, bool] = {}

    def step(kernels, x, outer):
        def body(carry, kernel):
            seen["slice"] = traced_in_scan(kernel)
            seen["closed_over"] = traced_in_scan(outer)  # a tracer of the enclosing jit
            return carry @ kernel @ outer, None

        seen["outside"] = traced_in_scan(kernels)
        return jax.lax.scan(body, x, kernels)[0]

    jax.jit(step)(jnp.ones((3, 4, 4)), jnp.ones((2, 4)), jnp.ones((4, 4)))
    assert seen == {"outside": False, "slice": True, "closed_over": False}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            kernel = self.param("kernel", nn.initializers.ones, (4, 4))
            seen["flax"] = traced_in_scan(kernel)
            return x @ kernel, None

    blocks = nn.scan(
        nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )()
    jax.jit(blocks.init)(jax.random.key(0), jnp.ones((2, 4)), None)
    assert seen["flax"] is True
    assert traced_in_scan(jnp.ones(3)) is False
