"""TransformerEngine's quantizer API (``QuantizerFactory.create`` / ``create_set`` with a
``ScalingMode``, ``QuantizeLayout``, ``QuantizeMeta``, the recipe kind predicates) against
TransformerEngine 2.20.2's own, which builds quantizers on a CPU."""

from __future__ import annotations

import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import transformer_engine.jax.quantize as te_quantize

from te_flax import quantize
from te_flax.dense import grouped_dense
from tests.parity import te_reference as ref

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MODES = [m.name for m in te_quantize.ScalingMode]


def test_factory_signatures_start_with_transformer_engines():
    for method in ("create", "create_set"):
        theirs = inspect.signature(getattr(te_quantize.QuantizerFactory, method)).parameters
        ours = inspect.signature(getattr(quantize.QuantizerFactory, method)).parameters
        names = [n for n, p in theirs.items() if p.kind is not p.VAR_KEYWORD]
        assert list(ours)[: len(names)] == names
        for name in names:
            assert ours[name].default == theirs[name].default, (method, name)


@pytest.mark.parametrize("name", MODES)
def test_scaling_mode_predicates(name):
    theirs, ours = getattr(te_quantize.ScalingMode, name), getattr(quantize.ScalingMode, name)
    assert ours.is_tensor_scaling() == theirs.is_tensor_scaling()
    assert ours.is_1d_block_scaling() == theirs.is_1d_block_scaling()
    assert ours.is_block_scaling == theirs.is_block_scaling
    assert ours.is_nvfp4_scaling == theirs.is_nvfp4_scaling
    assert ours.is_mxfp8_scaling == theirs.is_mxfp8_scaling
    assert ours.get_compatible_q_dtypes() == theirs.get_compatible_q_dtypes()
    if name != "NO_SCALING":
        assert jnp.dtype(ours.get_scale_dtype()) == jnp.dtype(theirs.get_scale_dtype())


def test_quantize_layout_members_and_properties():
    properties = ("has_rowwise", "has_colwise", "is_rowwise_colwise", "is_rowwise_only")
    for theirs in te_quantize.QuantizeLayout:
        ours = quantize.QuantizeLayout[theirs.name]
        assert {p: getattr(ours, p) for p in properties} == {
            p: getattr(theirs, p) for p in properties
        }


@pytest.mark.parametrize(
    "name", ["NO_SCALING", "DELAYED_TENSOR_SCALING", "CURRENT_TENSOR_SCALING", "MXFP8_1D_SCALING"]
)
def test_create_set_with_a_scaling_mode(name):
    kwargs = dict(fwd_dtype=E4M3, bwd_dtype=E5M2, is_2x2x=False)
    theirs = te_quantize.QuantizerFactory.create_set(
        scaling_mode=getattr(te_quantize.ScalingMode, name), **kwargs
    )
    ours = quantize.QuantizerFactory.create_set(
        scaling_mode=getattr(quantize.ScalingMode, name), **kwargs
    )
    for role in ("x", "kernel", "dgrad"):
        a, b = getattr(theirs, role), getattr(ours, role)
        if a is None:
            assert b is None
            continue
        assert type(a).__name__ == type(b).__name__
        assert b.scaling_mode.name == a.scaling_mode.name
        assert jnp.dtype(a.q_dtype) == jnp.dtype(b.q_dtype)
        if name == "DELAYED_TENSOR_SCALING":
            assert a.amax_history.shape == b.amax_history.shape
            np.testing.assert_array_equal(1.0 / np.asarray(a.scale), np.asarray(b.scale_inv))


def test_create_delayed_quantizer_from_transformer_engines_state():
    state = dict(scale=jnp.full((1,), 4.0, jnp.float32), amax_history=jnp.arange(8.0))
    theirs = te_quantize.QuantizerFactory.create(
        scaling_mode=te_quantize.ScalingMode.DELAYED_TENSOR_SCALING, q_dtype=E4M3, **state
    )
    ours = quantize.QuantizerFactory.create(
        scaling_mode=quantize.ScalingMode.DELAYED_TENSOR_SCALING, q_dtype=E4M3, **state
    )
    np.testing.assert_array_equal(np.asarray(ours.scale_inv), 1.0 / np.asarray(theirs.scale))
    np.testing.assert_array_equal(np.asarray(ours.amax_history), np.asarray(theirs.amax_history))


def test_quantize_meta_merge():
    for module in (te_quantize, quantize):
        merged = module.QuantizeMeta.merge(module.QuantizeMeta(a=1), module.QuantizeMeta(b=2))
        assert merged.get_kwargs_dictionary() == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"]
)
def test_recipe_kind_predicates(name):
    kinds = ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4")
    theirs, ours = getattr(ref.te_recipe, name)(), getattr(quantize, name)()
    assert {k: getattr(ours, k)() for k in kinds} == {k: getattr(theirs, k)() for k in kinds}


def test_nvfp4_sets_take_their_stochastic_rounding_key_as_tes_do(monkeypatch):
    """Without an RNG state TE's NVFP4 gradient quantizer rounds to nearest; with TE's
    ``QuantizeMeta(stochastic_rounding_rng_state=...)`` it rounds stochastically. te_flax's
    sets do the same (and say the first once)."""
    from transformer_engine.common.recipe import NVFP4BlockScaling as TENVFP4

    from te_flax.quantize import factory

    monkeypatch.setattr(factory, "_WARNED_NO_KEY", [])

    def make(api, recipe, state):
        grad = (
            api.QuantizeMeta()
            if state is None
            else api.QuantizeMeta(stochastic_rounding_rng_state=state)
        )
        metas = api.QuantizeMetaSet(x=api.QuantizeMeta(), kernel=api.QuantizeMeta(), grad=grad)
        return api.QuantizerFactory.create_set(fp8_recipe=recipe, quantize_meta_set=metas)

    for state in (None, jnp.array([5, 6, 7, 8], jnp.uint32)):
        theirs = make(te_quantize, TENVFP4(), state)
        context = pytest.warns(UserWarning) if state is None else contextlib.nullcontext()
        with context:
            ours = make(quantize, quantize.NVFP4BlockScaling(), state)
        te_rounds = theirs.dgrad.stochastic_rounding_rng_state is not None
        assert (ours.dgrad.key is not None) == te_rounds == (state is not None)


# ----------------------------------------------------------------------------- grouped sets

GROUPED_MODES = {
    "DELAYED_TENSOR_SCALING": E5M2,
    "CURRENT_TENSOR_SCALING": E5M2,
    "MXFP8_1D_SCALING": E4M3,  # MaxText's te_mxfp8 MoE set: e4m3 for the gradient too
}


def _grouped_sets(name: str, n_groups: int, **kwargs):
    """TE's and te_flax's ``create_set(scaling_mode=..., n_groups=...)``."""
    arguments = dict(fwd_dtype=E4M3, bwd_dtype=GROUPED_MODES[name], n_groups=n_groups, **kwargs)
    theirs = te_quantize.QuantizerFactory.create_set(
        scaling_mode=getattr(te_quantize.ScalingMode, name), **arguments
    )
    ours = quantize.QuantizerFactory.create_set(
        scaling_mode=getattr(quantize.ScalingMode, name), **arguments
    )
    return theirs, ours


@pytest.mark.parametrize("is_2x2x", [True, False, None])
@pytest.mark.parametrize("name", GROUPED_MODES)
def test_grouped_sets_have_transformer_engines_fields(name, is_2x2x):
    theirs, ours = _grouped_sets(name, 3, is_2x2x=is_2x2x, checkpoint_name="quantization")
    for role in ("x", "kernel", "dgrad"):
        a, b = getattr(theirs, role), getattr(ours, role)
        assert type(a).__name__ == type(b).__name__ == "GroupedQuantizer", role
        assert b.n_groups == a.n_groups == 3
        assert b.scaling_mode.name == a.scaling_mode.name
        assert jnp.dtype(b.q_dtype) == jnp.dtype(a.q_dtype)
        assert b.q_layout.name == a.q_layout.name, (role, a.q_layout)
        assert b.data_layout == a.data_layout
        assert b.checkpoint_name == a.checkpoint_name
        assert len(b.quantizers) == len(a.quantizers) == 3
        for group_a, group_b in zip(a.quantizers, b.quantizers, strict=True):
            assert type(group_a).__name__ == type(group_b).__name__
            assert jnp.dtype(group_a.q_dtype) == jnp.dtype(group_b.q_dtype)
            if name == "DELAYED_TENSOR_SCALING":
                assert group_a.amax_history.shape == group_b.amax_history.shape
                np.testing.assert_array_equal(group_b.amax_history, group_a.amax_history)
                np.testing.assert_array_equal(group_b.scale_inv, 1.0 / np.asarray(group_a.scale))


def test_grouped_sets_from_a_recipe_as_transformer_engines_modules_make_them():
    """TE's modules pass a ``QuantizeMetaSet`` with the recipe; without state (current
    scaling, MXFP8) TE's set and te_flax's are the same kind per group."""
    for ours_recipe, theirs_recipe in (
        (quantize.Float8CurrentScaling(), ref.te_recipe.Float8CurrentScaling()),
        (quantize.MXFP8BlockScaling(), ref.te_recipe.MXFP8BlockScaling()),
    ):
        sets = []
        for api, recipe in ((te_quantize, theirs_recipe), (quantize, ours_recipe)):
            metas = api.QuantizeMetaSet(
                x=api.QuantizeMeta(), kernel=api.QuantizeMeta(), grad=api.QuantizeMeta()
            )
            sets.append(
                api.QuantizerFactory.create_set(
                    fp8_recipe=recipe, quantize_meta_set=metas, n_groups=4
                )
            )
        theirs, ours = sets
        for role in ("x", "kernel", "dgrad"):
            a, b = getattr(theirs, role), getattr(ours, role)
            assert (b.n_groups, b.scaling_mode.name) == (a.n_groups, a.scaling_mode.name)
            assert jnp.dtype(b.q_dtype) == jnp.dtype(a.q_dtype)
            assert type(b.quantizers[3]).__name__ == type(a.quantizers[3]).__name__


def _te_grouped_forward(quantizer_set, x, kernel, sizes):
    """TE's grouped GEMM forward from TE's own per-group quantizers (its ``grouped_dense``
    runs only as CUDA kernels): group ``g``'s rows and kernel quantized by
    ``quantizers[g]`` (blocks along the contraction K for both), then multiplied in float32."""
    outs, start = [], 0
    for g, size in enumerate(sizes):
        rows = x[start : start + size]
        start += size
        if not size:
            continue
        lhs = quantizer_set.x.quantizers[g].quantize(rows, is_rowwise=True, is_colwise=False)
        rhs = quantizer_set.kernel.quantizers[g].quantize(
            kernel[g].T, is_rowwise=True, is_colwise=False
        )  # [N, K]: K last, the blocks of MXFP8 along it
        outs.append(
            jnp.dot(lhs.dequantize(), rhs.dequantize().T, precision=jax.lax.Precision.HIGHEST)
        )
    outs.append(jnp.zeros((x.shape[0] - start, kernel.shape[2]), x.dtype))
    return jnp.concatenate(outs)


@pytest.mark.parametrize("name", GROUPED_MODES)
def test_grouped_dense_with_grouped_sets_matches_transformer_engines_quantizers(name):
    """te_flax's ``grouped_dense`` with ``create_set(n_groups=G)`` against the GEMM of the rows
    and kernels TE's ``create_set(n_groups=G)`` quantizes: the same per-group scales (current
    scaling: each group's amax; delayed: each group's stored scale; MXFP8: each block's)."""
    sizes = (32, 0, 64)  # MXFP8's weight gradient contracts the rows: whole 32-row blocks
    keys = jax.random.split(jax.random.key(0), 2)
    # Groups of very different ranges: per-group scales matter.
    x = (
        jax.random.normal(keys[0], (128, 64))
        * jnp.repeat(jnp.array([1.0, 1.0, 30.0, 1.0]), 32)[:, None]
    )
    kernel = jax.random.normal(keys[1], (3, 64, 32)) * jnp.array([1.0, 5.0, 0.1])[:, None, None]
    theirs, ours = _grouped_sets(name, 3, is_2x2x=True)
    expected = _te_grouped_forward(theirs, x, kernel, sizes)

    # Differentiated, so that a fresh delayed state quantizes with its stored scale (1), as
    # TE's quantizers do, not just in time.
    def loss(x, quantizer_set):
        out = grouped_dense(x, kernel, jnp.array(sizes, jnp.int32), quantizer_set=quantizer_set)
        return jnp.sum(out), out

    (_, actual), _ = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, ours)
    assert ref.relative_error(actual, expected) <= 1e-5
