"""grouped_dense against a per-group loop of dense: values, gradients and FP8 state.

Each group of rows times its own kernel must give what ``dense`` gives on that group's rows with
that group's slice of the quantizer state, in both lowerings, for every recipe; the new state
comes back with one entry per group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax.dense import dense, grouped_dense, grouped_quantizer_set
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    merge_by_max,
    noop_quantizer_set,
)
from tests.helpers import (
    BLOCK_BACKWARD_TOLERANCE,
    BLOCK_FORWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    assert_close,
    normal,
    relative_error,
)

ROWS, HIDDEN, FEATURES, GROUPS = 16, 32, 32, 3
# An empty group, and two rows past the groups' total (they belong to no group).
SIZES = (5, 0, 9)
# Block-scaled recipes quantize wgrad's operands in blocks of rows: groups of whole blocks.
BLOCK_ROWS, BLOCK_SIZES = 96, (32, 0, 32)
LOWERINGS = ("ragged", "capacity")
RECIPES = {
    "none": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _inputs(rows: int = ROWS, sizes: tuple[int, ...] = SIZES):
    keys = jax.random.split(jax.random.key(0), 4)
    x = normal(keys[0], (rows, HIDDEN))
    kernel = normal(keys[1], (GROUPS, HIDDEN, FEATURES), scale=HIDDEN**-0.5)
    bias = normal(keys[2], (GROUPS, FEATURES))
    # The first group's gradient is 100x smaller than the others': per-group scales keep it
    # from costing the rest precision.
    row_scale = jnp.where(jnp.arange(rows) < sizes[0], 1.0, 100.0)
    cotangent = normal(keys[3], (rows, FEATURES)) * row_scale[:, None]
    return x, kernel, bias, cotangent


def _quantizer_set(recipe):
    if recipe is None:
        return noop_quantizer_set
    return grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)


def _group(state, g):
    """Group ``g``'s set: the ``g``-th of each grouped quantizer's ``quantizers``."""
    return dataclasses.replace(
        state,
        x=state.x.quantizers[g],
        kernel=state.kernel.quantizers[g],
        dgrad=state.dgrad.quantizers[g],
    )


def _grouped_step(x, kernel, bias, cotangent, state, sizes, lowering, capacity=None):
    sizes = jnp.array(sizes, jnp.int32)  # traced: one program for all sizes
    return _grouped_step_jit(x, kernel, bias, cotangent, state, sizes, lowering, capacity)


@functools.partial(jax.jit, static_argnames=("lowering", "capacity"))
def _grouped_step_jit(x, kernel, bias, cotangent, state, sizes, lowering, capacity):
    def loss(x, kernel, bias, state):
        out = grouped_dense(
            x,
            kernel,
            sizes,
            bias=bias,
            quantizer_set=state,
            lowering=lowering,
            capacity=capacity,
        )
        return jnp.sum(out * cotangent), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, kernel, bias, state)


@functools.partial(jax.jit, static_argnames=("sizes",))
def _loop_step(x, kernel, bias, cotangent, state, sizes):
    """The same step as a loop of ``dense`` over groups. An empty group runs on a block of zero
    rows (amax 0, no gradient), so its state steps as the grouped op's does."""

    def loss(x, kernel, bias, state):
        outs, start = [], 0
        for g, size in enumerate(sizes):
            rows = x[start : start + size] if size else jnp.zeros((32, HIDDEN), x.dtype)
            group_state = state if state.is_noop else _group(state, g)
            out = dense(rows, kernel[g], bias[g], quantizer_set=group_state)
            outs.append(out[:size])
            start += size
        outs.append(jnp.zeros((x.shape[0] - start, FEATURES), x.dtype))
        out = jnp.concatenate(outs)
        return jnp.sum(out * cotangent), out

    # Each group reads its own slice of the state, so the state's gradient stacks the groups'.
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, kernel, bias, state)


def _two_steps(step, state, sizes, **kwargs):
    """Two steps, the second with the state the first produced (scales that are not 1)."""
    x, kernel, bias, cotangent = _inputs(BLOCK_ROWS if sizes == BLOCK_SIZES else ROWS, sizes)
    kwargs["sizes"] = sizes
    _, grads = step(x, kernel, bias, cotangent, state, **kwargs)
    state = grads[3] if not state.is_noop else state
    return step(x, kernel, bias, cotangent, state, **kwargs)


# NVFP4's ragged lowering scales all rows with one tensor scale (and Hadamard-transforms blocks
# of rows that may straddle groups): not a per-group loop (see test_nvfp4_ragged).
@pytest.mark.parametrize(
    ("recipe", "lowering"),
    [
        (r, lowering)
        for r in RECIPES
        for lowering in LOWERINGS
        if (r, lowering) != ("nvfp4", "ragged")
    ],
)
def test_matches_a_loop_of_dense(recipe, lowering):
    state = _quantizer_set(RECIPES[recipe])
    sizes = BLOCK_SIZES if recipe in ("mxfp8", "nvfp4") else SIZES
    (_, out), grads = _two_steps(_grouped_step, state, sizes, lowering=lowering)
    (_, expected_out), expected = _two_steps(_loop_step, state, sizes)
    # Same quantization, same products: equal up to the summation order of the GEMMs.
    tol = 1e-5 if recipe == "none" else 1e-3
    assert_close(out, expected_out, tol, "output")
    for name, actual, want in zip(("x", "kernel", "bias"), grads[:3], expected[:3], strict=True):
        assert_close(actual, want, tol, f"d_{name}")
    if recipe == "delayed":
        # One scale per group: the state's leaves are [G, ...], and each group's entry is what
        # dense gave that group (histories newest first).
        for (path, actual), want in zip(
            jax.tree_util.tree_flatten_with_path(grads[3])[0],
            jax.tree.leaves(expected[3]),
            strict=True,
        ):
            assert actual.shape[0] == GROUPS, path
            np.testing.assert_allclose(actual, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
        # The empty group saw no rows: its x and grad amax are 0 (the scale is kept).
        assert float(grads[3].x.quantizer.amax_history[1, 0]) == 0.0
        assert float(grads[3].dgrad.quantizer.amax_history[1, 0]) == 0.0


def test_nvfp4_ragged():
    """NVFP4 on the ragged lowering: within NVFP4's tolerance of the unquantized op."""
    x, kernel, bias, cotangent = _inputs(BLOCK_ROWS, BLOCK_SIZES)
    state = _quantizer_set(RECIPES["nvfp4"])
    (_, out), grads = _grouped_step(
        x, kernel, bias, cotangent, state, sizes=BLOCK_SIZES, lowering="ragged"
    )
    (_, exact), exact_grads = _grouped_step(
        x, kernel, bias, cotangent, noop_quantizer_set, sizes=BLOCK_SIZES, lowering="ragged"
    )
    assert relative_error(out, exact) < BLOCK_FORWARD_TOLERANCE["nvfp4"]
    for actual, want in zip(grads[:2], exact_grads[:2], strict=True):
        assert relative_error(actual, want) < BLOCK_BACKWARD_TOLERANCE["nvfp4"]


def test_rows_past_the_groups_and_empty_groups():
    x, kernel, bias, cotangent = _inputs()
    state = _quantizer_set(RECIPES["delayed"])
    (_, out), (d_x, d_kernel, d_bias, _) = _grouped_step(
        x, kernel, bias, cotangent, state, sizes=SIZES, lowering="ragged"
    )
    np.testing.assert_array_equal(out[sum(SIZES) :], 0.0)
    np.testing.assert_array_equal(d_x[sum(SIZES) :], 0.0)
    # The empty group gets no kernel or bias gradient.
    np.testing.assert_array_equal(d_kernel[1], 0.0)
    np.testing.assert_array_equal(d_bias[1], 0.0)
    # The bias gradient of a group is its rows' output gradient summed.
    np.testing.assert_allclose(d_bias[2], cotangent[5:14].sum(0), rtol=1e-5)


def test_all_rows_in_one_group():
    x, kernel, bias, cotangent = _inputs()
    sizes = (0, ROWS, 0)
    state = _quantizer_set(RECIPES["current"])
    (_, out), (d_x, d_kernel, d_bias, _) = _grouped_step(
        x, kernel, bias, cotangent, state, sizes=sizes, lowering="ragged"
    )

    def loss(x, kernel, bias):
        out = dense(x, kernel, bias, quantizer_set=_group(state, 1))
        return jnp.sum(out * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, expected), (e_x, e_kernel, e_bias) = step(x, kernel[1], bias[1])
    assert_close(out, expected, 1e-3)
    assert_close(d_x, e_x, 1e-3)
    assert_close(d_kernel[1], e_kernel, 1e-3)
    assert_close(d_bias[1], e_bias, 1e-5)
    np.testing.assert_array_equal(d_kernel[0], 0.0)
    np.testing.assert_array_equal(d_kernel[2], 0.0)


def test_capacity_drops_the_rows_past_it():
    x, kernel, bias, cotangent = _inputs()
    (_, out), (d_x, *_) = _grouped_step(
        x, kernel, bias, cotangent, noop_quantizer_set, sizes=SIZES, lowering="capacity", capacity=4
    )
    (_, exact), _ = _grouped_step(
        x, kernel, bias, cotangent, noop_quantizer_set, sizes=SIZES, lowering="ragged"
    )
    kept = np.r_[0:4, 5:9]  # the first 4 rows of groups 0 and 2
    dropped = np.r_[4:5, 9:ROWS]
    assert_close(out[kept], exact[kept], 1e-5)
    np.testing.assert_array_equal(out[dropped], 0.0)
    np.testing.assert_array_equal(d_x[dropped], 0.0)


def test_per_group_scales_keep_small_groups_precise():
    """Group 0's gradient is 100x smaller than group 2's: with one scale per group its wgrad
    is as accurate as group 2's (one shared e5m2 scale would flush much of it)."""
    x, kernel, bias, cotangent = _inputs()
    state = _quantizer_set(RECIPES["current"])
    _, (_, d_kernel, _, _) = _grouped_step(
        x, kernel, bias, cotangent, state, sizes=SIZES, lowering="ragged"
    )
    _, (_, exact, _, _) = _grouped_step(
        x, kernel, bias, cotangent, noop_quantizer_set, sizes=SIZES, lowering="ragged"
    )
    for g in (0, 2):
        assert relative_error(d_kernel[g], exact[g]) < FP8_FORWARD_TOLERANCE


def test_reused_state_merges_by_max():
    """One grouped state read by two calls: its update is the elementwise max of the two."""
    x, kernel, bias, _ = _inputs()
    sizes = jnp.array(SIZES, jnp.int32)
    state = _quantizer_set(RECIPES["delayed"])

    def update(state, scales):
        def loss(state):
            state = merge_by_max(state)
            return sum(
                jnp.sum(grouped_dense(x * s, kernel, sizes, bias=bias, quantizer_set=state))
                for s in scales
            )

        return jax.jit(jax.grad(loss))(state)

    both = update(state, (1.0, 3.0))
    alone = [update(state, (s,)) for s in (1.0, 3.0)]
    for merged, first, second in zip(*map(jax.tree.leaves, (both, *alone)), strict=True):
        np.testing.assert_array_equal(merged, np.maximum(first, second))


def test_grouped_quantizer_set_and_ungrouped_state():
    qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=8))
    grouped = grouped_quantizer_set(qs, GROUPS)
    assert grouped.kernel.quantizer.scale_inv.shape == (GROUPS, 1)
    assert grouped.dgrad.quantizer.amax_history.shape == (GROUPS, 8)
    again = grouped_quantizer_set(grouped, GROUPS)  # already grouped: the same quantizers
    assert (again.x, again.kernel, again.dgrad) == (grouped.x, grouped.kernel, grouped.dgrad)
    x, kernel, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"grouped_quantizer_set\(quantizer_set, n_groups=3\)"):
        grouped_dense(x, kernel, jnp.array(SIZES, jnp.int32), quantizer_set=qs)


def test_traced_sizes_are_cut_at_the_rows():
    """Under jit the sizes are not known when the call is checked: a negative size counts as
    0 and the groups end at x's last row."""
    x, kernel, _, _ = _inputs()
    run = jax.jit(lambda sizes: grouped_dense(x, kernel, sizes))
    out = run(jnp.array([-3, 10, 20], jnp.int32))
    expected = run(jnp.array([0, 10, 6], jnp.int32))
    np.testing.assert_array_equal(out, expected)


def test_capacity_lowering_with_the_quantize_kernel():
    """On GPUs the capacity lowering quantizes each expert's kernel with te_flax's Pallas
    kernel, batched over experts by vmap: the same values and state as the XLA stage (the
    kernel in interpret mode here)."""
    from te_flax._ops.kernels import pallas_kernels

    x, kernel, _, cotangent = _inputs()
    state = _quantizer_set(RECIPES["delayed"])
    results = []
    for setting in ("1", "0"):
        with pallas_kernels(setting):
            step = jax.jit(
                jax.grad(
                    lambda k, s: jnp.sum(
                        grouped_dense(
                            x, k, jnp.array(SIZES, jnp.int32), quantizer_set=s, lowering="capacity"
                        )
                        * cotangent
                    ),
                    argnums=(0, 1),
                )
            )
            results.append(step(kernel, state))
    for with_kernel, without in zip(*map(jax.tree.leaves, results), strict=True):
        np.testing.assert_array_equal(with_kernel, without)


def test_blockwise_matches_a_loop_of_dense():
    """Float8BlockScaling (128-wide tiles, 128x128 kernel blocks) on both lowerings: groups of
    whole 128-row tiles, so each group's tiles are the ones dense makes of its rows."""
    rows, width, sizes = 384, 128, (128, 0, 128)
    keys = jax.random.split(jax.random.key(1), 3)
    x = normal(keys[0], (rows, width))
    kernel = normal(keys[1], (GROUPS, width, width), scale=width**-0.5)
    cotangent = normal(keys[2], (rows, width))
    state = QuantizerFactory.create_set(fp8_recipe=Float8BlockScaling())

    def loop(x, kernel):
        out = jnp.concatenate(
            [
                dense(x[:128], kernel[0], quantizer_set=state),
                dense(x[128:256], kernel[2], quantizer_set=state),
                jnp.zeros((128, width), x.dtype),
            ]
        )
        return jnp.sum(out * cotangent)

    expected = jax.jit(jax.value_and_grad(loop, argnums=(0, 1)))(x, kernel)
    for lowering in LOWERINGS:

        def loss(x, kernel, lowering=lowering):
            out = grouped_dense(
                x, kernel, jnp.array(sizes, jnp.int32), quantizer_set=state, lowering=lowering
            )
            return jnp.sum(out * cotangent)

        actual = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, kernel)
        for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            assert_close(got, want, 1e-3, lowering)
