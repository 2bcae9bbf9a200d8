"""``te_flax.convert``: TransformerEngine's Linen variable layout to te_flax's and back.

TE keeps delayed-scaling state in ``fp8_metas`` as ``{x,kernel,grad}{postfix}_scale``
(``fp8_max / amax``) and ``..._amax_history`` stored as ``[0, a(t-L+2), ..., a(t)]`` (oldest
first, slot 0 cleared). te_flax keeps ``..._scale_inv`` (``1 / scale``) and the history newest
first in ``_overwrite_with_gradient``. The behavioural test runs TE's documented update rule,
written out here, against a te_flax layer that starts from the converted state.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import freeze, unfreeze

import te_flax.linen as te_nn
from te_flax.convert import TE_FP8_COLLECTION, from_transformer_engine, to_transformer_engine
from te_flax.quantize import DelayedScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT
from tests.helpers import F32, amax_of

HISTORY_LEN = 4
ROLE_FP8_MAX = {"x": 448.0, "kernel": 448.0, "grad": 57344.0}


def _f32(values) -> jax.Array:
    return jnp.asarray(values, F32)


def _ulps(actual, expected) -> np.ndarray:
    """How many float32 values lie between ``actual`` and ``expected`` (both positive)."""
    actual = np.asarray(actual, np.float32).view(np.int32).astype(np.int64)
    expected = np.asarray(expected, np.float32).view(np.int32).astype(np.int64)
    return np.abs(actual - expected)


def _assert_within_ulps(actual, expected, n: int, what: str = "") -> None:
    assert np.shape(actual) == np.shape(expected), what
    assert np.all(_ulps(actual, expected) <= n), (what, actual, expected)


def _te_gemm_state(postfix: str, seed: int) -> dict:
    """One GEMM's state in TE's layout: positive scales, histories ``[0, oldest, ..., newest]``."""
    rng = np.random.default_rng(seed)
    state = {}
    for role in ROLE_FP8_MAX:
        history = np.concatenate([[0.0], rng.uniform(0.1, 10.0, HISTORY_LEN - 1)])
        state[f"{role}{postfix}_amax_history"] = _f32(history)
        state[f"{role}{postfix}_scale"] = _f32([rng.uniform(1.0, 1000.0)])
    return state


def _te_params(seed: int, shapes: dict) -> dict:
    rng = np.random.default_rng(seed)
    return {name: _f32(rng.standard_normal(shape)) for name, shape in shapes.items()}


def _te_dense_tree() -> dict:
    """A DenseGeneral's variables as TE's Linen module holds them."""
    return {
        "params": _te_params(0, {"kernel": (16, 8), "bias": (8,)}),
        TE_FP8_COLLECTION: _te_gemm_state("", 1),
    }


def _te_mlp_tree() -> dict:
    """A LayerNormMLP's: the two GEMMs' state under the ``_0`` and ``_1`` postfixes."""
    shapes = {"scale": (8,), "ln_bias": (8,), "wi_kernel": (8, 2, 32), "wo_kernel": (32, 8)}
    return {
        "params": _te_params(2, shapes),
        TE_FP8_COLLECTION: {**_te_gemm_state("_0", 3), **_te_gemm_state("_1", 4)},
    }


def _te_nested_tree() -> dict:
    """A model of several modules: state nested by module name, as in any Linen tree."""
    return {
        "params": {
            "encoder": {
                "qkv": _te_params(5, {"kernel": (8, 3, 8), "scale": (8,)}),
                "mlp": _te_params(6, {"wi_kernel": (8, 1, 16), "wo_kernel": (16, 8)}),
            },
            "head": _te_params(7, {"kernel": (8, 4)}),
        },
        TE_FP8_COLLECTION: {
            "encoder": {
                "qkv": _te_gemm_state("", 8),
                "mlp": {**_te_gemm_state("_0", 9), **_te_gemm_state("_1", 10)},
            },
            "head": _te_gemm_state("", 11),
        },
        "cache": {"index": jnp.zeros((), jnp.int32)},
    }


TE_TREES = {"dense": _te_dense_tree, "mlp": _te_mlp_tree, "nested": _te_nested_tree}


def _flat(tree) -> dict:
    """``{path: leaf}`` with ``/``-joined dict keys."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(key.key) for key in path): leaf for path, leaf in leaves}


def _assert_same_tree(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


# ----------------------------------------------------------------------------- TE -> te_flax


@pytest.mark.parametrize("layout", TE_TREES)
def test_from_transformer_engine_renames_and_converts_fp8_state(layout):
    te_tree = TE_TREES[layout]()
    ours = from_transformer_engine(te_tree)
    assert TE_FP8_COLLECTION not in ours
    assert set(ours) == (set(te_tree) - {TE_FP8_COLLECTION}) | {OVERWRITE_WITH_GRADIENT}
    # Parameters and other collections are untouched.
    for collection in set(te_tree) - {TE_FP8_COLLECTION}:
        _assert_same_tree(ours[collection], te_tree[collection])

    te_fp8, fp8 = _flat(te_tree[TE_FP8_COLLECTION]), _flat(ours[OVERWRITE_WITH_GRADIENT])
    expected_names = {
        path[: -len("_scale")] + "_scale_inv" if path.endswith("_scale") else path
        for path in te_fp8
    }
    assert set(fp8) == expected_names
    for path, value in te_fp8.items():
        if path.endswith("_amax_history"):
            # [0, oldest, ..., newest] -> [newest, ..., oldest, 0]
            history = fp8[path]
            assert history.dtype == F32 and history.shape == (HISTORY_LEN,)
            np.testing.assert_array_equal(history[:-1], np.asarray(value)[1:][::-1])
            np.testing.assert_array_equal(history[-1], 0.0)
        else:
            scale_inv = fp8[path[: -len("_scale")] + "_scale_inv"]
            assert scale_inv.dtype == F32 and scale_inv.shape == (1,)
            exact = np.float32(1.0 / np.float64(np.asarray(value)[0]))
            _assert_within_ulps(scale_inv, [exact], 1, path)


def test_from_transformer_engine_example_values():
    te_tree = {
        "params": {"kernel": jnp.ones((2, 2))},
        TE_FP8_COLLECTION: {
            "x_scale": _f32([4.0]),
            "x_amax_history": _f32([0.0, 1.0, 2.0, 3.0]),
            "grad_scale": _f32([0.5]),
            "grad_amax_history": _f32([0.0, 0.0, 0.0, 7.0]),
        },
    }
    fp8 = from_transformer_engine(te_tree)[OVERWRITE_WITH_GRADIENT]
    np.testing.assert_array_equal(fp8["x_amax_history"], [3.0, 2.0, 1.0, 0.0])
    np.testing.assert_array_equal(fp8["x_scale_inv"], [0.25])
    np.testing.assert_array_equal(fp8["grad_amax_history"], [7.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(fp8["grad_scale_inv"], [2.0])


def test_conversion_accepts_frozen_dicts_and_trees_without_fp8_state():
    te_tree = _te_dense_tree()
    ours = from_transformer_engine(freeze(te_tree))
    _assert_same_tree(unfreeze(ours), from_transformer_engine(te_tree))
    # A model without FP8: nothing to convert, the collections come back as they were.
    params_only = {"params": te_tree["params"]}
    _assert_same_tree(from_transformer_engine(params_only), params_only)
    _assert_same_tree(to_transformer_engine(params_only), params_only)


# ----------------------------------------------------------------------------- te_flax -> TE


def test_to_transformer_engine_is_the_inverse():
    fp8 = {
        "x_amax_history": _f32([4.0, 3.0, 2.0, 1.0]),
        "x_scale_inv": _f32([0.125]),
        "kernel_amax_history": _f32([0.5, 0.0, 0.0, 0.0]),
        "kernel_scale_inv": _f32([0.25]),
        "grad_amax_history": _f32([1.0, 2.0, 3.0, 9.0]),
        "grad_scale_inv": _f32([3.0]),
    }
    params = {"kernel": jnp.ones((3, 2))}
    te_tree = to_transformer_engine({"params": params, OVERWRITE_WITH_GRADIENT: fp8})
    assert set(te_tree) == {"params", TE_FP8_COLLECTION}
    _assert_same_tree(te_tree["params"], params)
    te_fp8 = te_tree[TE_FP8_COLLECTION]
    assert set(te_fp8) == {
        "x_amax_history",
        "x_scale",
        "kernel_amax_history",
        "kernel_scale",
        "grad_amax_history",
        "grad_scale",
    }
    # [newest, ..., oldest] -> [0, ..., newest]: TE's slot 0 is the cleared one, so te_flax's
    # oldest entry (which the next update drops anyway) has no place.
    np.testing.assert_array_equal(te_fp8["x_amax_history"], [0.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(te_fp8["kernel_amax_history"], [0.0, 0.0, 0.0, 0.5])
    np.testing.assert_array_equal(te_fp8["grad_amax_history"], [0.0, 3.0, 2.0, 1.0])
    np.testing.assert_array_equal(te_fp8["x_scale"], [8.0])
    np.testing.assert_array_equal(te_fp8["kernel_scale"], [4.0])
    _assert_within_ulps(te_fp8["grad_scale"], [np.float32(1 / 3)], 1)

    back = from_transformer_engine(te_tree)[OVERWRITE_WITH_GRADIENT]
    for name, value in fp8.items():
        if name.endswith("_amax_history"):
            np.testing.assert_array_equal(back[name][:-1], value[:-1])
            np.testing.assert_array_equal(back[name][-1], 0.0)
        else:
            _assert_within_ulps(back[name], value, 1, name)


@pytest.mark.parametrize("layer", ["dense", "layernorm_dense", "mlp"])
def test_te_flax_variable_names_map_to_te_names(layer):
    recipe = DelayedScaling(amax_history_len=HISTORY_LEN)
    module, postfixes = {
        "dense": (te_nn.DenseGeneral(features=4, recipe=recipe), [""]),
        "layernorm_dense": (te_nn.LayerNormDenseGeneral(features=4, recipe=recipe), [""]),
        "mlp": (te_nn.LayerNormMLP(intermediate_dim=16, recipe=recipe), ["_0", "_1"]),
    }[layer]
    variables = module.init(jax.random.key(0), jnp.ones((2, 8)))
    te_tree = to_transformer_engine(variables)
    assert set(te_tree[TE_FP8_COLLECTION]) == {
        f"{role}{postfix}_{kind}"
        for role in ROLE_FP8_MAX
        for postfix in postfixes
        for kind in ("scale", "amax_history")
    }
    back = from_transformer_engine(te_tree)
    assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, variables)
    _assert_same_tree(back[OVERWRITE_WITH_GRADIENT], variables[OVERWRITE_WITH_GRADIENT])


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", TE_TREES)
def test_te_round_trip(layout):
    te_tree = TE_TREES[layout]()
    back = to_transformer_engine(from_transformer_engine(te_tree))
    assert set(back) == set(te_tree)
    for collection in set(te_tree) - {TE_FP8_COLLECTION}:
        _assert_same_tree(back[collection], te_tree[collection])
    te_fp8, back_fp8 = _flat(te_tree[TE_FP8_COLLECTION]), _flat(back[TE_FP8_COLLECTION])
    assert set(back_fp8) == set(te_fp8)
    for path, value in te_fp8.items():
        if path.endswith("_amax_history"):
            np.testing.assert_array_equal(back_fp8[path], value, err_msg=path)
        else:
            _assert_within_ulps(back_fp8[path], value, 1, path)


def test_scale_round_trip_is_within_one_ulp_and_exact_for_powers_of_two():
    rng = np.random.default_rng(0)
    scales = _f32(np.exp(rng.uniform(-40.0, 40.0, 20000)))
    powers_of_two = _f32(2.0 ** np.arange(-100, 101))
    for values, ulps in ((scales, 1), (powers_of_two, 0)):
        te_tree = {"params": {}, TE_FP8_COLLECTION: {"x_scale": values}}
        back = to_transformer_engine(from_transformer_engine(te_tree))[TE_FP8_COLLECTION]
        _assert_within_ulps(back["x_scale"], values, ulps)


# ----------------------------------------------------------------------------- behaviour


def _te_update(state: dict, amaxes: dict, recipe: DelayedScaling) -> dict:
    """TransformerEngine's delayed-scaling update of one GEMM's ``fp8_metas``, in float32.

    The step's amax goes into the cleared slot 0; the scale comes from the whole history (or
    that newest amax) and stays as it was for a zero or non-finite amax; then the history rolls
    so that slot 0 is free again.
    """
    new = {}
    for role, fp8_max in ROLE_FP8_MAX.items():
        history = state[f"{role}_amax_history"].at[0].set(amaxes[role])
        if recipe.amax_compute_algo == "max":
            amax = jnp.max(history, keepdims=True)
        else:
            amax = history[0:1]
        scale = state[f"{role}_scale"]
        candidate = (jnp.float32(fp8_max) / amax) / jnp.float32(2.0**recipe.margin)
        valid = (amax > 0.0) & jnp.isfinite(amax)
        new[f"{role}_scale"] = jnp.where(valid, candidate, scale)
        new[f"{role}_amax_history"] = jnp.roll(history, -1).at[0].set(0.0)
    return new


# A TE state whose history maximum sits in a different slot per role: the oldest entry for the
# kernel (it must count one more step, then drop out), the newest for the gradient.
TE_STATE = {
    "x_scale": _f32([100.0]),
    "x_amax_history": _f32([0.0, 0.5, 1.0, 0.25]),
    "kernel_scale": _f32([200.0]),
    "kernel_amax_history": _f32([0.0, 2.0, 0.1, 0.2]),
    "grad_scale": _f32([3000.0]),
    "grad_amax_history": _f32([0.0, 1.0, 2.0, 3.0]),
}
RECIPES = {
    "max": DelayedScaling(amax_history_len=HISTORY_LEN),
    "margin": DelayedScaling(amax_history_len=HISTORY_LEN, margin=1),
    "most_recent": DelayedScaling(amax_history_len=HISTORY_LEN, amax_compute_algo="most_recent"),
}
# scale_inv is rounded once when te_flax computes it and once more in its reciprocal, while TE
# rounds fp8_max / amax once: the two float32 results can lie two values apart.
BEHAVIOUR_SCALE_ULPS = 2


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_te_state_evolves_under_te_flax_as_under_te(recipe_name):
    recipe = RECIPES[recipe_name]
    layer = te_nn.DenseGeneral(features=8, recipe=recipe)
    rng = np.random.default_rng(0)
    # (input, output gradient) per step: amax 3 then 0.3 for x, about 0.5 for the gradient.
    steps = [
        (_f32(rng.uniform(-3.0, 3.0, (4, 16))), _f32(rng.uniform(-0.5, 0.5, (4, 8)))),
        (_f32(rng.uniform(-0.3, 0.3, (4, 16))), _f32(rng.uniform(-0.6, 0.6, (4, 8)))),
    ]
    params = nn.meta.unbox(layer.init(jax.random.key(0), steps[0][0])["params"])

    def loss_fn(variables, x, weight):
        # The output gradient is ``weight``, whatever the FP8 forward computed.
        return jnp.sum(layer.apply(variables, x) * weight)

    grad_fn = jax.jit(jax.grad(loss_fn))
    te_state = TE_STATE
    variables = from_transformer_engine({"params": params, TE_FP8_COLLECTION: te_state})
    for x, weight in steps:
        grads = grad_fn(variables, x, weight)
        variables = {"params": params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
        amaxes = {"x": amax_of(x), "kernel": amax_of(params["kernel"]), "grad": amax_of(weight)}
        te_state = _te_update(te_state, amaxes, recipe)

        ours = to_transformer_engine(variables)[TE_FP8_COLLECTION]
        assert set(ours) == set(te_state)
        for name, expected in te_state.items():
            if name.endswith("_amax_history"):
                np.testing.assert_array_equal(ours[name], expected, err_msg=name)
            else:
                _assert_within_ulps(ours[name], expected, BEHAVIOUR_SCALE_ULPS, name)


def test_zero_amax_keeps_the_te_scale():
    """A step whose gradient is all zero keeps the stored scale, in both layouts, exactly."""
    recipe = DelayedScaling(amax_history_len=HISTORY_LEN)
    layer = te_nn.DenseGeneral(features=8, recipe=recipe)
    x = _f32(np.linspace(-1.0, 1.0, 64).reshape(4, 16))
    params = nn.meta.unbox(layer.init(jax.random.key(0), x)["params"])
    te_state = {
        **TE_STATE,
        "grad_scale": _f32([2.0**10]),
        "grad_amax_history": jnp.zeros((HISTORY_LEN,), F32),
    }
    variables = from_transformer_engine({"params": params, TE_FP8_COLLECTION: te_state})
    grads = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x) * 0.0)))(variables)
    ours = to_transformer_engine({OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]})
    amaxes = {"x": amax_of(x), "kernel": amax_of(params["kernel"]), "grad": jnp.zeros((), F32)}
    expected = _te_update(te_state, amaxes, recipe)
    np.testing.assert_array_equal(expected["grad_scale"], [2.0**10])
    np.testing.assert_array_equal(ours[TE_FP8_COLLECTION]["grad_scale"], [2.0**10])
    np.testing.assert_array_equal(
        ours[TE_FP8_COLLECTION]["grad_amax_history"], expected["grad_amax_history"]
    )


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("convert", "collection", "name"),
    [
        (from_transformer_engine, TE_FP8_COLLECTION, "x_scale_inv"),
        (from_transformer_engine, TE_FP8_COLLECTION, "x_amax"),
        (from_transformer_engine, TE_FP8_COLLECTION, "kernel_scale_fwd"),
        (to_transformer_engine, OVERWRITE_WITH_GRADIENT, "x_scale"),
        (to_transformer_engine, OVERWRITE_WITH_GRADIENT, "amax"),
    ],
)
def test_unknown_fp8_variable_names_are_refused(convert, collection, name):
    tree = {"params": {}, collection: {"layer": {name: _f32([1.0])}}}
    with pytest.raises(ValueError, match=f"unexpected FP8 variable '{name}' in '{collection}'"):
        convert(tree)


def test_existing_target_collection_is_refused():
    te_tree = _te_dense_tree()
    ours = from_transformer_engine(te_tree)
    with pytest.raises(ValueError, match=f"already hold a '{OVERWRITE_WITH_GRADIENT}'"):
        from_transformer_engine({**te_tree, OVERWRITE_WITH_GRADIENT: ours[OVERWRITE_WITH_GRADIENT]})
    with pytest.raises(ValueError, match=f"already hold a '{TE_FP8_COLLECTION}'"):
        to_transformer_engine({**ours, TE_FP8_COLLECTION: te_tree[TE_FP8_COLLECTION]})


@pytest.mark.parametrize("convert", [from_transformer_engine, to_transformer_engine])
@pytest.mark.parametrize("value", [[{"params": {}}], jnp.ones((2,)), None])
def test_non_mapping_input_is_refused(convert, value):
    with pytest.raises(TypeError, match="must be a mapping of collections"):
        convert(value)
