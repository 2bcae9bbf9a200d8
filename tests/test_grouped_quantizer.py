"""TransformerEngine's grouped quantizer API: ``QuantizerFactory.create(n_groups=G)``,
``create_set(n_groups=G)``, a module's ``generate_quantizer_set(n_groups=G)`` and
``te_flax.dense.grouped_quantizer_set``, one implementation, and their use in ``grouped_dense``.
(``tests/parity/test_quantizer_api.py`` compares the sets with TransformerEngine's own.)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax
from te_flax.dense import grouped_dense, grouped_quantizer_set
from te_flax.linen import TransformerEngineBase
from te_flax.quantize import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    DelayedScaling,
    Float8CurrentScaling,
    GroupedQuantizer,
    MXFP8BlockScaling,
    QuantizeLayout,
    QuantizerFactory,
    QuantizerSet,
    ScalingMode,
)
from tests.helpers import normal

# Groups of whole 32-row blocks (MXFP8's wgrad contracts the rows), an empty one, and rows past
# the groups' total.
GROUPS, ROWS, HIDDEN, FEATURES = 3, 96, 32, 32
SIZES = jnp.array([32, 0, 32], jnp.int32)
E4M3 = jnp.float8_e4m3fn
RECIPES = {
    "delayed": (DelayedScaling(amax_history_len=4), DelayedScaleQuantizer),
    "current": (Float8CurrentScaling(), CurrentScaleQuantizer),
    "mxfp8": (MXFP8BlockScaling(), BlockScaleQuantizer),
}


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    x = normal(keys[0], (ROWS, HIDDEN))
    kernel = normal(keys[1], (GROUPS, HIDDEN, FEATURES), scale=HIDDEN**-0.5)
    cotangent = normal(keys[2], (ROWS, FEATURES))
    return x, kernel, cotangent


@jax.jit
def _step(x, kernel, cotangent, quantizer_set):
    def loss(x, kernel, quantizer_set):
        return jnp.sum(grouped_dense(x, kernel, SIZES, quantizer_set=quantizer_set) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, kernel, quantizer_set)


@pytest.mark.parametrize("name", RECIPES)
def test_create_set_with_n_groups_holds_one_quantizer_per_group(name):
    recipe, kind = RECIPES[name]
    qs = QuantizerFactory.create_set(fp8_recipe=recipe, n_groups=GROUPS)
    forward, backward = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    for role, dtype in (("x", forward), ("kernel", forward), ("dgrad", backward)):
        grouped = getattr(qs, role)
        assert isinstance(grouped, GroupedQuantizer), role
        assert grouped.n_groups == GROUPS and len(grouped.quantizers) == GROUPS
        assert grouped.q_dtype == jnp.dtype(dtype)
        assert grouped.scaling_mode is kind.scaling_mode
        assert grouped.q_layout is QuantizeLayout.ROWWISE_COLWISE
        assert grouped.data_layout == ("NN" if name == "mxfp8" else "NT")
        assert all(type(q) is kind for q in grouped.quantizers)
    if name == "delayed":
        assert qs.x.quantizer.scale_inv.shape == (GROUPS, 1)
        assert qs.x.quantizer.amax_history.shape == (GROUPS, 4)
        assert [q.amax_history.shape for q in qs.dgrad.quantizers] == [(4,)] * GROUPS


def test_create_set_is_grouped_quantizer_set_of_the_plain_set():
    recipe = DelayedScaling(amax_history_len=4)
    factory = QuantizerFactory.create_set(fp8_recipe=recipe, n_groups=GROUPS, checkpoint_name="q")
    spelled = grouped_quantizer_set(
        QuantizerFactory.create_set(fp8_recipe=recipe, checkpoint_name="q"), GROUPS
    )
    assert jax.tree.structure(factory) == jax.tree.structure(spelled)
    for a, b in zip(jax.tree.leaves(factory), jax.tree.leaves(spelled), strict=True):
        np.testing.assert_array_equal(a, b)
    assert factory.x.checkpoint_name == "q" == factory.checkpoint_name


def test_create_set_with_n_groups_and_a_scaling_mode_as_maxtext_calls_it():
    """MaxText's ``te_mxfp8`` MoE set: tokens' quantizers for ``fsdp x experts`` groups, the
    experts' kernel for ``experts`` groups, in one set; the stateless MXFP8 quantizers scale
    each block on its own, so grouped_dense gives what plain MXFP8 quantizers give."""

    def grouped(n_groups):
        return QuantizerFactory.create_set(
            scaling_mode=ScalingMode.MXFP8_1D_SCALING,
            fwd_dtype=E4M3,
            bwd_dtype=E4M3,
            is_2x2x=True,
            n_groups=n_groups,
        )

    tokens, experts = grouped(2 * GROUPS), grouped(GROUPS)
    mixed = QuantizerSet(x=tokens.x, kernel=experts.kernel, dgrad=tokens.dgrad)
    plain = QuantizerFactory.create_set(
        scaling_mode=ScalingMode.MXFP8_1D_SCALING, fwd_dtype=E4M3, bwd_dtype=E4M3
    )
    x, kernel, cotangent = _inputs()
    expected = _step(x, kernel, cotangent, plain)
    actual = _step(x, kernel, cotangent, mixed)
    np.testing.assert_array_equal(actual[0], expected[0])
    for a, b in zip(actual[1][:2], expected[1][:2], strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(actual[1][2]) == jax.tree.structure(mixed)


def test_grouped_dense_returns_the_new_state_in_the_grouped_set():
    """The gradient of a grouped set is the grouped set with each group's new state, the same
    values as the stacked state grouped_dense runs on."""
    recipe = DelayedScaling(amax_history_len=4)
    qs = QuantizerFactory.create_set(fp8_recipe=recipe, n_groups=GROUPS)
    x, kernel, cotangent = _inputs()
    _, (_, _, new) = _step(x, kernel, cotangent, qs)
    assert isinstance(new.x, GroupedQuantizer) and new.x.n_groups == GROUPS
    # Each group's newest amax is its rows' max |x|; the empty group's is 0.
    rows = np.split(np.asarray(x)[: int(SIZES.sum())], np.cumsum(SIZES)[:-1])
    amaxes = [np.abs(r).max() if r.size else 0.0 for r in rows]
    newest = [float(q.amax_history[0]) for q in new.x.quantizers]
    np.testing.assert_allclose(newest, amaxes, rtol=1e-6)
    # A second step with the new state reads each group's own scale.
    _, (_, _, newer) = _step(x, kernel, cotangent, new)
    np.testing.assert_allclose(newer.x.quantizer.amax_history[:, 1], newest, rtol=1e-6)


def test_create_with_n_groups():
    grouped = QuantizerFactory.create(
        scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING,
        q_dtype=E4M3,
        n_groups=GROUPS,
        scale=jnp.full((1,), 4.0, jnp.float32),
        amax_history=jnp.arange(8.0),
    )
    assert isinstance(grouped, GroupedQuantizer) and grouped.n_groups == GROUPS
    for quantizer in grouped.quantizers:  # the given state starts every group
        np.testing.assert_array_equal(quantizer.scale_inv, [0.25])
        np.testing.assert_array_equal(quantizer.amax_history, np.arange(8.0))
    with pytest.warns(UserWarning, match="more than one GroupedQuantizer"):
        two = QuantizerFactory.create(
            2, scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, n_groups=GROUPS
        )
    assert len(two) == 2 and all(isinstance(q, GroupedQuantizer) for q in two)
    assert QuantizerFactory.create(scaling_mode=ScalingMode.NO_SCALING, n_groups=GROUPS) is None
    assert QuantizerFactory.create_set(n_groups=GROUPS).is_noop  # no recipe: no quantization


def test_layouts_without_is_2x2x_are_transformer_engines():
    qs = QuantizerFactory.create_set(
        scaling_mode=ScalingMode.MXFP8_1D_SCALING, is_2x2x=False, n_groups=GROUPS
    )
    layouts = (qs.x.q_layout, qs.kernel.q_layout, qs.dgrad.q_layout)
    assert layouts == (QuantizeLayout.ROWWISE, QuantizeLayout.COLWISE, QuantizeLayout.ROWWISE)


def test_bad_groups():
    qs = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(), n_groups=2)
    with pytest.raises(ValueError, match=r"already grouped for 2 groups, not n_groups=3"):
        grouped_quantizer_set(qs, 3)
    with pytest.raises(ValueError, match=r"n_groups must be a positive int, got -1"):
        grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=DelayedScaling()), -1)
    with pytest.raises(TypeError, match=r"quantizer_set must be a te_flax\.quantize\.Quantizer"):
        grouped_quantizer_set(qs.x, 2)
    x, kernel, _ = _inputs()
    with pytest.raises(ValueError, match=r"create_set\(\.\.\., n_groups=3\)"):
        grouped_dense(x, kernel, SIZES, quantizer_set=qs)


def test_generate_quantizer_set_with_n_groups_in_grouped_dense():
    """A module's grouped set: GroupedQuantizers over its per-group variables, whose new
    values come back as the gradient of the variables."""
    x, kernel, cotangent = _inputs()

    class Experts(TransformerEngineBase):
        @nn.compact
        def __call__(self, x, kernel):
            qs = self.generate_quantizer_set(n_groups=GROUPS)
            assert isinstance(qs.kernel, GroupedQuantizer) and qs.kernel.n_groups == GROUPS
            return grouped_dense(x, kernel, SIZES, quantizer_set=qs)

    with te_flax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        variables = Experts().init(jax.random.key(0), x, kernel)
        fp8 = variables["_overwrite_with_gradient"]
        assert fp8["kernel_amax_history"].shape == (GROUPS, 4)

        def loss(fp8):
            out = Experts().apply({"_overwrite_with_gradient": fp8}, x, kernel)
            return jnp.sum(out * cotangent)

        new = jax.grad(loss)(fp8)
    kernel_amax = np.abs(np.asarray(kernel)).max(axis=(1, 2))
    np.testing.assert_allclose(new["kernel_amax_history"][:, 0], kernel_amax, rtol=1e-6)
