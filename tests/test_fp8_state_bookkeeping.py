"""The step-level FP8 state bookkeeping, checked across variables at once: the summed-update
check and the keep-unused rule see each variable (and each layer of a scanned stack) alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax.quantize import check_merged
from te_flax.training import keep_unused


def test_check_merged_names_only_the_summed_histories_with_their_factor():
    old = {
        "a_amax_history": jnp.array([1.0, 2.0, 3.0]),  # length 3
        "b_amax_history": jnp.array([[1.0, 2.0], [4.0, 8.0]]),  # a scanned pair, length 2
        "c_amax_history": jnp.array([0.5, 0.5, 0.5, 0.5]),  # length 4
        "c_scale_inv": jnp.array([1.0]),
    }
    new = {
        "a_amax_history": jnp.array([5.0, 1.0, 2.0]),  # one use's update: passes
        "b_amax_history": jnp.array([[9.0, 1.0], [9.0, 12.0]]),  # second layer summed (3x)
        "c_amax_history": jnp.array([1.0, 1.0, 1.0, 1.0]),  # summed (2x)
        "c_scale_inv": jnp.array([7.0]),
    }
    with pytest.raises(ValueError, match="summed over its uses") as error:
        check_merged(old, new)
    message = str(error.value)
    assert "'a_amax_history'" not in message
    assert "['b_amax_history'] (3x)" in message and "['c_amax_history'] (2x)" in message
    check_merged(
        old,
        {
            **new,
            "b_amax_history": old["b_amax_history"] * 0,
            "c_amax_history": old["c_amax_history"] * 0,
        },
    )


def test_keep_unused_decides_each_variable_alone():
    old = {"h1": jnp.ones((2, 3)), "h2": jnp.full((2, 3), 2.0), "s": jnp.array([4.0])}
    new = {"h1": jnp.zeros((2, 3)), "h2": jnp.array([[0.0, 0, 0], [5, 0, 0]]), "s": jnp.zeros(1)}
    kept = keep_unused(new, old)
    np.testing.assert_array_equal(kept["h1"], old["h1"])  # no update: the old value
    np.testing.assert_array_equal(kept["h2"], new["h2"])  # one nonzero row: the update
    np.testing.assert_array_equal(kept["s"], old["s"])
    assert kept["h1"].dtype == jnp.float32 and kept["s"].shape == (1,)


def test_keep_unused_decides_a_quantizer_by_its_scale():
    """A quantizer whose new scale_inv is zero keeps its scale and its history (Linen leaves
    and NNX Fp8Meta states alike); one with a scale takes both, even an all-zero history."""
    from flax import nnx

    import te_flax.nnx as te_nnx
    from te_flax.nnx._fp8_meta import Fp8Meta
    from te_flax.quantize import DelayedScaling

    old = {
        "used": {"x_amax_history": jnp.ones(4), "x_scale_inv": jnp.ones(1)},
        "unused": {"x_amax_history": jnp.full(4, 2.0), "x_scale_inv": jnp.full(1, 3.0)},
    }
    new = {
        "used": {"x_amax_history": jnp.zeros(4), "x_scale_inv": jnp.full(1, 0.5)},
        "unused": {"x_amax_history": jnp.array([0.0, 7, 0, 0]), "x_scale_inv": jnp.zeros(1)},
    }
    kept = keep_unused(new, old)
    np.testing.assert_array_equal(kept["used"]["x_amax_history"], jnp.zeros(4))
    np.testing.assert_array_equal(kept["used"]["x_scale_inv"], [0.5])
    np.testing.assert_array_equal(kept["unused"]["x_amax_history"], old["unused"]["x_amax_history"])
    np.testing.assert_array_equal(kept["unused"]["x_scale_inv"], [3.0])

    layer = te_nnx.DenseGeneral(8, 4, recipe=DelayedScaling(amax_history_len=4), rngs=nnx.Rngs(0))
    state = nnx.state(layer, Fp8Meta)
    zeros = jax.tree.map(jnp.zeros_like, state)
    grown = jax.tree.map(lambda leaf: leaf + 1.0, state)
    kept = keep_unused(zeros, grown)
    for old_leaf, kept_leaf in zip(jax.tree.leaves(grown), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(kept_leaf, old_leaf)
