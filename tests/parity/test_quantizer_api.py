"""TransformerEngine's quantizer API (``QuantizerFactory.create`` / ``create_set`` with a
``ScalingMode``, ``QuantizeLayout``, ``QuantizeMeta``, the recipe kind predicates) against
TransformerEngine 2.20.2's own, which builds quantizers on a CPU."""

from __future__ import annotations

import contextlib
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import transformer_engine.jax.quantize as te_quantize

from te_flax import quantize
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
