"""Recipes, the scale math, quantizer state updates, the factory and autocast."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax
from te_flax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    QuantizerSet,
    autocast,
    get_autocast_recipe,
    noop_quantizer_set,
    scaling,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


# ----------------------------------------------------------------------------- recipes


def test_formats_map_to_forward_and_backward_dtypes():
    assert Format.HYBRID.forward_dtype == E4M3 and Format.HYBRID.backward_dtype == E5M2
    assert Format.E4M3.forward_dtype == E4M3 and Format.E4M3.backward_dtype == E4M3


def test_recipe_defaults_match_transformer_engine():
    recipe = DelayedScaling()
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len) == (0, Format.HYBRID, 1024)
    assert recipe.amax_compute_algo == "max"
    assert Float8CurrentScaling().fp8_format == Format.HYBRID


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_e5m2_format_is_refused(cls):
    with pytest.raises(ValueError, match="cuBLASLt cannot"):
        cls(fp8_format=Format.E5M2)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_unknown_format_is_refused(cls):
    with pytest.raises(TypeError, match=r"must be a te_flax\.quantize\.Format"):
        cls(fp8_format="hybrid")


@pytest.mark.parametrize("length", [0, -3, 2.5, True])
def test_amax_history_len_must_be_positive_int(length):
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=length)


def test_unknown_amax_compute_algo_is_refused():
    with pytest.raises(ValueError, match='"max" or "most_recent"'):
        DelayedScaling(amax_compute_algo="mean")


def test_non_finite_margin_is_refused():
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=float("inf"))


# ----------------------------------------------------------------------------- scale math


def test_fp8_max_values():
    assert scaling.fp8_max(E4M3) == 448.0
    assert scaling.fp8_max(E5M2) == 57344.0


@pytest.mark.parametrize("bad_amax", [0.0, float("nan"), float("inf"), -float("inf")])
def test_zero_nan_and_inf_amax_keep_the_previous_scale(bad_amax):
    previous = jnp.float32(0.125)
    assert scaling.compute_scale_inv(jnp.float32(bad_amax), E4M3, 0, previous) == previous


def test_scale_inv_is_amax_over_fp8_max_with_margin():
    amax = jnp.float32(3.5)
    np.testing.assert_allclose(scaling.compute_scale_inv(amax, E4M3, 0, 1.0), 3.5 / 448, rtol=1e-7)
    np.testing.assert_allclose(
        scaling.compute_scale_inv(amax, E4M3, 2, 1.0), 4 * 3.5 / 448, rtol=1e-7
    )
    np.testing.assert_allclose(
        scaling.compute_scale_inv(amax, E5M2, 0, 1.0), 3.5 / 57344, rtol=1e-7
    )


@pytest.mark.parametrize("amax", [1e-44, 3e38])
def test_scale_never_becomes_zero_or_inf(amax):
    scale_inv = scaling.compute_scale_inv(jnp.float32(amax), E4M3, 8, jnp.float32(1.0))
    assert jnp.isfinite(scale_inv) and scale_inv > 0


def test_push_amax_puts_newest_first_and_drops_oldest():
    history = jnp.array([3.0, 2.0, 1.0])
    np.testing.assert_array_equal(scaling.push_amax(history, jnp.float32(4.0)), [4.0, 3.0, 2.0])


def test_push_amax_records_non_finite_amax_as_zero():
    history = jnp.array([3.0, 2.0])
    np.testing.assert_array_equal(scaling.push_amax(history, jnp.float32(jnp.nan)), [0.0, 3.0])


def test_quantize_saturates_instead_of_overflowing():
    x = jnp.array([1000.0, -1e6, 3.0])
    q = scaling.quantize(x, E4M3, jnp.float32(1.0))
    np.testing.assert_array_equal(q.astype(jnp.float32), [448.0, -448.0, 3.0])
    # bfloat16 input is divided in float32: the result equals quantizing the float32 value.
    xb = jnp.array([0.3, 7.0], jnp.bfloat16)
    scale = jnp.float32(1 / 3)
    np.testing.assert_array_equal(
        scaling.quantize(xb, E4M3, scale), scaling.quantize(xb.astype(jnp.float32), E4M3, scale)
    )


# ----------------------------------------------------------------------------- quantizers


def _delayed(length=3, algo="max", margin=0):
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    return DelayedScaleQuantizer.fresh(E4M3, recipe)


def test_fresh_delayed_state():
    quantizer = _delayed(length=5)
    np.testing.assert_array_equal(quantizer.scale_inv, [1.0])
    np.testing.assert_array_equal(quantizer.amax_history, np.zeros(5))
    assert quantizer.scale_inv.dtype == quantizer.amax_history.dtype == jnp.float32


def test_delayed_history_rolls_and_scale_follows_its_max():
    quantizer = _delayed(length=3)
    amaxes = [2.0, 5.0, 1.0, 0.5, 0.25]
    histories = [[2, 0, 0], [5, 2, 0], [1, 5, 2], [0.5, 1, 5], [0.25, 0.5, 1]]
    for amax, history in zip(amaxes, histories, strict=True):
        quantizer = quantizer.update(jnp.float32(amax))
        np.testing.assert_array_equal(quantizer.amax_history, history)
        np.testing.assert_allclose(quantizer.scale_inv, [max(history) / 448], rtol=1e-7)


def test_most_recent_uses_the_newest_amax():
    quantizer = _delayed(length=4, algo="most_recent")
    for amax in [8.0, 2.0]:
        quantizer = quantizer.update(jnp.float32(amax))
        np.testing.assert_allclose(quantizer.scale_inv, [amax / 448], rtol=1e-7)


def test_margin_leaves_headroom():
    quantizer = _delayed(margin=1).update(jnp.float32(7.0))
    np.testing.assert_allclose(quantizer.scale_inv, [2 * 7.0 / 448], rtol=1e-7)


def test_zero_amax_before_any_data_keeps_initial_scale():
    quantizer = _delayed().update(jnp.float32(0.0))
    np.testing.assert_array_equal(quantizer.scale_inv, [1.0])


def test_delayed_quantize_uses_stored_scale_and_records_amax():
    quantizer = dataclasses.replace(_delayed(), scale_inv=jnp.array([0.5]))
    x = jnp.array([1.0, -3.0, 96.0])
    operand, updated = quantizer.quantize(x)
    assert operand.data.dtype == E4M3 and operand.scale_inv == 0.5
    np.testing.assert_array_equal(operand.data.astype(jnp.float32), [2.0, -6.0, 192.0])
    np.testing.assert_array_equal(updated.amax_history, [96.0, 0, 0])


def test_current_scaling_uses_the_tensors_own_amax():
    x = jnp.array([0.5, -224.0, 3.0])
    operand, same = CurrentScaleQuantizer(E4M3).quantize(x)
    np.testing.assert_allclose(operand.scale_inv, 0.5, rtol=1e-7)
    np.testing.assert_array_equal(operand.data.astype(jnp.float32), [1.0, -448.0, 6.0])
    assert same == CurrentScaleQuantizer(E4M3)
    assert jax.tree.leaves(same) == []


# ----------------------------------------------------------------------------- factory, autocast


def test_factory_builds_hybrid_delayed_sets():
    qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=7))
    assert qs.x.q_dtype == E4M3 and qs.kernel.q_dtype == E4M3 and qs.dgrad.q_dtype == E5M2
    assert [leaf.shape for leaf in jax.tree.leaves(qs)] == [(1,), (7,)] * 3


def test_factory_builds_several_sets_and_current_scaling_sets():
    sets = QuantizerFactory.create_set(2, fp8_recipe=Float8CurrentScaling(fp8_format=Format.E4M3))
    assert len(sets) == 2
    assert all(isinstance(q, CurrentScaleQuantizer) for q in (sets[0].x, sets[1].dgrad))
    assert sets[0].dgrad.q_dtype == E4M3


def test_factory_without_recipe_is_noop_outside_autocast():
    assert QuantizerFactory.create_set() == noop_quantizer_set
    assert noop_quantizer_set.is_noop


def test_factory_reads_the_autocast_recipe():
    with autocast(enabled=True, recipe=Float8CurrentScaling()):
        assert isinstance(QuantizerFactory.create_set().x, CurrentScaleQuantizer)
        with autocast(enabled=False):
            assert QuantizerFactory.create_set().is_noop
        assert isinstance(get_autocast_recipe(), Float8CurrentScaling)
    assert get_autocast_recipe() is None


def test_autocast_enabled_without_recipe_means_delayed_scaling():
    with autocast(enabled=True):
        assert get_autocast_recipe() == DelayedScaling()


def test_autocast_is_part_of_the_jit_cache_key():
    # A function jitted outside autocast and called inside it is traced again for the recipe
    # instead of silently reusing the unquantized program, and the first trace is reused after.
    traced_recipes = []

    @jax.jit
    def scaled_twice(x):
        quantizer_set = QuantizerFactory.create_set()
        traced_recipes.append(type(quantizer_set.x).__name__)
        return x * 2

    x = jnp.ones(2)
    scaled_twice(x)
    with autocast(enabled=True, recipe=Float8CurrentScaling()):
        scaled_twice(x)
        with autocast(enabled=True, recipe=DelayedScaling()):
            scaled_twice(x)
    scaled_twice(x)
    assert traced_recipes == ["NoneType", "CurrentScaleQuantizer", "DelayedScaleQuantizer"]


def test_unknown_recipe_is_refused():
    with pytest.raises(TypeError, match="DelayedScaling, Float8CurrentScaling"):
        QuantizerFactory.create_set(fp8_recipe="delayed")
    with pytest.raises(TypeError, match="autocast"), autocast(enabled=True, recipe=Format.HYBRID):
        pass


def test_partial_quantizer_set_is_refused():
    qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
    with pytest.raises(ValueError, match="either fully FP8"):
        QuantizerSet(x=qs.x, kernel=qs.kernel).check()


def test_set_with_two_e5m2_operands_is_refused():
    e5 = CurrentScaleQuantizer(E5M2)
    with pytest.raises(ValueError, match="both float8_e5m2"):
        QuantizerSet(x=e5, kernel=e5, dgrad=CurrentScaleQuantizer(E4M3)).check()
    with pytest.raises(ValueError, match="only float8_e4m3fn and float8_e5m2"):
        QuantizerSet(x=e5, kernel=CurrentScaleQuantizer(jnp.bfloat16), dgrad=e5).check()


# ----------------------------------------------------------------------------- TE's factory API


def test_create_set_with_a_scaling_mode_builds_each_mode():
    from te_flax.quantize import QuantizeLayout, ScalingMode

    modes = {
        ScalingMode.DELAYED_TENSOR_SCALING: "DelayedScaleQuantizer",
        ScalingMode.CURRENT_TENSOR_SCALING: "CurrentScaleQuantizer",
        ScalingMode.MXFP8_1D_SCALING: "BlockScaleQuantizer",
        ScalingMode.FP8_1D_BLOCK_SCALING: "Float8BlockQuantizer",
        ScalingMode.NVFP4_2D_SCALING: "NVFP4Quantizer",
    }
    for mode, cls_name in modes.items():
        qs = QuantizerFactory.create_set(scaling_mode=mode, is_2x2x=True)
        assert type(qs.kernel).__name__ == cls_name and qs.kernel.scaling_mode is mode
        expected = jnp.float4_e2m1fn if mode.is_nvfp4_scaling else jnp.float8_e5m2
        assert jnp.dtype(qs.dgrad.q_dtype) == jnp.dtype(expected)
    assert QuantizerFactory.create_set(scaling_mode=ScalingMode.NO_SCALING).is_noop
    single = QuantizerFactory.create(
        scaling_mode=ScalingMode.FP8_2D_BLOCK_SCALING, q_layout=QuantizeLayout.ROWWISE_COLWISE
    )
    assert single.block_dims == 2
    assert QuantizerFactory.create(2, ScalingMode.NO_SCALING) == (None, None)


def test_recipes_give_their_scaling_modes():
    from te_flax.quantize import Float8BlockScaling, NVFP4BlockScaling, ScalingMode
    from te_flax.quantize.scaling_modes import recipe_scaling_modes

    for recipe in (DelayedScaling(), Float8BlockScaling(), NVFP4BlockScaling()):
        qs = QuantizerFactory.create_set(fp8_recipe=recipe, sr_key=jax.random.key(0))
        modes = tuple(q.scaling_mode for q in (qs.x, qs.kernel, qs.dgrad))
        assert modes == recipe_scaling_modes(recipe)
    assert recipe_scaling_modes(Float8BlockScaling())[1] is ScalingMode.FP8_2D_BLOCK_SCALING


def test_create_set_starts_delayed_state_from_a_quantize_meta_set():
    from te_flax.quantize import QuantizeMeta, QuantizeMetaSet

    history = jnp.arange(4.0)
    meta = QuantizeMeta(scale=jnp.full((1,), 8.0), amax_history=history)
    qs = QuantizerFactory.create_set(
        fp8_recipe=DelayedScaling(amax_history_len=4),
        quantize_meta_set=QuantizeMetaSet(x=meta, kernel=QuantizeMeta(), grad=QuantizeMeta()),
    )
    np.testing.assert_array_equal(qs.x.scale_inv, [0.125])
    np.testing.assert_array_equal(qs.x.amax_history, history)
    np.testing.assert_array_equal(qs.kernel.scale_inv, [1.0])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(scaling_mode="delayed"),
            TypeError,
            r"scaling_mode must be a te_flax\.quantize\.ScalingMode",
        ),
        (dict(fwd_dtype=jnp.float8_e4m3fn, fp8_recipe=DelayedScaling()), ValueError, r"fwd_dtype"),
        (dict(n_groups=0), ValueError, r"n_groups=\.\.\.\) must be a positive int, got 0"),
        (dict(n_groups=2.0), ValueError, r"n_groups=\.\.\.\) must be a positive int, got 2\.0"),
        (dict(is_2x2x=1), TypeError, r"is_2x2x must be None or a bool"),
    ],
)
def test_create_set_refuses(kwargs, error, message):
    with pytest.raises(error, match=message):
        QuantizerFactory.create_set(**kwargs)


def test_autocast_with_a_recipe_but_not_enabled_says_that_it_quantizes_nothing():
    # enabled defaults to False (TE's default): a recipe alone used to run in high precision
    # without a word.
    warns = pytest.warns(UserWarning, match=r"with enabled=False quantizes nothing")
    with warns, te_flax.autocast(recipe=DelayedScaling()):
        assert te_flax.quantize.get_autocast_recipe() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te_flax.autocast(enabled=False), te_flax.autocast(enabled=True):
            pass
