"""The quantize kernel in Pallas Mosaic GPU against the XLA stage.

In Mosaic GPU's interpret mode (jax 0.11 and newer) on the CPU: the float8 data in each layout
bit for bit and the amax, for shapes the kernel tiles and shapes it leaves to XLA's arithmetic,
and through the kernel switch. Then a deviceless compile for an H100: one training step of
``dense`` under per-tensor FP8 with ``"auto"`` runs the kernel as a Mosaic GPU custom call.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.kernels import pallas_kernels
from te_flax._ops.kernels.common import block_amax, saturating_cast
from te_flax._ops.kernels.quantize_mosaic import quantize_tiles, tileable
from te_flax._ops.kernels.switch import MOSAIC
from tests.helpers import USERS_OPTIMIZATION, normal

pytestmark = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="the Mosaic GPU quantize kernel needs jax 0.11 or newer"
)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (rows, columns, dtype): one tile; several tiles in each axis; not multiples of the tile.
SHAPES = [
    (64, 64, jnp.float32),
    (128, 192, jnp.bfloat16),
    (192, 64, jnp.float16),
    (100, 70, jnp.bfloat16),
    (37, 128, jnp.float32),
]
LAYOUTS = [(True, True), (True, False), (False, True)]


def _bits(value) -> np.ndarray:
    value = np.asarray(value)
    return value.view(f"u{value.dtype.itemsize}")


def _reference(x, scale_inv, q_dtype):
    """The XLA stage's arithmetic: the float8 data and the amax (NaN if any value is NaN)."""
    values = x.astype(jnp.float32)
    return saturating_cast(values, scale_inv[0], q_dtype), block_amax(values)


def _run(x, scale_inv, q_dtype, layouts):
    kernel = jax.jit(
        lambda x, s: quantize_tiles(x, s, q_dtype, layouts, interpret=True),
        compiler_options=USERS_OPTIMIZATION,
    )
    reference = jax.jit(lambda x, s: _reference(x, s, q_dtype), compiler_options=USERS_OPTIMIZATION)
    return kernel(x, scale_inv), reference(x, scale_inv)


def test_quantize_is_a_mosaic_kernel_here():
    assert "quantize" in MOSAIC


@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize(("rows", "columns", "dtype"), SHAPES)
def test_quantize_matches_xla_stage(rows, columns, dtype, layouts):
    x = (normal(jax.random.key(rows + columns), (rows, columns)) * 300.0).astype(dtype)
    scale_inv = jnp.full((1,), 0.5, jnp.float32)  # some values saturate
    (data, transposed, partials), (expected, amax) = _run(x, scale_inv, E4M3, layouts)
    if tileable(rows, columns):
        assert partials.shape == (rows * columns // 64**2,)
    assert float(jnp.max(partials)) == float(amax)
    for written, on, reference in ((data, layouts[0], expected), (transposed, layouts[1], None)):
        if not on:
            assert written is None
            continue
        reference = expected if reference is not None else expected.T
        assert written.dtype == E4M3 and written.shape == reference.shape
        np.testing.assert_array_equal(_bits(written), _bits(reference))


def test_quantize_amax_alone():
    x = normal(jax.random.key(1), (128, 64)) * 7.0
    data, transposed, partials = quantize_tiles(
        x, jnp.ones((1,), jnp.float32), None, (True, True), interpret=True
    )
    assert data is None and transposed is None
    assert float(jnp.max(partials)) == float(jnp.max(jnp.abs(x)))


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2])
def test_quantize_e5m2_saturation_and_nonfinite(q_dtype):
    """Values beyond the range saturate; a NaN and an infinity give NaN data, a NaN amax."""
    x = normal(jax.random.key(2), (64, 128)) * 5e4
    x = x.at[3, 7].set(jnp.nan).at[60, 100].set(jnp.inf).at[10, 10].set(-jnp.inf)
    scale_inv = jnp.full((1,), 1e-2, jnp.float32)
    (data, transposed, partials), (expected, amax) = _run(x, scale_inv, q_dtype, (True, True))
    assert np.isnan(float(jnp.max(partials))) and np.isnan(float(amax))
    np.testing.assert_array_equal(_bits(data), _bits(expected))
    np.testing.assert_array_equal(_bits(transposed), _bits(expected.T))


def test_dense_step_same_with_kernel():
    """One FP8 training step of ``dense`` through the switch: the Mosaic kernel (interpret
    mode) gives the XLA stage's results bit for bit."""
    from te_flax.dense import dense
    from te_flax.quantize import DelayedScaling, QuantizerFactory

    x = normal(jax.random.key(3), (64, 128)).astype(jnp.bfloat16)
    kernel = normal(jax.random.key(4), (128, 192)) * 0.1
    quantizers = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())

    def loss(kernel, quantizers, x):
        out = dense(x, kernel, quantizer_set=quantizers)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    results = []
    for switch in ("0", "1"):
        with pallas_kernels(switch):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            results.append(step(kernel, quantizers, x))
    for actual, expected in zip(*(jax.tree.leaves(r) for r in results), strict=True):
        np.testing.assert_array_equal(_bits(actual), _bits(expected))


@pytest.mark.gpu_compile
def test_auto_runs_the_mosaic_kernel_in_a_dense_fp8_step():
    """Deviceless H100 compile of a ``dense`` FP8 step under ``"auto"``: the kernel of the
    weight (float8 in both layouts, its amax) is a Mosaic GPU custom call, the three GEMMs stay
    FP8 cuBLASLt calls."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from te_flax._tools.hlo import FP8_GEMM
    from te_flax.dense import dense
    from te_flax.quantize import DelayedScaling, QuantizerFactory
    from tests.gpu_target import h100_sharding

    sharding = h100_sharding()

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    quantizers = jax.tree.map(
        lambda leaf: spec(leaf.shape, leaf.dtype),
        QuantizerFactory.create_set(fp8_recipe=DelayedScaling()),
    )

    def loss(kernel, quantizers, x):
        out = dense(x, kernel, quantizer_set=quantizers)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    texts = {}
    for switch in ("0", "auto"):
        with pallas_kernels(switch, assume_gpu=True):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            lowered = step.lower(spec((1024, 2048)), quantizers, spec((512, 1024), jnp.bfloat16))
            texts[switch] = lowered.compile().as_text()
    mosaic = [line for line in texts["auto"].splitlines() if '"mosaic_gpu_v2"' in line]
    assert len(mosaic) == 1
    # The weight's float8 data in both layouts and its tile maxima.
    assert re.search(r"f8e4m3fn\[1024,2048\].*f8e4m3fn\[2048,1024\].*f32\[16,32\]", mosaic[0])
    assert '"mosaic_gpu_v2"' not in texts["0"]
    for text in texts.values():
        assert text.count(f'"{FP8_GEMM}"') == 3
