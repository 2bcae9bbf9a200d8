"""The NNX modules: agreement with the Linen modules step by step, the variable converters, state
trees, an FP8 training loop, NNX transforms, the Linen bridge, dropout, options and the errors."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import freeze
from flax.nnx import variablelib
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import te_flax
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._layers.fp8_state import check_state_matches
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    init_optimizer,
    merge_fp8_state,
)
from tests.helpers import F32, amax_of, assert_delayed_step, assert_tree_close

HISTORY_LEN = 4
DELAYED = DelayedScaling(amax_history_len=HISTORY_LEN)
HIDDEN = 16
# An amax recomputed here from a separately compiled forward (an output gradient).
RECOMPUTED_RTOL = 1e-5


def _x(shape=(4, 3, HIDDEN), seed=0, scale=2.0):
    # NumPy draws: jax.random would compile a sampler for every shape.
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal(shape) + 0.5, F32)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _params(tree) -> dict:
    """The ``nnx.Param`` values of a module (or of a gradient ``nnx.State``) as a pure dict."""
    return nnx.to_pure_dict(nnx.state(tree, nnx.Param))


def _fp8(tree) -> dict:
    return nnx.to_pure_dict(nnx.state(tree, te_nnx.Fp8Meta))


def _fp8_names(postfix=""):
    return sorted(
        f"{role}{postfix}_{kind}"
        for role in ("x", "kernel", "grad")
        for kind in ("amax_history", "scale_inv")
    )


def _assert_equal_trees(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


def _mse(y, target):
    return jnp.mean((y - target) ** 2)


# ----------------------------------------------------------------------------- Linen vs NNX


def _twins(kind: str, **attributes):
    """The Linen module and a maker of its NNX twin (``rngs`` -> module), same attributes.

    The NNX twin is built for ``HIDDEN`` input features; ``features`` is positional there.
    """
    if kind == "layernorm":
        return te_nn.LayerNorm(**attributes), lambda rngs: te_nnx.LayerNorm(
            HIDDEN, rngs=rngs, **attributes
        )
    if kind == "layernorm_mlp":
        return te_nn.LayerNormMLP(**attributes), lambda rngs: te_nnx.LayerNormMLP(
            HIDDEN, rngs=rngs, **attributes
        )
    linen_class, nnx_class = {
        "dense_general": (te_nn.DenseGeneral, te_nnx.DenseGeneral),
        "layernorm_dense_general": (te_nn.LayerNormDenseGeneral, te_nnx.LayerNormDenseGeneral),
    }[kind]
    features = attributes.pop("features")
    return linen_class(features=features, **attributes), lambda rngs: nnx_class(
        HIDDEN, features, rngs=rngs, **attributes
    )


# Non-default attributes, so that they are part of what must agree.
_CONSISTENCY_ATTRIBUTES = {
    "layernorm": dict(layernorm_type="rmsnorm", zero_centered_gamma=True),
    "dense_general": dict(features=(2, 4)),
    "layernorm_dense_general": dict(features=8, use_bias=True),
    "layernorm_mlp": dict(intermediate_dim=32, activations=("gelu", "linear"), use_bias=True),
}
_CONSISTENCY_CASES = [
    ("layernorm", None),
    ("dense_general", None),
    ("dense_general", DELAYED),
    ("layernorm_dense_general", None),
    ("layernorm_dense_general", DELAYED),
    ("layernorm_mlp", None),
    ("layernorm_mlp", DELAYED),
]


def _loaded_pair(name, recipe, x):
    """The Linen module, its variables (unboxed), and the NNX module holding the same values."""
    attributes = dict(_CONSISTENCY_ATTRIBUTES[name])
    if name != "layernorm":
        attributes["recipe"] = recipe
    linen_module, make_nnx = _twins(name, **attributes)
    variables = linen_module.init(jax.random.key(0), x)
    # A different seed: every value must come from the Linen variables.
    module = make_nnx(nnx.Rngs(7))
    te_nnx.load_linen_variables(module, variables)
    return linen_module, nn.meta.unbox(variables), module


@pytest.mark.parametrize(
    ("name", "recipe"),
    _CONSISTENCY_CASES,
    ids=[f"{n}-{'fp8' if r else 'nofp8'}" for n, r in _CONSISTENCY_CASES],
)
def test_linen_and_nnx_agree_bit_for_bit_over_fp8_training_steps(name, recipe):
    xs = [_x(seed=s) for s in range(3)]
    linen_module, variables, module = _loaded_pair(name, recipe, xs[0])
    # The converters both ways: what was loaded comes back unchanged.
    _assert_equal_trees(te_nnx.linen_variables(module), variables)
    assert (OVERWRITE_WITH_GRADIENT in variables) == (recipe is not None)
    out_shape = jax.eval_shape(lambda x: _first(linen_module.apply(variables, x)), xs[0]).shape
    targets = [_x(out_shape, seed=10 + s, scale=1.0) for s in range(3)]

    def linen_loss(variables, x, target):
        out = linen_module.apply(merge_fp8_state(variables), x)
        return _mse(_first(out), target), out

    def nnx_loss(model, x, target):
        return _mse(_first(model(x)), target)

    def nnx_loss_and_out(model, x, target):
        out = model(x)
        return _mse(_first(out), target), out

    tx = optax.sgd(0.1)
    opt_state = init_optimizer(tx, variables)
    optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)

    @jax.jit
    def linen_step(variables, opt_state, x, target):
        (value, out), grads = jax.value_and_grad(linen_loss, has_aux=True)(variables, x, target)
        variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
        return value, out, grads, variables, opt_state

    @nnx.jit
    def nnx_step(model, optimizer, x, target):
        # The output and gradients the train step computes, to compare; they do not change the
        # model.
        (value, out), grads = te_nnx.value_and_grad(nnx_loss_and_out, has_aux=True)(
            model, x, target
        )
        loss = te_nnx.train_step(model, optimizer, nnx_loss, x, target)
        return value, out, grads, loss

    for x, target in zip(xs, targets, strict=True):
        linen_value, linen_out, linen_grads, variables, opt_state = linen_step(
            variables, opt_state, x, target
        )
        nnx_value, nnx_out, nnx_grads, loss = nnx_step(module, optimizer, x, target)
        np.testing.assert_array_equal(nnx_value, linen_value)
        np.testing.assert_array_equal(loss, linen_value)
        _assert_equal_trees(nnx_out, linen_out)
        _assert_equal_trees(_params(nnx_grads), linen_grads["params"])
        if recipe is not None:
            _assert_equal_trees(_fp8(nnx_grads), linen_grads[OVERWRITE_WITH_GRADIENT])
        # Parameters after the optimizer and FP8 state after the overwrite, bit for bit.
        _assert_equal_trees(te_nnx.linen_variables(module), variables)
    if recipe is not None:
        fp8 = variables[OVERWRITE_WITH_GRADIENT]
        assert all(float(v[0]) > 0 for k, v in fp8.items() if k.endswith("amax_history"))


def test_load_linen_variables_of_a_nested_model():
    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y, _ = te_nn.LayerNormDenseGeneral(features=HIDDEN, recipe=DELAYED, name="proj")(x)
            out, _ = te_nn.LayerNormMLP(intermediate_dim=32, recipe=DELAYED, name="mlp")(x + y)
            return out

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.proj = te_nnx.LayerNormDenseGeneral(HIDDEN, HIDDEN, recipe=DELAYED, rngs=rngs)
            self.mlp = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=32, recipe=DELAYED, rngs=rngs)

        def __call__(self, x):
            y, _ = self.proj(x)
            return self.mlp(x + y)[0]

    x = _x()
    variables = freeze(LinenBlock().init(jax.random.key(0), x))  # a FrozenDict is accepted too
    block = NnxBlock(nnx.Rngs(3))
    te_nnx.load_linen_variables(block, variables)
    _assert_equal_trees(te_nnx.linen_variables(block), nn.meta.unbox(variables).unfreeze())
    np.testing.assert_array_equal(block(x), LinenBlock().apply(variables, x))


def test_load_linen_variables_refuses_missing_unexpected_and_misshapen_variables():
    x = _x()
    variables = nn.meta.unbox(
        te_nn.DenseGeneral(features=8, recipe=DELAYED).init(jax.random.key(0), x)
    )
    layer = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=nnx.Rngs(0))
    params = variables["params"]

    missing = {**variables, "params": {"kernel": params["kernel"]}}
    with pytest.raises(ValueError, match=re.escape("""missing ["['bias']"], unexpected []""")):
        te_nnx.load_linen_variables(layer, missing)
    unexpected = {**variables, "params": {**params, "scale": jnp.ones((HIDDEN,), F32)}}
    with pytest.raises(
        ValueError, match=re.escape("""'params' collection does not fit DenseGeneral: missing []""")
    ) as info:
        te_nnx.load_linen_variables(layer, unexpected)
    assert "['scale']" in str(info.value)
    no_fp8 = {"params": params}
    with pytest.raises(ValueError, match="'_overwrite_with_gradient' collection does not fit"):
        te_nnx.load_linen_variables(layer, no_fp8)
    misshapen = {**variables, "params": {**params, "kernel": jnp.zeros((2 * HIDDEN, 8), F32)}}
    with pytest.raises(
        ValueError,
        match=re.escape("params['kernel'] has shape (32, 8) but the module's has (16, 8)"),
    ):
        te_nnx.load_linen_variables(layer, misshapen)
    # A history of another length is refused the same way.
    fp8 = dict(variables[OVERWRITE_WITH_GRADIENT])
    fp8["x_amax_history"] = jnp.zeros((2 * HISTORY_LEN,), F32)
    with pytest.raises(ValueError, match=re.escape("['x_amax_history'] has shape (8,)")):
        te_nnx.load_linen_variables(layer, {**variables, OVERWRITE_WITH_GRADIENT: fp8})

    # FP8 state given to a module that keeps none is unexpected.
    plain = te_nnx.DenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="_overwrite_with_gradient' collection does not fit"):
        te_nnx.load_linen_variables(plain, variables)


def test_a_refused_load_leaves_the_module_unchanged():
    x = _x()
    variables = nn.meta.unbox(
        te_nn.DenseGeneral(features=8, recipe=DELAYED).init(jax.random.key(0), x)
    )
    layer = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=nnx.Rngs(0))
    before = te_nnx.linen_variables(layer)
    # Valid parameters, but the FP8 collection is missing: nothing may be loaded.
    with pytest.raises(ValueError, match="'_overwrite_with_gradient' collection does not fit"):
        te_nnx.load_linen_variables(layer, {"params": variables["params"]})
    _assert_equal_trees(te_nnx.linen_variables(layer), before)


# ----------------------------------------------------------------------------- state trees


def _shapes(tree):
    return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)


def test_parameter_tree_dtypes_and_sharding_metadata():
    layer = te_nnx.LayerNormDenseGeneral(
        HIDDEN,
        (3, 8),
        kernel_axes=("embed", "qkv", "heads"),
        use_bias=True,
        bias_axes=("qkv", "heads"),
        param_dtype=jnp.bfloat16,
        recipe=DELAYED,
        rngs=nnx.Rngs(0),
    )
    assert _shapes(_params(layer)) == {
        "scale": ((HIDDEN,), "bfloat16"),
        "ln_bias": ((HIDDEN,), "bfloat16"),
        "kernel": ((HIDDEN, 3, 8), "bfloat16"),
        "bias": ((3, 8), "bfloat16"),
    }
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
    assert specs == {
        "scale": P("embed"),
        "ln_bias": P("embed"),
        "kernel": P("embed", "qkv", "heads"),
        "bias": P("qkv", "heads"),
    }
    # FP8 state stays float32 whatever the parameters' dtype.
    assert _shapes(_fp8(layer)) == {
        name: ((HISTORY_LEN,) if name.endswith("history") else (1,), "float32")
        for name in _fp8_names()
    }

    mlp = te_nnx.LayerNormMLP(
        HIDDEN, intermediate_dim=32, activations=("silu", "linear"), use_bias=True, rngs=nnx.Rngs(0)
    )
    assert _shapes(_params(mlp)) == {
        "scale": ((HIDDEN,), "float32"),
        "ln_bias": ((HIDDEN,), "float32"),
        "wi_kernel": ((HIDDEN, 2, 32), "float32"),
        "wo_kernel": ((32, HIDDEN), "float32"),
        "wi_bias": ((2, 32), "float32"),
        "wo_bias": ((HIDDEN,), "float32"),
    }
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(mlp, nnx.Param)))
    assert specs["wi_kernel"] == P("embed", "act", "mlp")
    assert specs["wo_kernel"] == P("mlp", "embed")
    assert specs["wi_bias"] == P("act", "mlp") and specs["wo_bias"] == P("embed")

    norm = te_nnx.LayerNorm(HIDDEN, rngs=nnx.Rngs(0))
    assert _shapes(_params(norm)) == {
        "scale": ((HIDDEN,), "float32"),
        "ln_bias": ((HIDDEN,), "float32"),
    }
    assert _fp8(norm) == {}

    dense = te_nnx.DenseGeneral((3, HIDDEN), 8, axis=(-2, -1), use_bias=False, rngs=nnx.Rngs(0))
    assert _shapes(_params(dense)) == {"kernel": ((3, HIDDEN, 8), "float32")}
    assert dense(_x()).shape == (4, 8)


@pytest.mark.parametrize(
    ("make", "postfixes"),
    [
        (lambda r, rngs: te_nnx.DenseGeneral(HIDDEN, 8, recipe=r, rngs=rngs), [""]),
        (lambda r, rngs: te_nnx.LayerNormDenseGeneral(HIDDEN, 8, recipe=r, rngs=rngs), [""]),
        (
            lambda r, rngs: te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, recipe=r, rngs=rngs),
            ["_0", "_1"],
        ),
    ],
    ids=["dense_general", "layernorm_dense_general", "layernorm_mlp"],
)
def test_fp8_state_is_fp8meta_named_as_in_linen(make, postfixes):
    layer = make(DELAYED, nnx.Rngs(0))
    fp8 = _fp8(layer)
    assert sorted(fp8) == sorted(n for p in postfixes for n in _fp8_names(p))
    for name, value in fp8.items():
        assert isinstance(getattr(layer, name), te_nnx.Fp8Meta), name
        # Fresh state: an empty history, scale_inv 1.
        np.testing.assert_array_equal(value, 0.0 if name.endswith("history") else 1.0)
    # No state without FP8, nor for current scaling (it keeps none).
    assert _fp8(make(None, nnx.Rngs(0))) == {}
    assert _fp8(make(Float8CurrentScaling(), nnx.Rngs(0))) == {}


def test_fp8meta_is_the_linen_fp8_collection_and_stays_out_of_the_optimizer():
    assert OVERWRITE_WITH_GRADIENT == "_overwrite_with_gradient"
    assert variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT) is te_nnx.Fp8Meta
    assert variablelib.variable_name_from_type(te_nnx.Fp8Meta) == OVERWRITE_WITH_GRADIENT
    assert issubclass(te_nnx.Fp8Meta, nnx.Variable) and not issubclass(te_nnx.Fp8Meta, nnx.Param)

    mlp = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, recipe=DELAYED, rngs=nnx.Rngs(0))
    # optax.adam's integer step count needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        optimizer = nnx.Optimizer(mlp, optax.adam(1e-3), wrt=nnx.Param)
    opt_state = nnx.state(optimizer.opt_state)
    leaves = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )[0]
    assert not any(isinstance(v, te_nnx.Fp8Meta) for _, v in leaves)
    for path, _ in leaves:
        path = jax.tree_util.keystr(path)
        assert "amax_history" not in path and "scale_inv" not in path, path
    # Adam's moments cover exactly the parameters.
    adam_state = nnx.to_pure_dict(opt_state)[0]
    assert jax.tree.structure(adam_state["mu"]) == jax.tree.structure(_params(mlp))


# ----------------------------------------------------------------------------- a training loop


class _Regressor(nnx.Module):
    """A DenseGeneral (FP8, delayed scaling) inside a user's module."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _step_output(model, x):
    """``model(x)`` as a training step computes it, the FP8 state differentiated: with the
    stored scales (elsewhere a never-updated state is scaled just in time)."""

    def loss_and_out(model):
        out = model(x)
        return jnp.sum(out), out

    return te_nnx.value_and_grad(loss_and_out, has_aux=True)(model)[0][1]


def test_fp8_training_loop_lowers_the_loss_and_follows_the_recipe():
    n_steps = 10
    rng = np.random.default_rng(1)
    teacher = jnp.asarray(rng.standard_normal((HIDDEN, 8)) / np.sqrt(HIDDEN), F32)
    xs = [_x((8, HIDDEN), seed=20 + s) for s in range(n_steps)]
    targets = [x @ teacher for x in xs]
    x_eval = _x((64, HIDDEN), seed=99)
    target_eval = x_eval @ teacher

    def loss_fn(model, x, target):
        return _mse(model(x), target)

    model = _Regressor(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, target):
        return te_nnx.train_step(model, optimizer, loss_fn, x, target)

    evaluate = nnx.jit(loss_fn)
    forward = nnx.jit(_step_output)
    initial_eval_loss = float(evaluate(model, x_eval, target_eval))
    fp8 = _fp8(model.dense)
    for step, (x, target) in enumerate(zip(xs, targets, strict=True)):
        old_kernel = model.dense.kernel[...]
        grad_y = jax.grad(_mse)(forward(model, x), target)
        loss = train_step(model, optimizer, x, target)
        assert np.isfinite(float(loss))
        assert int(optimizer.step[...]) == step + 1
        new_fp8 = _fp8(model.dense)
        amaxes = {
            "x": (amax_of(x), 0),
            "kernel": (amax_of(old_kernel), 0),
            "grad": (amax_of(grad_y), RECOMPUTED_RTOL),
        }
        assert_delayed_step(fp8, new_fp8, "", amaxes)
        assert bool(jnp.any(model.dense.kernel[...] != old_kernel))
        fp8 = new_fp8
    final_eval_loss = float(evaluate(model, x_eval, target_eval))
    assert final_eval_loss < 0.5 * initial_eval_loss, (initial_eval_loss, final_eval_loss)
    # After 10 steps the 4-slot histories hold the newest 4 amax values.
    assert all(np.all(v > 0) for k, v in fp8.items() if k.endswith("history"))


# ----------------------------------------------------------------------------- transforms


class _Block(nnx.Module):
    """One layer of a stack: LayerNormDenseGeneral back to the hidden size, with a residual."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = te_nnx.LayerNormDenseGeneral(
            HIDDEN, HIDDEN, kernel_axes=("embed", "mlp"), recipe=DELAYED, rngs=rngs
        )

    def __call__(self, x):
        y, _ = self.dense(x)
        return x + y


N_LAYERS = 3


class _ScannedStack(nnx.Module):
    """``N_LAYERS`` blocks created with ``nnx.vmap`` (stacked state), applied with ``nnx.scan``."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=N_LAYERS)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(rngs):
            return _Block(rngs)

        self.layers = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.layers)


class _UnrolledStack(nnx.Module):
    """The same layers as separate modules, applied one after the other."""

    def __init__(self, stacked: _ScannedStack):
        blocks = []
        for i in range(N_LAYERS):
            block = _Block(nnx.Rngs(100 + i))
            nnx.update(block, jax.tree.map(lambda a, i=i: a[i], nnx.state(stacked.layers)))
            blocks.append(block)
        self.blocks = nnx.List(blocks)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _sum_of_squares(model, x):
    return jnp.sum(model(x) ** 2)


@pytest.mark.slow
def test_scan_over_vmapped_layers_keeps_per_layer_fp8_state():
    x = _x((4, HIDDEN))
    stack = _ScannedStack(nnx.Rngs(0))
    layers = stack.layers.dense
    assert layers.kernel[...].shape == (N_LAYERS, HIDDEN, HIDDEN)
    assert layers.x_amax_history[...].shape == (N_LAYERS, HISTORY_LEN)
    assert layers.x_scale_inv[...].shape == (N_LAYERS, 1)
    assert nnx.get_partition_spec(nnx.state(stack, nnx.Param))["layers"]["dense"][
        "kernel"
    ].get_value() == P("layers", "embed", "mlp")
    unrolled = _UnrolledStack(stack)

    grad_fn = nnx.jit(te_nnx.value_and_grad(_sum_of_squares))
    value, grads = grad_fn(stack, x)
    unrolled_value, unrolled_grads = grad_fn(unrolled, x)
    # (Within an ulp or so: the scanned and the unrolled programs fuse differently.)
    np.testing.assert_allclose(value, unrolled_value, rtol=1e-6)
    stacked_expected = {
        "params": jax.tree.map(
            lambda *a: jnp.stack(a), *_params(unrolled_grads)["blocks"].values()
        ),
        "fp8": jax.tree.map(lambda *a: jnp.stack(a), *_fp8(unrolled_grads)["blocks"].values()),
    }
    assert_tree_close(_params(grads)["layers"], stacked_expected["params"], 1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
        _fp8(grads)["layers"],
        stacked_expected["fp8"],
    )
    # Each layer's state recorded its own input: the layers' inputs differ.
    x_history = np.asarray(_fp8(grads)["layers"]["dense"]["x_amax_history"])
    assert len(set(x_history[:, 0].tolist())) == N_LAYERS

    # The train step overwrites each layer's slice with that layer's new state.
    optimizer = nnx.Optimizer(stack, optax.sgd(1e-3), wrt=nnx.Param)
    nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, _sum_of_squares, x))(stack, optimizer, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), _fp8(stack), _fp8(grads))


def test_remat_keeps_gradients_and_fp8_state():
    x = _x()
    mlp = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=32, recipe=DELAYED, rngs=nnx.Rngs(0))
    policy = jax.checkpoint_policies.save_only_these_names("ffn1")

    def plain_loss(model, x):
        return jnp.sum(model(x, deterministic=True)[0] ** 2)

    def remat_loss(model, x):
        forward = nnx.remat(lambda m, x: m(x, deterministic=True)[0], policy=policy)
        return jnp.sum(forward(model, x) ** 2)

    value, grads = nnx.jit(te_nnx.value_and_grad(plain_loss))(mlp, x)
    remat_value, remat_grads = nnx.jit(te_nnx.value_and_grad(remat_loss))(mlp, x)
    np.testing.assert_allclose(remat_value, value, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        nnx.to_pure_dict(remat_grads),
        nnx.to_pure_dict(grads),
    )
    assert float(_fp8(remat_grads)["x_0_amax_history"][0]) > 0


def _microbatches(k=3):
    """``k`` microbatches ``(x, output weight)`` for a DenseGeneral(16 -> 8).

    Each has a different largest tensor, so that the merged state takes entries from several.
    """
    rng = np.random.default_rng(5)
    scales = [(3.0, 0.5), (1.0, 2.0), (0.5, 1.0)][:k]
    xs = jnp.stack([jnp.asarray(sx * rng.standard_normal((4, HIDDEN)), F32) for sx, _ in scales])
    ws = jnp.stack([jnp.asarray(sw * rng.standard_normal((4, 8)), F32) for _, sw in scales])
    return xs, ws


def _weighted(model, x, weight):
    # The output gradient is ``weight`` exactly, so its amax is known bit for bit.
    return jnp.sum(model(x) * weight)


@pytest.mark.slow
def test_gradient_accumulation_loop_merges_fp8_state_by_max_and_sums_gradients():
    xs, ws = _microbatches()
    layer = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=nnx.Rngs(0))

    def accumulated_loss(model, xs, ws):
        return sum(_weighted(model, xs[i], ws[i]) for i in range(xs.shape[0]))

    def scanned_loss(model, xs, ws):
        @nnx.scan(in_axes=(nnx.Carry, None, 0, 0), out_axes=nnx.Carry)
        def body(total, model, x, weight):
            return total + _weighted(model, x, weight)

        return body(jnp.zeros((), F32), model, xs, ws)

    grad_one = nnx.jit(te_nnx.value_and_grad(_weighted))
    separate = [grad_one(layer, xs[i], ws[i])[1] for i in range(xs.shape[0])]
    expected_fp8 = jax.tree.map(lambda *s: jnp.max(jnp.stack(s), axis=0), *map(_fp8, separate))
    expected_params = jax.tree.map(lambda *g: sum(g), *map(_params, separate))
    for loss in (accumulated_loss, scanned_loss):
        _, grads = nnx.jit(te_nnx.value_and_grad(loss))(layer, xs, ws)
        # Parameter gradients add up over the microbatches ...
        assert_tree_close(_params(grads), expected_params, 1e-5)
        # ... and the FP8 state updates merge by elementwise max.
        _assert_equal_trees(_fp8(grads), expected_fp8)
        amaxes = {
            "x": (amax_of(xs), 0),
            "kernel": (amax_of(layer.kernel[...]), 0),
            "grad": (amax_of(ws), 0),
        }
        assert_delayed_step(_fp8(layer), _fp8(grads), "", amaxes)

    # The layer marks its own reads, so a plain nnx.value_and_grad of the unrolled loop (the
    # layer called once per microbatch in one trace) merges by max too ...
    _, unmarked = nnx.jit(
        nnx.value_and_grad(accumulated_loss, argnums=nnx.DiffState(0, te_nnx.Fp8Meta))
    )(layer, xs, ws)
    _assert_equal_trees(_fp8(unmarked), expected_fp8)
    # ... while under nnx.scan the iterations' updates add up (the scan's transpose sums what
    # it broadcast): there the mark of te_flax.nnx.value_and_grad is needed.
    _, scanned = nnx.jit(
        nnx.value_and_grad(scanned_loss, argnums=nnx.DiffState(0, te_nnx.Fp8Meta))
    )(layer, xs, ws)
    added = sum(float(_fp8(g)["x_amax_history"][0]) for g in separate)
    np.testing.assert_allclose(_fp8(scanned)["x_amax_history"][0], added, rtol=1e-6)

    # The train step overwrites the state with the merged update.
    optimizer = nnx.Optimizer(layer, optax.sgd(1e-3), wrt=nnx.Param)
    nnx.jit(lambda m, o, xs, ws: te_nnx.train_step(m, o, accumulated_loss, xs, ws))(
        layer, optimizer, xs, ws
    )
    _assert_equal_trees(_fp8(layer), expected_fp8)


class _TwoCopies(nnx.Module):
    """Two DenseGeneral layers with the same values, applied one after the other."""

    def __init__(self, layer):
        self.first = te_nnx.DenseGeneral(HIDDEN, HIDDEN, recipe=DELAYED, rngs=nnx.Rngs(1))
        self.second = te_nnx.DenseGeneral(HIDDEN, HIDDEN, recipe=DELAYED, rngs=nnx.Rngs(2))
        nnx.update(self.first, nnx.state(layer))
        nnx.update(self.second, nnx.state(layer))

    def __call__(self, x):
        return self.second(self.first(x))


def test_a_module_called_twice_merges_its_fp8_updates_by_max():
    x = _x((4, HIDDEN))
    layer = te_nnx.DenseGeneral(HIDDEN, HIDDEN, recipe=DELAYED, rngs=nnx.Rngs(0))
    copies = _TwoCopies(layer)

    def twice(model, x):
        return jnp.sum(model(model(x)) ** 2)

    _, grads = nnx.jit(te_nnx.value_and_grad(twice))(layer, x)
    _, copy_grads = nnx.jit(te_nnx.value_and_grad(_sum_of_squares))(copies, x)
    # The same computation with two states: the shared state's update is the max of theirs,
    # its parameter gradient the sum.
    expected = jax.tree.map(jnp.maximum, _fp8(copy_grads)["first"], _fp8(copy_grads)["second"])
    _assert_equal_trees(_fp8(grads), expected)
    summed = jax.tree.map(jnp.add, _params(copy_grads)["first"], _params(copy_grads)["second"])
    assert_tree_close(_params(grads), summed, 1e-5)
    # Both uses recorded: the second call's input has a larger amax than x.
    first_call_amax = float(_fp8(copy_grads)["first"]["x_amax_history"][0])
    assert first_call_amax == float(amax_of(x))
    assert float(_fp8(grads)["x_amax_history"][0]) > first_call_amax


# ----------------------------------------------------------------------------- Linen bridge


def _teacher_problem(n_steps, features, seed=0):
    rng = np.random.default_rng(seed)
    teacher = jnp.asarray(rng.standard_normal((HIDDEN, features)) / np.sqrt(HIDDEN), F32)
    xs = [_x((8, HIDDEN), seed=40 + s) for s in range(n_steps)]
    x_eval = _x((64, HIDDEN), seed=98)
    return teacher, xs, x_eval


def test_nnx_module_inside_a_linen_model_through_to_linen():
    class LinenModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nnx.bridge.to_linen(
                te_nnx.DenseGeneral,
                HIDDEN,
                8,
                kernel_axes=("embed", "mlp"),
                recipe=DELAYED,
                name="dense",
            )(x)
            return nn.Dense(4, name="head")(h)

    n_steps = 5
    teacher, xs, x_eval = _teacher_problem(n_steps, 4)
    model = LinenModel()
    variables = model.init(jax.random.key(0), xs[0])
    # The NNX module's FP8 state lands in the Linen FP8 collection, under the same names.
    assert set(variables) == {"params", OVERWRITE_WITH_GRADIENT}
    assert sorted(variables[OVERWRITE_WITH_GRADIENT]["dense"]) == _fp8_names()
    assert nn.get_partition_spec(variables)["params"]["dense"]["kernel"] == P("embed", "mlp")

    def loss_fn(variables, x):
        return _mse(model.apply(merge_fp8_state(variables), x), x @ teacher)

    @jax.jit
    def step(state, x):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, x)
        return state.apply_gradients(grads=grads), loss

    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(0.05)
    )
    evaluate = jax.jit(loss_fn)
    initial_eval_loss = float(evaluate(state.params, x_eval))
    for x in xs:
        fp8 = state.params[OVERWRITE_WITH_GRADIENT]["dense"]
        kernel = nn.meta.unbox(state.params["params"]["dense"]["kernel"])
        state, _ = step(state, x)
        amaxes = {"x": (amax_of(x), 0), "kernel": (amax_of(kernel), 0)}
        assert_delayed_step(fp8, state.params[OVERWRITE_WITH_GRADIENT]["dense"], "", amaxes)
    assert float(evaluate(state.params, x_eval)) < 0.8 * initial_eval_loss


def test_linen_module_inside_an_nnx_model_through_to_nnx():
    class NnxModel(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.bridge.ToNNX(
                te_nn.DenseGeneral(features=8, kernel_axes=("embed", "mlp"), recipe=DELAYED),
                rngs=rngs,
            )
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(self.dense(x))

    n_steps = 5
    teacher, xs, x_eval = _teacher_problem(n_steps, 4)
    # Flax's ToNNX turns the Linen logical partitioning into an out_sharding, which needs a
    # mesh unless eager sharding is off.
    with nnx.use_eager_sharding(False):
        model = NnxModel(nnx.Rngs(0))
        nnx.bridge.lazy_init(model, xs[0])
    # The Linen FP8 collection comes back as Fp8Meta variables, under the same names.
    assert sorted(_fp8(model)["dense"]) == _fp8_names()
    assert isinstance(model.dense.x_amax_history, te_nnx.Fp8Meta)
    assert isinstance(model.dense.kernel, nnx.Param)

    def loss_fn(model, x):
        return _mse(model(x), x @ teacher)

    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, loss_fn, x))
    evaluate = nnx.jit(loss_fn)
    initial_eval_loss = float(evaluate(model, x_eval))
    for x in xs:
        fp8 = _fp8(model)["dense"]
        kernel = model.dense.kernel[...]
        step(model, optimizer, x)
        amaxes = {"x": (amax_of(x), 0), "kernel": (amax_of(kernel), 0)}
        assert_delayed_step(fp8, _fp8(model)["dense"], "", amaxes)
    assert float(evaluate(model, x_eval)) < 0.8 * initial_eval_loss


# ----------------------------------------------------------------------------- dropout


def _dropout_mlp(rate, rngs):
    return te_nnx.LayerNormMLP(
        HIDDEN, intermediate_dim=64, intermediate_dropout_rate=rate, rngs=rngs
    )


def test_intermediate_dropout_is_deterministic_on_request_and_driven_by_the_rngs():
    x = _x()
    mlp = _dropout_mlp(0.5, nnx.Rngs(0))
    no_dropout = _dropout_mlp(0.0, nnx.Rngs(0))
    _assert_equal_trees(_params(mlp), _params(no_dropout))
    deterministic, _ = mlp(x, deterministic=True)
    np.testing.assert_allclose(deterministic, no_dropout(x)[0], rtol=1e-6, atol=1e-6)
    first, _ = mlp(x)
    second, _ = mlp(x)
    assert not np.allclose(first, second)  # the rng stream advanced
    assert not np.allclose(first, deterministic)
    again, _ = _dropout_mlp(0.5, nnx.Rngs(0))(x)
    np.testing.assert_array_equal(again, first)  # the same seed, the same mask
    # Under nnx.jit too, every call draws a new mask.
    forward = nnx.jit(lambda model, x: model(x)[0])
    assert not np.allclose(forward(mlp, x), forward(mlp, x))
    # A dropout stream of its own: the same parameters, another mask.
    other = _dropout_mlp(0.5, nnx.Rngs(params=0, dropout=1))
    _assert_equal_trees(_params(other), _params(mlp))
    assert not np.allclose(other(x)[0], first)


def test_dropout_in_an_fp8_train_step_advances_the_rng():
    x = _x()
    mlp = te_nnx.LayerNormMLP(
        HIDDEN,
        intermediate_dim=64,
        intermediate_dropout_rate=0.5,
        recipe=DELAYED,
        rngs=nnx.Rngs(0),
    )
    optimizer = nnx.Optimizer(mlp, optax.sgd(1e-3), wrt=nnx.Param)

    def loss_fn(model, x):
        return jnp.sum(model(x)[0] ** 2)

    step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, loss_fn, x))
    counts = [int(mlp.dropout.rngs.count[...])]
    for _ in range(2):
        step(mlp, optimizer, x)
        counts.append(int(mlp.dropout.rngs.count[...]))
    # The train step writes the advanced rng back to the model: a new mask every step.
    assert counts[0] < counts[1] < counts[2], counts
    assert float(_fp8(mlp)["x_1_amax_history"][1]) > 0  # both steps recorded


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "module",
    ["dense_general", "layernorm_dense_general", "layernorm_mlp"],
)
def test_lora_with_zero_b_gives_the_base_output(module):
    make = {
        "dense_general": lambda **kw: te_nnx.DenseGeneral(HIDDEN, 8, **kw),
        "layernorm_dense_general": lambda **kw: te_nnx.LayerNormDenseGeneral(HIDDEN, 8, **kw),
        "layernorm_mlp": lambda **kw: te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=32, **kw),
    }[module]
    x = _x()
    base = make(rngs=nnx.Rngs(0))
    lora = make(
        enable_low_rank_adaptation=True,
        low_rank_adaptation_dim=4,
        low_rank_adaptation_alpha=8.0,
        rngs=nnx.Rngs(0),
    )
    params = _params(lora)
    lora_names = sorted(k for k in params if "lora" in k)
    assert (
        lora_names
        == {
            "dense_general": ["lora_a_kernel", "lora_b_kernel"],
            "layernorm_dense_general": ["lora_a_kernel", "lora_b_kernel"],
            "layernorm_mlp": [
                "wi_lora_a_kernel",
                "wi_lora_b_kernel",
                "wo_lora_a_kernel",
                "wo_lora_b_kernel",
            ],
        }[module]
    )
    # The base parameters are drawn first, so the same seed gives the same base layer.
    _assert_equal_trees({k: v for k, v in params.items() if "lora" not in k}, _params(base))
    np.testing.assert_allclose(_first(lora(x)), _first(base(x)), rtol=1e-6, atol=1e-6)
    b_name = lora_names[1]
    getattr(lora, b_name)[...] = jnp.ones_like(params[b_name])
    assert not np.allclose(_first(lora(x)), _first(base(x)))


# Option sets checked against Linen: name -> (module kind, attributes).
_LORA = dict(enable_low_rank_adaptation=True, low_rank_adaptation_dim=4)
_OPTIONS = {
    "lora_dense_general": ("dense_general", dict(features=8, **_LORA, recipe=DELAYED)),
    "lora_layernorm_mlp": (
        "layernorm_mlp",
        dict(intermediate_dim=32, **_LORA, low_rank_adaptation_alpha=2.0, recipe=DELAYED),
    ),
    "layernorm_dense_general_options": (
        "layernorm_dense_general",
        dict(features=8, return_layernorm_output=True, depth_scaling=4.0, **_LORA, recipe=DELAYED),
    ),
    "layernorm_mlp_ln_output": (
        "layernorm_mlp",
        dict(intermediate_dim=32, return_layernorm_output=True, layernorm_type="rmsnorm"),
    ),
    "without_layernorm": (
        "layernorm_dense_general",
        dict(features=8, enable_layernorm=False, return_layernorm_output=True, recipe=DELAYED),
    ),
    "bf16_compute": (
        "layernorm_dense_general",
        dict(features=8, dtype=jnp.bfloat16, recipe=DELAYED),
    ),
}


@pytest.mark.parametrize("name", list(_OPTIONS))
def test_options_agree_with_linen(name):
    kind, attributes = _OPTIONS[name]
    linen_module, make_nnx = _twins(kind, **attributes)
    x = _x()
    variables = nn.meta.unbox(linen_module.init(jax.random.key(0), x))
    # A non-zero LoRA B, so that the adapter shows in the output.
    variables["params"] = {
        k: (jnp.full_like(v, 0.1) if "lora_b" in k else v) for k, v in variables["params"].items()
    }
    module = make_nnx(nnx.Rngs(3))
    te_nnx.load_linen_variables(module, variables)

    def nnx_loss(model, x):
        out = model(x)
        return jnp.sum(_first(out).astype(F32) ** 2), out

    def linen_loss(variables, x):
        out = linen_module.apply(merge_fp8_state(variables), x)
        return jnp.sum(_first(out).astype(F32) ** 2), out

    (_, out), grads = nnx.jit(te_nnx.value_and_grad(nnx_loss, has_aux=True))(module, x)
    (_, expected), expected_grads = jax.jit(jax.value_and_grad(linen_loss, has_aux=True))(
        variables, x
    )
    _assert_equal_trees(out, expected)
    if attributes.get("return_layernorm_output"):
        assert out[1].shape == x.shape
    _assert_equal_trees(_params(grads), expected_grads["params"])
    if OVERWRITE_WITH_GRADIENT in variables:
        _assert_equal_trees(_fp8(grads), expected_grads[OVERWRITE_WITH_GRADIENT])


def test_return_layernorm_output_and_depth_scaling():
    x = _x()
    layer = te_nnx.LayerNormDenseGeneral(
        HIDDEN, 8, return_layernorm_output=True, depth_scaling=4.0, rngs=nnx.Rngs(0)
    )
    plain = te_nnx.LayerNormDenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0))
    out, ln = layer(x)
    plain_out, plain_ln = plain(x)
    assert plain_ln is None
    norm = te_nnx.LayerNorm(HIDDEN, rngs=nnx.Rngs(0))(x)  # scale 1, bias 0, as the layer's
    np.testing.assert_allclose(ln, norm, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, plain_out / 4.0, rtol=1e-6)


def test_recipe_attribute_and_autocast_give_the_same_training():
    xs = [_x(seed=s) for s in range(2)]

    def loss_fn(model, x):
        return jnp.sum(model(x)[0] ** 2)

    def train(model):
        optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
        step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, loss_fn, x))
        return [step(model, optimizer, x) for x in xs]

    with_attribute = te_nnx.LayerNormMLP(
        HIDDEN, intermediate_dim=32, recipe=DELAYED, rngs=nnx.Rngs(0)
    )
    attribute_losses = train(with_attribute)
    # recipe=None: the recipe comes from te_flax.autocast, active at build and at every trace.
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        from_context = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=32, rngs=nnx.Rngs(0))
        assert from_context.recipe is None
        context_losses = train(from_context)
    np.testing.assert_array_equal(context_losses, attribute_losses)
    _assert_equal_trees(
        te_nnx.linen_variables(from_context), te_nnx.linen_variables(with_attribute)
    )
    assert float(_fp8(from_context)["x_0_amax_history"][1]) > 0

    # The same holds in Linen, with the same values.
    linen_module = te_nn.LayerNormMLP(intermediate_dim=32)
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        variables = linen_module.init(jax.random.key(0), xs[0])
        module = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=32, rngs=nnx.Rngs(5))
        te_nnx.load_linen_variables(module, variables)
        np.testing.assert_array_equal(module(xs[0])[0], linen_module.apply(variables, xs[0])[0])


# ----------------------------------------------------------------------------- errors


def _refusal(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_fp8_call_of_a_module_built_without_fp8_is_refused():
    x = _x()
    dense = te_nnx.DenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0))
    mlp = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, rngs=nnx.Rngs(0))
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        message = _refusal(lambda: dense(x))
        mlp_message = _refusal(lambda: mlp(x))
    assert message == _refusal(
        lambda: check_state_matches("DenseGeneral", DELAYED, set(_fp8_names()), set())
    )
    assert "initialised without FP8" in message
    assert mlp_message == _refusal(
        lambda: check_state_matches("LayerNormMLP", DELAYED, set(_fp8_names("_0")), set())
    )


def test_plain_call_of_a_module_built_with_fp8_is_refused():
    x = _x()
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        layer = te_nnx.LayerNormDenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0))
    message = _refusal(lambda: layer(x))
    assert message == _refusal(
        lambda: check_state_matches("LayerNormDenseGeneral", None, set(), set(_fp8_names()))
    )
    assert "applied without FP8" in message
    # Current scaling keeps no state either.
    with te_flax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        assert "which keeps none" in _refusal(lambda: layer(x))


def test_changed_history_length_is_refused():
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        layer = te_nnx.DenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0))
    with (
        te_flax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)),
        pytest.raises(ValueError, match="amax_history_len changed"),
    ):
        layer(_x())


def test_wrong_input_feature_size_is_refused():
    layer = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "LayerNormMLP was built for input features (16,) but got an input of shape"
        ),
    ):
        layer(_x((2, 32)))
    dense = te_nnx.DenseGeneral((3, HIDDEN), 8, axis=(-2, -1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("built for input features (3, 16)")):
        dense(_x((4, 2, HIDDEN)))


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: te_nnx.LayerNorm(HIDDEN, rngs=nnx.Rngs(0), **kw),
        lambda **kw: te_nnx.DenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0), **kw),
        lambda **kw: te_nnx.LayerNormDenseGeneral(HIDDEN, 8, rngs=nnx.Rngs(0), **kw),
        lambda **kw: te_nnx.LayerNormMLP(HIDDEN, rngs=nnx.Rngs(0), **kw),
    ],
    ids=["layernorm", "dense_general", "layernorm_dense_general", "layernorm_mlp"],
)
def test_unknown_attribute_is_refused_with_the_list_of_attributes(make):
    with pytest.raises(
        TypeError, match=re.escape("got unknown attributes ['kernel_size']")
    ) as info:
        make(kernel_size=3)
    assert "'param_dtype'" in str(info.value) and "'dtype'" in str(info.value)


def test_layernorm_has_no_recipe_attribute():
    with pytest.raises(TypeError, match=re.escape("LayerNorm got unknown attributes ['recipe']")):
        te_nnx.LayerNorm(HIDDEN, recipe=DELAYED, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rngs", [0, jax.random.key(0), None], ids=["int", "key", "none"])
def test_rngs_must_be_an_nnx_rngs(rngs):
    with pytest.raises(TypeError, match=re.escape("rngs must be an nnx.Rngs")):
        te_nnx.DenseGeneral(HIDDEN, 8, rngs=rngs)


def test_unknown_activation_and_missing_features_are_refused():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, activations=("swish",), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="features is required"):
        te_nnx.DenseGeneral(HIDDEN, None, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: te_nnx.LayerNormDenseGeneral(HIDDEN, 8, axis=0, rngs=nnx.Rngs(0)),
            "only (axis=-1)",
        ),
        (
            lambda: te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=8, axis=-2, rngs=nnx.Rngs(0)),
            "only (axis=-1)",
        ),
        (lambda: te_nnx.DenseGeneral(HIDDEN, 8, axis=0, rngs=nnx.Rngs(0)), "trailing axes"),
    ],
    ids=["layernorm_dense_general", "layernorm_mlp", "dense_general"],
)
def test_axis_other_than_last_is_refused(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()(_x())


@pytest.mark.parametrize(
    "wrt", [nnx.Variable, (nnx.Param, te_nnx.Fp8Meta), ...], ids=["variable", "tuple", "all"]
)
def test_train_step_refuses_an_optimizer_not_restricted_to_params(wrt):
    layer = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(layer, optax.sgd(0.1), wrt=wrt)
    before = te_nnx.linen_variables(layer)
    with pytest.raises(ValueError, match=re.escape("must be built with wrt=nnx.Param")):
        te_nnx.train_step(layer, optimizer, lambda m, x: jnp.sum(m(x)), _x())
    _assert_equal_trees(te_nnx.linen_variables(layer), before)
