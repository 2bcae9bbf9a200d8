"""The Linen and NNX modules under the block-scaled recipes: no FP8 variables, results at the
formats' tolerances, Linen and NNX bit for bit, autocast, and stochastic rounding's RNG."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import MXFP8BlockScaling, NVFP4BlockScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT
from tests.helpers import (
    BLOCK_BACKWARD_TOLERANCE,
    BLOCK_FORWARD_TOLERANCE,
    F32,
    normal,
    relative_error,
)

HIDDEN = 64
RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
NVFP4_SR = NVFP4BlockScaling()

# Every contraction a multiple of 32: hidden 64, 4 x 8 tokens, features 96, intermediate 128.
MODULES = {
    "dense_general": (te_nn.DenseGeneral, te_nnx.DenseGeneral, dict(features=(2, 48))),
    "layernorm_dense_general": (
        te_nn.LayerNormDenseGeneral,
        te_nnx.LayerNormDenseGeneral,
        dict(features=96, use_bias=True, return_layernorm_output=True),
    ),
    "layernorm_mlp": (
        te_nn.LayerNormMLP,
        te_nnx.LayerNormMLP,
        dict(intermediate_dim=128, activations=("silu", "linear"), use_bias=True),
    ),
    "lora_dense_general": (
        te_nn.DenseGeneral,
        te_nnx.DenseGeneral,
        dict(features=96, enable_low_rank_adaptation=True, low_rank_adaptation_dim=32),
    ),
}


def _x(seed=0):
    return normal(jax.random.key(seed), (4, 8, HIDDEN), scale=2.0)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _nnx_twin(nnx_class, attributes, rngs):
    attributes = dict(attributes)
    if nnx_class is te_nnx.LayerNormMLP:
        return nnx_class(HIDDEN, rngs=rngs, **attributes)
    features = attributes.pop("features")
    return nnx_class(HIDDEN, features, rngs=rngs, **attributes)


def _loss(out):
    # Weights with a non-zero mean: bias gradients (sums over tokens) do not cancel out.
    out = _first(out)
    return jnp.sum(out * (1 + jnp.cos(jnp.arange(out.size, dtype=F32).reshape(out.shape))))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("module_name", list(MODULES))
def test_modules_match_the_unquantized_module_and_nnx_matches_linen(module_name, recipe_name):
    recipe = RECIPES[recipe_name]
    linen_class, nnx_class, attributes = MODULES[module_name]
    layer = linen_class(**attributes, recipe=recipe)
    x = _x()
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
    assert set(variables) == {"params"}  # block scaling keeps no FP8 state
    if "lora" in module_name:  # a non-zero adapter, so that its gradients flow
        b = variables["params"]["lora_b_kernel"]
        variables["params"]["lora_b_kernel"] = normal(jax.random.key(3), b.shape, scale=0.1)

    def grads(module):
        return jax.jit(jax.value_and_grad(lambda v, x: _loss(module.apply(v, x)), (0, 1)))(
            variables, x
        )

    (loss, (d_vars, d_x)) = grads(layer)
    (reference_loss, (reference_vars, reference_d_x)) = grads(layer.clone(recipe=None))
    out = _first(layer.apply(variables, x))
    reference = _first(layer.clone(recipe=None).apply(variables, x))
    assert 1e-3 < relative_error(out, reference) < BLOCK_FORWARD_TOLERANCE[recipe_name]
    tolerance = BLOCK_BACKWARD_TOLERANCE[recipe_name]
    assert relative_error(d_x, reference_d_x) < tolerance
    for name, grad in d_vars["params"].items():
        assert relative_error(grad, reference_vars["params"][name]) < tolerance, name

    # The NNX twin holding the same values computes the same bits.
    model = _nnx_twin(nnx_class, {**attributes, "recipe": recipe}, nnx.Rngs(7))
    te_nnx.load_linen_variables(model, variables)
    assert not nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8Meta))

    @nnx.jit
    def nnx_grads(model, x):
        return nnx.value_and_grad(lambda m, x: _loss(m(x)), argnums=(0, 1))(model, x)

    nnx_loss, (nnx_d_model, nnx_d_x) = nnx_grads(model, x)
    np.testing.assert_array_equal(nnx_loss, loss)
    np.testing.assert_array_equal(nnx_d_x, d_x)
    nnx_params = nnx.to_pure_dict(nnx.state(nnx_d_model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, nnx_params, d_vars["params"])
    assert float(reference_loss) != float(loss)


def test_autocast_selects_a_block_recipe_for_modules_without_one():
    layer = te_nn.LayerNormMLP(intermediate_dim=128)
    x = _x()
    with te_flax.autocast(enabled=True, recipe=MXFP8BlockScaling()):
        variables = layer.init(jax.random.key(0), x)
        under_autocast = layer.apply(variables, x)[0]
    explicit = layer.clone(recipe=MXFP8BlockScaling()).apply(variables, x)[0]
    np.testing.assert_array_equal(under_autocast, explicit)
    assert OVERWRITE_WITH_GRADIENT not in variables


def _sr_grads(apply, variables, x):
    return jax.jit(jax.grad(lambda v: _loss(apply(v, x))))(variables)


def test_linen_stochastic_rounding_draws_from_the_sr_rng_stream():
    layer = te_nn.LayerNormMLP(intermediate_dim=128, recipe=NVFP4_SR)
    x = _x()
    variables = nn.meta.unbox(layer.init(jax.random.key(0), x))

    def apply(seed):
        return lambda v, x: layer.apply(v, x, rngs={"sr_rng": jax.random.key(seed)})

    first, again, other = (_sr_grads(apply(s), variables, x) for s in (1, 1, 2))
    jax.tree.map(np.testing.assert_array_equal, first, again)
    assert not np.array_equal(first["params"]["wi_kernel"], other["params"]["wi_kernel"])
    with pytest.raises(Exception, match="sr_rng"):
        layer.apply(variables, x)


def test_nnx_stochastic_rounding_draws_from_the_module_stream():
    def build(seed):
        return te_nnx.LayerNormMLP(
            HIDDEN, intermediate_dim=128, recipe=NVFP4_SR, rngs=nnx.Rngs(0, sr_rng=seed)
        )

    x = _x()

    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda m: _loss(m(x)))(model)

    def kernel_grad(model):
        return nnx.to_pure_dict(nnx.state(grads(model, x), nnx.Param))["wi_kernel"]

    model, twin = build(1), build(1)
    first, twin_first = kernel_grad(model), kernel_grad(twin)
    np.testing.assert_array_equal(first, twin_first)
    # The stream advances with each call, and another seed draws other roundings.
    assert not np.array_equal(kernel_grad(model), first)
    assert not np.array_equal(kernel_grad(build(2)), first)
    # A module built without the recipe has no stream to draw from.
    plain = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=128, rngs=nnx.Rngs(0))
    plain.recipe = NVFP4_SR
    with pytest.raises(ValueError, match="sr_rng"):
        plain(x)
