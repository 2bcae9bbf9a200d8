"""The norm backward kernel in Pallas Mosaic GPU against the XLA stage.

In Mosaic GPU's interpret mode (jax 0.11 and newer) on the CPU: ``dx`` and the sums of the
partial ``dgamma`` and ``dbeta`` against ``normalize_backward``'s XLA stage, for layernorm and
rmsnorm (zero-centered gamma too), one and two rows in flight, a last block shorter than the
others, and a hidden size the kernel leaves to XLA's arithmetic. Then a deviceless compile for an
H100: the kernel alone is one Mosaic GPU custom call named ``te_flax_norm_backward``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops.kernels import norm_backward_mosaic, pallas_kernels
from te_flax._ops.kernels.common import RowBlocks
from te_flax._ops.kernels.norm_backward_mosaic import fits, norm_backward
from te_flax._ops.norm import NormConfig, normalize, normalize_backward
from tests.helpers import USERS_OPTIMIZATION, normal

pytestmark = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="the Mosaic GPU norm kernel needs jax 0.11 or newer"
)
# (rows, hidden, dtype): one program; a last program with fewer rows (17 = 5 * 3 + 2 with the
# 8 programs of _few_programs);
# float32 rows of 8192 (one row in flight); a hidden size that is no multiple of 256 (XLA).
SHAPES = [
    (64, 256, jnp.float32),
    (17, 768, jnp.bfloat16),
    (5, 8192, jnp.float32),
    (37, 1024, jnp.float16),
    (24, 100, jnp.bfloat16),
]
NORMS = [("layernorm", False), ("rmsnorm", False), ("layernorm", True), ("rmsnorm", True)]


def _inputs(rows, hidden, dtype, config):
    keys = jax.random.split(jax.random.key(rows + hidden), 4)
    x = (normal(keys[0], (rows, hidden)) * 2.0 + 0.5).astype(dtype)
    d_out = normal(keys[1], (rows, hidden)).astype(dtype)
    gamma = normal(keys[2], (hidden,)) * 0.2 + (0.0 if config.zero_centered_gamma else 1.0)
    beta = normal(keys[3], (hidden,)) * 0.1
    return d_out, x, gamma, beta


def _xla_stage(d_out, x, gamma, beta, config):
    _, stats = normalize(x, gamma, beta, config)
    with pallas_kernels("0"):
        return normalize_backward(d_out, x, stats, gamma, beta, config)


def _kernel(d_out, x, gamma, beta, config):
    """The kernel on ``normalize_backward``'s operands (the effective gamma, the statistics),
    its partial sums added up as the kernel switch does."""
    _, stats = normalize(x, gamma, beta, config)
    rows, hidden = x.shape
    effective = gamma + 1.0 if config.zero_centered_gamma else gamma
    mean = None if stats.mean is None else stats.mean.reshape(rows)
    d_x, d_gamma, d_beta = norm_backward(
        d_out, x, mean, stats.rsigma.reshape(rows), effective, beta is not None, x.dtype,
        RowBlocks(rows, hidden), interpret=True,
    )  # fmt: skip
    return d_x, jnp.sum(d_gamma, axis=0), None if d_beta is None else jnp.sum(d_beta, axis=0)


def _assert_close(actual, expected, dtype):
    """Within float32 rounding of the XLA stage: a few float32 ulps of the values' scale (sums
    in another order), and one ulp of a 16-bit ``dx`` rounded the other way."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected)))
    f32_eps = float(jnp.finfo(jnp.float32).eps)
    rtol = float(jnp.finfo(dtype).eps) if dtype != jnp.float32 else f32_eps
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=16 * f32_eps * scale)


@pytest.fixture
def _few_programs(monkeypatch):
    """The kernel with 8 programs in place of 256: the same split of rows into programs (several
    rows each, a shorter last one) at a size the interpreter, which runs one program after the
    other, gets through in a second rather than a minute."""
    monkeypatch.setattr(norm_backward_mosaic, "_PROGRAMS", 8)


@pytest.mark.usefixtures("_few_programs")
@pytest.mark.parametrize(("norm_type", "zero_centered"), NORMS)
@pytest.mark.parametrize(("rows", "hidden", "dtype"), SHAPES)
def test_norm_backward_matches_xla_stage(rows, hidden, dtype, norm_type, zero_centered):
    config = NormConfig(norm_type, zero_centered, 1e-6)
    d_out, x, gamma, beta = _inputs(rows, hidden, dtype, config)
    beta = beta if norm_type == "layernorm" else None
    run = jax.jit(lambda *a: _kernel(*a, config), compiler_options=USERS_OPTIMIZATION)
    stage = jax.jit(lambda *a: _xla_stage(*a, config), compiler_options=USERS_OPTIMIZATION)
    (d_x, d_gamma, d_beta), expected = run(d_out, x, gamma, beta), stage(d_out, x, gamma, beta)
    assert d_x.dtype == x.dtype and d_x.shape == x.shape
    _assert_close(d_x, expected[0], dtype)
    _assert_close(d_gamma, expected[1], jnp.float32)
    if beta is None:
        assert d_beta is None and expected[2] is None
    else:
        _assert_close(d_beta, expected[2], jnp.float32)


@pytest.mark.usefixtures("_few_programs")
def test_partial_sums_per_program():
    """One partial row per program: 17 rows in 8 programs of 3 make 6 rows of sums; a hidden
    size the kernel does not take gives one."""
    assert fits(768) and not fits(100)
    config = NormConfig("layernorm", False, 1e-6)
    d_out, x, gamma, beta = _inputs(17, 768, jnp.bfloat16, config)
    _, stats = normalize(x, gamma, beta, config)
    args = (stats.mean.reshape(-1), stats.rsigma.reshape(-1), gamma, True, x.dtype)
    _, d_gamma, d_beta = norm_backward(d_out, x, *args, RowBlocks(17, 768), interpret=True)
    assert d_gamma.shape == d_beta.shape == (6, 768)
    _, d_gamma, _ = norm_backward(
        d_out[:, :100], x[:, :100], *args[:2], gamma[:100], True, x.dtype,
        RowBlocks(17, 100), interpret=True,
    )  # fmt: skip
    assert d_gamma.shape == (1, 100)


@pytest.mark.gpu_compile
def test_kernel_is_a_mosaic_gpu_call():
    """Deviceless H100 compile of the kernel alone: one Mosaic GPU custom call named
    ``te_flax_norm_backward``, taking the gradient, ``x`` and the statistics and writing
    ``dx`` and a row of partial sums per program."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from tests.gpu_target import h100_sharding

    sharding = h100_sharding()
    rows, hidden = 4096, 8192

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def kernel(d_out, x, mean, rsigma, gamma):
        blocks = RowBlocks(rows, hidden)
        return norm_backward(
            d_out, x, mean, rsigma, gamma, True, jnp.bfloat16, blocks, interpret=False
        )

    matrix = spec((rows, hidden), jnp.bfloat16)
    lowered = jax.jit(kernel).lower(matrix, matrix, spec((rows,)), spec((rows,)), spec((hidden,)))
    calls = [line for line in lowered.compile().as_text().splitlines() if "mosaic_gpu_v2" in line]
    assert len(calls) == 1
    assert "te_flax_norm_backward" in calls[0]
    assert "bf16[4096,8192]" in calls[0] and "f32[256,8192]" in calls[0]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("switch", ["auto", "1"])
def test_a_layer_step_for_a_gpu_runs_the_kernel_under_every_switch(switch):
    """A deviceless H100 compile of a ``layernorm_dense`` training step (no FP8: the norm's
    backward is its one kernel) under ``"auto"`` and ``"1"``. Under ``"1"`` a CUDA program's
    other branch must not carry the interpreter's ordered host callbacks (a lowering error)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from te_flax.layernorm_dense import layernorm_dense
    from te_flax.quantize import noop_quantizer_set
    from tests.gpu_target import h100_sharding

    sharding = h100_sharding()

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def loss(x, kernel, gamma, beta):
        out = layernorm_dense(x, kernel, gamma, beta, quantizer_set=noop_quantizer_set)
        return jnp.sum(out.astype(jnp.float32))

    with pallas_kernels(switch, assume_gpu=True):
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        lowered = step.lower(
            spec((4096, 1024), jnp.bfloat16), spec((1024, 4096)), spec((1024,)), spec((1024,))
        )
    calls = [line for line in lowered.compile().as_text().splitlines() if "mosaic_gpu_v2" in line]
    assert len(calls) == 1 and "te_flax_norm_backward" in calls[0]
