"""``te_flax.inspect_fp8()``: the statistics of every quantized GEMM operand (forward and
gradient), checked against values computed here from the tensors with ml_dtypes' own float8
casts; Linen and NNX, under ``jit`` and eagerly; and the compiled program outside the setting
unchanged."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import te_flax
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.dense import grouped_dense
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    QuantizerFactory,
)
from te_flax.quantize.inspection import slot_values, with_slot
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    fp8_stats_slots,
    init_optimizer,
    kept_statistics,
    value_and_grad,
)

RECIPE = DelayedScaling(amax_history_len=4)
E4M3_MAX = 448.0
TINY_E4M3 = 2.0**-12  # below half of e4m3's smallest subnormal (2**-9): quantizes to 0
TINY_E5M2 = 2.0**-20  # below half of e5m2's smallest subnormal (2**-16)


def _input_with_underflow() -> np.ndarray:
    """[4, 32]: 64 ones, 32 entries below e4m3's smallest subnormal, 16 of 2**-8, 16 zeros."""
    values = np.concatenate(
        [np.ones(64), np.full(32, TINY_E4M3), np.full(16, 2.0**-8), np.zeros(16)]
    )
    return np.random.default_rng(0).permutation(values).reshape(4, 32).astype(np.float32)


def _output_gradient() -> np.ndarray:
    """[4, 16]: half ones, half below e5m2's smallest subnormal."""
    values = np.concatenate([np.ones(32), np.full(32, TINY_E5M2)])
    return np.random.default_rng(1).permutation(values).reshape(4, 16).astype(np.float32)


def _underflow(x: np.ndarray, scale_inv: float, dtype) -> float:
    """The fraction of nonzero entries that ``dtype`` rounds to zero after scaling (ml_dtypes'
    cast, not te_flax's)."""
    scaled = (np.asarray(x, np.float32) / np.float32(scale_inv)).astype(dtype).astype(np.float32)
    nonzero = np.asarray(x) != 0
    return float(np.sum(nonzero & (scaled == 0)) / np.sum(nonzero))


def _loss(apply, variables, x, g):
    """A loss whose gradient with respect to the layer's output is ``g``."""
    return jnp.sum(apply(variables, x) * g)


def _check_training_statistics(stats, x, kernel, g):
    """A delayed-scaling step's statistics from a fresh state: every tensor scaled by 1."""
    assert float(stats["x_stats"]["amax"]) == 1.0
    assert float(stats["x_stats"]["scale_inv"]) == 1.0
    assert float(stats["x_stats"]["underflow"]) == pytest.approx(
        _underflow(x, 1.0, ml_dtypes.float8_e4m3fn)
    )
    assert float(stats["x_stats"]["underflow"]) == pytest.approx(32 / 112)
    assert float(stats["x_stats"]["saturation"]) == 0.0
    assert float(stats["kernel_stats"]["amax"]) == pytest.approx(float(np.abs(kernel).max()))
    assert float(stats["kernel_stats"]["underflow"]) == pytest.approx(
        _underflow(kernel, 1.0, ml_dtypes.float8_e4m3fn)
    )
    assert float(stats["grad_stats"]["amax"]) == 1.0
    assert float(stats["grad_stats"]["underflow"]) == pytest.approx(0.5)
    assert float(stats["grad_stats"]["underflow"]) == pytest.approx(
        _underflow(g, 1.0, ml_dtypes.float8_e5m2)
    )


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_linen_step_statistics_of_x_kernel_and_gradient(jit):
    layer = te_nn.DenseGeneral(features=16, use_bias=False, recipe=RECIPE)
    x, g = _input_with_underflow(), _output_gradient()
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
    slots = fp8_stats_slots(layer.apply, variables, x)
    assert set(slots) == {"x_stats", "kernel_stats", "grad_stats"}
    step = value_and_grad(lambda v, x, g: _loss(layer.apply, v, x, g))
    with te_flax.inspect_fp8():
        _, grads = (jax.jit(step) if jit else step)({**variables, "fp8_stats": slots}, x, g)
    kernel = np.asarray(variables["params"]["kernel"])
    _check_training_statistics(grads["fp8_stats"], x, kernel, g)
    # The parameters' gradients are those of the step without the statistics.
    _, plain = jax.jit(step)(variables, x, g)
    np.testing.assert_array_equal(grads["params"]["kernel"], plain["params"]["kernel"])


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_nnx_step_statistics_of_x_kernel_and_gradient(jit):
    layer = te_nnx.DenseGeneral(32, 16, use_bias=False, recipe=RECIPE, rngs=nnx.Rngs(0))
    x, g = _input_with_underflow(), _output_gradient()
    assert not nnx.state(layer, te_nnx.Fp8Stats)
    loss = lambda model, x, g: jnp.sum(model(x) * g)  # noqa: E731
    grad_fn = te_nnx.value_and_grad(loss, update_fp8_state=True)
    step = nnx.jit(grad_fn) if jit else grad_fn
    with te_flax.inspect_fp8():
        step(layer, x, g)  # the first call inside the setting makes the statistics variables
        _, grads = step(layer, x, g)
    stats = nnx.to_pure_dict(nnx.state(layer, te_nnx.Fp8Stats))
    assert set(stats) == {"x_stats", "kernel_stats", "grad_stats"}
    # The statistics are written into the model, never handed back as gradients.
    assert not nnx.state(grads, te_nnx.Fp8Stats)
    # The second step's delayed scale is the first step's amax over 448: recompute from it.
    assert float(stats["x_stats"]["scale_inv"]) == pytest.approx(1.0 / E4M3_MAX)
    assert float(stats["x_stats"]["underflow"]) == pytest.approx(
        _underflow(x, 1.0 / E4M3_MAX, ml_dtypes.float8_e4m3fn)
    )
    assert float(stats["grad_stats"]["amax"]) == 1.0
    scale = float(stats["grad_stats"]["scale_inv"])
    assert scale == pytest.approx(1.0 / 57344.0)
    assert float(stats["grad_stats"]["underflow"]) == pytest.approx(
        _underflow(g, scale, ml_dtypes.float8_e5m2)
    )
    kernel = np.asarray(layer.kernel[...])
    assert float(stats["kernel_stats"]["amax"]) == pytest.approx(float(np.abs(kernel).max()))


def _stale_input() -> np.ndarray:
    """[4, 32]: a quarter of the entries at 8 (3584 at a scale of 1/448: saturated), the rest
    at 0.5 (224: representable)."""
    values = np.concatenate([np.full(32, 8.0), np.full(96, 0.5)])
    return np.random.default_rng(2).permutation(values).reshape(4, 32).astype(np.float32)


def _stale_state(variables):
    """The x state as after steps whose amax was 1: scale_inv 1/448."""
    fp8 = dict(variables[OVERWRITE_WITH_GRADIENT])
    fp8["x_scale_inv"] = jnp.full((1,), 1.0 / E4M3_MAX, jnp.float32)
    fp8["x_amax_history"] = jnp.array([1.0, 0.0, 0.0, 0.0], jnp.float32)
    return {**variables, OVERWRITE_WITH_GRADIENT: fp8}


def test_stale_delayed_scale_saturates_a_known_fraction_linen():
    layer = te_nn.DenseGeneral(features=16, recipe=RECIPE)
    x = _stale_input()
    variables = _stale_state(nn.meta.unbox(layer.init(jax.random.key(0), x)))
    with te_flax.inspect_fp8():
        _, state = jax.jit(lambda v, x: layer.apply(v, x, mutable=["fp8_stats"]))(variables, x)
    stats = state["fp8_stats"]["x_stats"]
    # Independent: the entries whose scaled magnitude passes 448 by more than rounding.
    expected = np.mean(np.abs(x) * E4M3_MAX > E4M3_MAX + 16)
    assert expected == 0.25
    assert float(stats["saturation"]) == pytest.approx(expected)
    assert float(stats["amax"]) == 8.0
    assert float(stats["scale_inv"]) == pytest.approx(1.0 / E4M3_MAX)
    # Only the forward's tensors are written by an evaluation.
    assert float(state["fp8_stats"]["grad_stats"]["scale_inv"]) == 0.0


def test_stale_delayed_scale_saturates_a_known_fraction_nnx():
    layer = te_nnx.DenseGeneral(32, 16, recipe=RECIPE, rngs=nnx.Rngs(0))
    layer.x_scale_inv[...] = jnp.full((1,), 1.0 / E4M3_MAX, jnp.float32)
    layer.x_amax_history[...] = jnp.array([1.0, 0.0, 0.0, 0.0], jnp.float32)
    with te_flax.inspect_fp8():
        nnx.jit(lambda model, x: model(x))(layer, _stale_input())
    assert float(layer.x_stats.get_value()["saturation"]) == pytest.approx(0.25)


def test_mxfp8_block_scale_spread():
    # Blocks of 32 along the features: amax 1, 64, 2 and an empty block (not counted).
    x = np.zeros((2, 64), np.float32)
    x[0, :32], x[0, 32:], x[1, :32] = 1.0, 64.0, 2.0
    layer = te_nn.DenseGeneral(features=32, recipe=MXFP8BlockScaling())
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
    with te_flax.inspect_fp8():
        _, state = layer.apply(variables, x, mutable=["fp8_stats"])
    stats = state["fp8_stats"]["x_stats"]
    # MXFP8's power-of-two scale: the smallest at or above amax / 448.
    scales = 2.0 ** np.ceil(np.log2(np.array([1.0, 64.0, 2.0]) / E4M3_MAX))
    assert float(stats["block_scale_min"]) == scales.min()
    assert float(stats["block_scale_max"]) == scales.max()
    assert float(stats["block_scale_log2_range"]) == np.log2(scales.max() / scales.min()) == 6
    assert float(stats["saturation"]) == 0.0 and float(stats["underflow"]) == 0.0
    assert float(stats["scale_inv"]) == 1.0  # no tensor-wide scale


class _Twice(nn.Module):
    """One DenseGeneral applied to two inputs."""

    @nn.compact
    def __call__(self, a, b):
        layer = te_nn.DenseGeneral(features=8, recipe=Float8CurrentScaling(), name="shared")
        return layer(a) + layer(b)


def test_a_layer_applied_twice_reports_the_max_over_its_uses():
    model = _Twice()
    a, b = jnp.full((2, 16), 3.0), jnp.full((2, 16), -5.0)
    variables = nn.meta.unbox(model.init(jax.random.key(0), a, b))
    slots = fp8_stats_slots(model.apply, variables, a, b)
    with te_flax.inspect_fp8():
        _, grads = jax.jit(value_and_grad(lambda v: jnp.sum(model.apply(v, a, b))))(
            {**variables, "fp8_stats": slots}
        )
    stats = grads["fp8_stats"]["shared"]
    assert float(stats["x_stats"]["amax"]) == 5.0  # max, not the sum 8
    assert float(stats["grad_stats"]["amax"]) == 1.0


@pytest.mark.parametrize("lowering", ["ragged", "capacity"])
def test_grouped_dense_statistics_per_group(lowering):
    groups, rows = 3, 12
    x = jnp.concatenate([jnp.full((4, 16), 1.0), jnp.full((4, 16), 2.0), jnp.full((4, 16), 7.0)])
    x = x.at[0, 0].set(2.0**-20)  # group 0: 448 * 2**-20 quantizes to zero
    kernel = jax.random.normal(jax.random.key(0), (groups, 16, 8))
    sizes = jnp.array([4, 4, 4], jnp.int32)
    base = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling())
    qs = with_slot(base, slot_values(base, groups))

    def loss(qs):
        return jnp.sum(grouped_dense(x, kernel, sizes, quantizer_set=qs, lowering=lowering))

    with te_flax.inspect_fp8():
        stats = jax.jit(jax.grad(loss))(qs).stats.values
    np.testing.assert_allclose(stats["x"]["amax"], [1.0, 2.0, 7.0])
    np.testing.assert_allclose(stats["x"]["scale_inv"], np.array([1.0, 2.0, 7.0]) / E4M3_MAX)
    # Current scaling per group: one of group 0's 64 entries is below the smallest subnormal.
    np.testing.assert_allclose(stats["x"]["underflow"], [1 / 64, 0.0, 0.0])
    np.testing.assert_allclose(
        stats["kernel"]["amax"], np.abs(np.asarray(kernel)).max(axis=(1, 2)), rtol=1e-6
    )
    np.testing.assert_allclose(stats["grad"]["amax"], [1.0, 1.0, 1.0])
    assert rows == x.shape[0]


def test_apply_gradients_writes_the_statistics_and_keeps_them_from_the_optimizer():
    layer = te_nn.DenseGeneral(features=16, recipe=RECIPE)
    x, g = _input_with_underflow(), _output_gradient()
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
    variables = {**variables, "fp8_stats": fp8_stats_slots(layer.apply, variables, x)}
    tx = optax.adamw(1e-3)
    opt_state = init_optimizer(tx, variables)
    assert "fp8_stats" not in str(jax.tree_util.tree_structure(opt_state))

    @jax.jit
    def step(variables, opt_state):
        _, grads = value_and_grad(lambda v: _loss(layer.apply, v, x, g))(variables)
        return apply_gradients(tx, variables, grads, opt_state)

    with te_flax.inspect_fp8():
        variables, opt_state = step(variables, opt_state)
    assert float(variables["fp8_stats"]["grad_stats"]["underflow"]) == pytest.approx(0.5)
    # Outside the setting no statistic is measured: the last ones are kept.
    before = jax.tree.map(np.asarray, variables["fp8_stats"])
    variables, _ = step(variables, opt_state)
    jax.tree.map(np.testing.assert_array_equal, variables["fp8_stats"], before)


def test_kept_statistics_keeps_what_the_step_did_not_measure():
    old = {"a": {"x_stats": {"amax": 2.0, "scale_inv": 0.5}}, "b": {"x_stats": {"amax": 3.0,
           "scale_inv": 0.25}}}  # fmt: skip
    new = {"a": {"x_stats": {"amax": 4.0, "scale_inv": 1.0}}, "b": {"x_stats": {"amax": 0.0,
           "scale_inv": 0.0}}}  # fmt: skip
    kept = jax.tree.map(float, kept_statistics(new, old))
    assert kept == {"a": new["a"], "b": old["b"]}


def _train_step_text(apply, variables, x, g):
    step = jax.jit(value_and_grad(lambda v, x, g: _loss(apply, v, x, g)))
    return step.lower(variables, x, g).as_text()


def test_outside_the_setting_the_program_is_unchanged():
    layer = te_nn.LayerNormMLP(intermediate_dim=32, recipe=RECIPE)
    x = jax.random.normal(jax.random.key(0), (4, 16))
    g = jnp.ones((4, 16))

    def apply(variables, x):
        return layer.apply(variables, x)[0]

    variables = nn.meta.unbox(layer.init(jax.random.key(1), x))
    before = _train_step_text(apply, variables, x, g)
    compiled_before = jax.jit(apply).lower(variables, x).compile().as_text()
    slots = fp8_stats_slots(layer.apply, variables, x)
    with te_flax.inspect_fp8():
        inside = _train_step_text(apply, {**variables, "fp8_stats": slots}, x, g)
        jax.jit(apply)(variables, x)
    assert inside != before  # the statistics are in the program inside the setting
    assert _train_step_text(apply, variables, x, g) == before
    assert jax.jit(apply).lower(variables, x).compile().as_text() == compiled_before


def test_outside_the_setting_the_nnx_step_is_unchanged():
    layer = te_nnx.DenseGeneral(16, 8, recipe=RECIPE, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 16))

    def text(model):
        grad_fn = te_nnx.value_and_grad(lambda m, x: jnp.sum(m(x)))
        return nnx.jit(grad_fn).lower(model, x).as_text()

    before = text(layer)
    with te_flax.inspect_fp8():
        nnx.jit(lambda m, x: m(x))(layer, x)  # the model now holds statistics variables
    # They are state the model's programs carry through untouched; without them the program
    # is the one from before the setting was used.
    assert nnx.state(layer, te_nnx.Fp8Stats)
    nnx.pop(layer, te_nnx.Fp8Stats)
    assert text(layer) == before


def test_table_and_plot(tmp_path):
    layer = te_nn.LayerNormMLP(intermediate_dim=32, recipe=RECIPE)
    x = jnp.ones((4, 16))
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
    with te_flax.inspect_fp8():
        _, state = layer.apply(variables, x, mutable=["fp8_stats"])
    table = te_flax.fp8_stats_table(state["fp8_stats"])
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["layer", "tensor", "amax", "scale_inv", "saturation",
                                    "underflow"]  # fmt: skip
    assert {line.split()[0] for line in lines[1:]} == {"x_0", "kernel_0", "grad_0", "x_1",
                                                       "kernel_1", "grad_1"}  # fmt: skip
    assert "not measured" in table  # the gradients: an evaluation measures none
    history = [(step, jax.device_get(state["fp8_stats"])) for step in (1, 2, 3)]
    figure = te_flax.plot_fp8_stats(history, tmp_path / "health.png")
    assert (tmp_path / "health.png").stat().st_size > 0
    # Saturation and underflow of x and the kernel (an evaluation measures no gradient).
    assert len(figure.axes) == 2 * 2
    with pytest.raises(ValueError, match="no FP8 statistics found"):
        te_flax.fp8_stats_table(variables)


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    stats = {"x_stats": {"amax": 1.0, "scale_inv": 1.0, "saturation": 0.0, "underflow": 0.0}}
    with pytest.raises(ImportError, match="pip install matplotlib"):
        te_flax.plot_fp8_stats([(0, stats)])
