"""LayerNormMLP's activation kernels in Pallas Mosaic GPU against the XLA stages.

In Mosaic GPU's interpret mode (jax 0.11 and newer) on the CPU, for every activation the kernels
take: the forward activation quantized in each layout and the backward quantized in both, float8
data bit for bit and the amax equal, the bias gradient's column sums within 1e-6 of their RMS
(float32 sums in another order), for shapes the kernels tile and shapes they leave to XLA's
arithmetic, NaN and infinities included, and a LayerNormMLP training step through the kernel
switch. Then a deviceless compile for an H100: a LayerNormMLP FP8 training step under ``"auto"``
runs both kernels as Mosaic GPU custom calls.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.activations import activation_backward
from te_flax._ops.kernels.activation_grad import KERNEL_ACTIVATIONS
from te_flax._ops.kernels.activation_grad_mosaic import activation_grad_tiles
from te_flax._ops.kernels.activation_quantize_mosaic import activation_quantize_tiles
from te_flax._ops.kernels.common import block_amax, saturating_cast
from te_flax._ops.kernels.mosaic import tileable
from te_flax._ops.kernels.switch import MOSAIC
from te_flax._ops.mlp import activation_output
from tests.helpers import USERS_OPTIMIZATION, normal

pytestmark = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="the Mosaic GPU activation kernels need jax 0.11 or newer"
)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Each activation the kernels take, alone and gated by a linear slice.
ACTIVATION_TYPES = [
    *((name,) for name in sorted(KERNEL_ACTIVATIONS)),
    *((name, "linear") for name in sorted(KERNEL_ACTIVATIONS - {"linear"})),
]
# (rows, intermediate, dtype): one tile; several tiles in each axis; not multiples of the tile.
SHAPES = [
    (64, 64, jnp.bfloat16),
    (128, 192, jnp.float32),
    (192, 64, jnp.float16),
    (100, 70, jnp.bfloat16),
    (37, 128, jnp.float32),
]


def _bits(value) -> np.ndarray:
    value = np.asarray(value)
    return value.view(f"u{value.dtype.itemsize}")


def _pre_activation(rows, intermediate, dtype, activation_type, seed=0):
    """``[rows, n_act * intermediate]``, and the same as ``[rows, n_act, intermediate]``."""
    n_act = len(activation_type)
    pre = (normal(jax.random.key(seed), (rows, n_act, intermediate)) * 3.0).astype(dtype)
    return pre.reshape(rows, n_act * intermediate), pre


def _assert_sums_close(actual, expected) -> None:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.sqrt(np.mean(np.square(expected)))) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6 * scale)


def test_activation_kernels_are_mosaic_kernels_here():
    assert {"activation_quantize", "activation_grad"} <= MOSAIC


# ----------------------------------------------------------------------------- forward


def _quantize_run(pre, pre3, scale_inv, activation_type, q_dtype, layouts):
    def xla(pre3, scale_inv):  # the XLA stage's arithmetic
        activated = activation_output(pre3, activation_type, None, True).astype(jnp.float32)
        return saturating_cast(activated, scale_inv[0], q_dtype), block_amax(activated)

    def kernel(pre, scale_inv):
        return activation_quantize_tiles(
            pre, scale_inv, activation_type, q_dtype, layouts, interpret=True
        )

    options = {"compiler_options": USERS_OPTIMIZATION}
    return jax.jit(kernel, **options)(pre, scale_inv), jax.jit(xla, **options)(pre3, scale_inv)


def _assert_layouts(data, transposed, layouts, expected) -> None:
    for written, on, reference in ((data, layouts[0], expected), (transposed, layouts[1], None)):
        if not on:
            assert written is None
            continue
        reference = expected if reference is not None else expected.T
        assert written.dtype == expected.dtype and written.shape == reference.shape
        np.testing.assert_array_equal(_bits(written), _bits(reference))


@pytest.mark.parametrize(("rows", "intermediate", "dtype"), SHAPES)
@pytest.mark.parametrize("activation_type", ACTIVATION_TYPES)
def test_activation_quantize_matches_xla_stage(activation_type, rows, intermediate, dtype):
    pre, pre3 = _pre_activation(rows, intermediate, dtype, activation_type)
    scale_inv = jnp.full((1,), 0.01, jnp.float32)  # some values saturate
    layouts = (True, True)
    (data, transposed, partials), (expected, amax) = _quantize_run(
        pre, pre3, scale_inv, activation_type, E4M3, layouts
    )
    if tileable(rows, intermediate):
        assert partials.shape == (rows * intermediate // 64**2,)
    assert float(jnp.max(partials)) == float(amax)
    _assert_layouts(data, transposed, layouts, expected)


@pytest.mark.parametrize("layouts", [(True, False), (False, True)])
@pytest.mark.parametrize(("rows", "intermediate", "dtype"), SHAPES[:3])
def test_activation_quantize_one_layout(layouts, rows, intermediate, dtype):
    activation_type = ("gelu", "linear")
    pre, pre3 = _pre_activation(rows, intermediate, dtype, activation_type, seed=1)
    scale_inv = jnp.full((1,), 0.5, jnp.float32)
    (data, transposed, partials), (expected, amax) = _quantize_run(
        pre, pre3, scale_inv, activation_type, E4M3, layouts
    )
    assert float(jnp.max(partials)) == float(amax)
    _assert_layouts(data, transposed, layouts, expected)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_activation_quantize_amax_alone_and_nonfinite(dtype):
    """Without a float8 dtype the amax alone; a NaN or an infinity: NaN data, a NaN amax."""
    activation_type = ("silu", "linear")
    pre, pre3 = _pre_activation(128, 64, dtype, activation_type, seed=2)
    data, transposed, partials = activation_quantize_tiles(
        pre, jnp.ones((1,), jnp.float32), activation_type, None, (True, True), interpret=True
    )
    activated = activation_output(pre3, activation_type, None, True)
    assert data is None and transposed is None
    assert float(jnp.max(partials)) == float(jnp.max(jnp.abs(activated.astype(jnp.float32))))
    pre = pre.at[3, 7].set(jnp.nan).at[60, 100].set(jnp.inf).at[10, 10].set(-jnp.inf)
    pre3 = pre.reshape(pre3.shape)
    scale_inv = jnp.full((1,), 1e-2, jnp.float32)
    (data, transposed, partials), (expected, amax) = _quantize_run(
        pre, pre3, scale_inv, activation_type, E5M2, (True, True)
    )
    assert np.isnan(float(jnp.max(partials))) and np.isnan(float(amax))
    _assert_layouts(data, transposed, (True, True), expected)


# ----------------------------------------------------------------------------- backward


def _grad_run(pre, pre3, grad, scale_inv, activation_type, q_dtype, with_bias):
    def xla(grad, pre3, scale_inv):  # the XLA stage's arithmetic
        rows, n_act, intermediate = pre3.shape
        d_pre = activation_backward(grad, pre3, activation_type)
        values = d_pre.reshape(rows, n_act * intermediate).astype(jnp.float32)
        quantized = saturating_cast(values, scale_inv[0], q_dtype)
        return quantized, block_amax(values), jnp.sum(values, axis=0)

    def kernel(pre, grad, scale_inv):
        return activation_grad_tiles(
            pre, grad, scale_inv, activation_type, q_dtype, with_bias, interpret=True
        )

    options = {"compiler_options": USERS_OPTIMIZATION}
    return (
        jax.jit(kernel, **options)(pre, grad, scale_inv),
        jax.jit(xla, **options)(grad, pre3, scale_inv),
    )


@pytest.mark.parametrize(("rows", "intermediate", "dtype"), SHAPES)
@pytest.mark.parametrize("activation_type", ACTIVATION_TYPES)
def test_activation_grad_matches_xla_stage(activation_type, rows, intermediate, dtype):
    pre, pre3 = _pre_activation(rows, intermediate, dtype, activation_type, seed=3)
    grad = normal(jax.random.key(4), (rows, intermediate)).astype(dtype)
    scale_inv = jnp.full((1,), 2e-4, jnp.float32)  # some values saturate
    (data, transposed, partials, sums), (expected, amax, expected_sums) = _grad_run(
        pre, pre3, grad, scale_inv, activation_type, E5M2, True
    )
    n_act = len(activation_type)
    if tileable(rows, intermediate):
        assert partials.shape == (rows * intermediate // 64**2 * n_act,)
        assert sums.shape == (rows // 64, n_act * intermediate)
    assert float(jnp.max(partials)) == float(amax)
    _assert_layouts(data, transposed, (True, True), expected)
    _assert_sums_close(jnp.sum(sums, axis=0), expected_sums)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_activation_grad_without_bias_amax_alone_and_nonfinite(dtype):
    """No column sums without a bias; the amax alone without a float8 dtype; a NaN or an
    infinity in either input: the XLA stage's NaN data and a NaN amax."""
    activation_type = ("gelu", "linear")
    pre, pre3 = _pre_activation(128, 128, dtype, activation_type, seed=5)
    grad = normal(jax.random.key(6), (128, 128)).astype(dtype)
    scale_inv = jnp.full((1,), 1e-3, jnp.float32)
    amax_pass = jax.jit(
        lambda pre, grad, scale_inv: activation_grad_tiles(
            pre, grad, scale_inv, activation_type, None, True, interpret=True
        ),
        compiler_options=USERS_OPTIMIZATION,  # the float32 gradient as the XLA stage's
    )
    data, transposed, partials, sums = amax_pass(pre, grad, scale_inv)
    (_, _, _, no_sums), (expected, amax, expected_sums) = _grad_run(
        pre, pre3, grad, scale_inv, activation_type, E4M3, False
    )
    assert data is None and transposed is None and no_sums is None
    assert float(jnp.max(partials)) == float(amax)
    _assert_sums_close(jnp.sum(sums, axis=0), expected_sums)
    pre = pre.at[3, 7].set(jnp.nan).at[60, 200].set(jnp.inf)
    grad = grad.at[100, 10].set(-jnp.inf)
    (data, transposed, partials, _), (expected, amax, _) = _grad_run(
        pre, pre.reshape(pre3.shape), grad, scale_inv, activation_type, E4M3, False
    )
    assert np.isnan(float(jnp.max(partials))) and np.isnan(float(amax))
    _assert_layouts(data, transposed, (True, True), expected)


# ----------------------------------------------------------------------------- the switch


@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")])
def test_layernorm_mlp_step_same_with_kernels(activation_type):
    """One LayerNormMLP FP8 training step at shapes the kernels tile, every kernel (interpret
    mode) against the XLA stages: as ``tests/test_kernels.py`` compares them."""
    from te_flax.layernorm_mlp import layernorm_mlp
    from te_flax.quantize import DelayedScaling, QuantizerFactory
    from tests.test_kernels import assert_step_close, both

    n_act = len(activation_type)
    keys = jax.random.split(jax.random.key(7), 4)
    x = normal(keys[0], (2, 32, 64)).astype(jnp.bfloat16)
    gamma, beta = 1.0 + normal(keys[1], (64,)) * 0.1, jnp.zeros((64,))
    kernels = [normal(keys[2], (64, n_act, 128)) * 0.1, normal(keys[3], (128, 64)) * 0.1]
    biases = [jnp.full((n_act, 128), 0.1), jnp.zeros((64,))]
    quantizer_sets = QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling(amax_history_len=4))

    def step(x, gamma, beta, kernels, biases, quantizer_sets):
        def loss(*args):
            out = layernorm_mlp(
                *args[:3], args[3], args[4], "layernorm", activation_type=activation_type,
                quantizer_sets=args[5],
            )  # fmt: skip
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=tuple(range(6)))(
            x, gamma, beta, kernels, biases, quantizer_sets
        )

    expected, actual = both(step, x, gamma, beta, kernels, biases, quantizer_sets)
    # The first bias' gradient: the activation-gradient kernel's column sums.
    assert_step_close(actual, expected, norm_gradients=(0, 1, 2), summed=("[1][4][0]",))


# ----------------------------------------------------------------------------- H100 compile


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    ("activation_type", "dtype"),
    [(("gelu",), jnp.bfloat16), (("silu", "linear"), jnp.float32), (("quick_gelu",), jnp.float16)],
)
def test_auto_runs_the_mosaic_kernels_in_a_layernorm_mlp_fp8_step(activation_type, dtype):
    """Deviceless H100 compile of a LayerNormMLP FP8 step (biases, delayed scaling) under
    ``"auto"``: the activation's quantization and its backward are Mosaic GPU custom calls by
    their names, beside the quantize kernels of the two weights; the six GEMMs stay FP8
    cuBLASLt calls."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from te_flax._ops.kernels import pallas_kernels
    from te_flax._tools.hlo import FP8_GEMM, kernel_names
    from te_flax.layernorm_mlp import layernorm_mlp
    from te_flax.quantize import DelayedScaling, QuantizerFactory
    from tests.gpu_target import h100_sharding

    sharding = h100_sharding()
    n_act, tokens, hidden, intermediate = len(activation_type), 512, 1024, 2048

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    kernels = [spec((hidden, n_act, intermediate)), spec((intermediate, hidden))]
    biases = [spec((n_act, intermediate)), spec((hidden,))]
    quantizers = jax.tree.map(
        lambda leaf: spec(leaf.shape, leaf.dtype),
        QuantizerFactory.create_set(2, fp8_recipe=DelayedScaling()),
    )

    def loss(kernels, biases, quantizers, x):
        out = layernorm_mlp(
            x, jnp.ones((hidden,)), None, kernels, biases, "rmsnorm",
            activation_type=activation_type, quantizer_sets=quantizers,
        )  # fmt: skip
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    texts = {}
    for switch in ("0", "auto"):
        with pallas_kernels(switch, assume_gpu=True):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
            lowered = step.lower(kernels, biases, quantizers, spec((tokens, hidden), dtype))
            texts[switch] = lowered.compile().as_text()
    names = kernel_names(texts["auto"])
    # The MLP's two kernels, the two GEMM kernels' quantization, and the norm's backward.
    assert names == sorted(
        [
            "te_flax_activation_grad",
            "te_flax_activation_quantize",
            "te_flax_norm_backward",
            *["te_flax_quantize"] * 2,
        ]
    )
    mosaic = [line for line in texts["auto"].splitlines() if '"mosaic_gpu_v2"' in line]
    assert len(mosaic) == len(names)
    width = n_act * intermediate
    # The backward's float8 data in both layouts, its tile maxima and column sums.
    grad_call = re.compile(
        rf"f8e5m2\[{tokens},{width}\].*f8e5m2\[{width},{tokens}\].*"
        rf"f32\[{tokens // 64},{intermediate // 64},{n_act}\].*f32\[{tokens // 64},{width}\]"
    )
    assert any(grad_call.search(line) for line in mosaic)
    assert not kernel_names(texts["0"])
    for text in texts.values():
        assert text.count(f'"{FP8_GEMM}"') == 6
