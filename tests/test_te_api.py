"""TransformerEngine's API surface for code written against it: ``TransformerEngineBase``,
collective-op sets, ``activation``, and a MaxText-shaped wrapper trained through ``nnx.bridge``.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_flax
import te_flax.linen as te_nn
from te_flax.dense import dense
from te_flax.linen import TransformerEngineBase
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, noop_quantizer_set

FP8 = "_overwrite_with_gradient"
RECIPE = DelayedScaling(amax_history_len=4)
HIDDEN, FEATURES = 16, 8


def _x(seed: int = 0, batch: int = 4) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, HIDDEN), jnp.float32)


class _Projection(TransformerEngineBase):
    """A module of its own that calls ``dense`` with a generated quantizer set (as TE's tests)."""

    postfix: str = ""
    recipe: Any = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], FEATURES))
        qs = self.generate_quantizer_set(postfix=self.postfix, fp8_recipe=self.recipe)
        return dense(x, kernel, quantizer_set=qs)


# ------------------------------------------------------------------ TransformerEngineBase


def test_base_module_state_is_dense_generals_and_trains_alike():
    """Same collection, names and shapes as DenseGeneral's, and the same step: output, gradients
    and new FP8 state."""
    mine, layer = _Projection(recipe=RECIPE), te_nn.DenseGeneral(FEATURES, use_bias=False)
    x = _x()
    with te_flax.autocast(enabled=True, recipe=RECIPE):
        variables = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x))
    own = jax.jit(mine.init)(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, variables)
    assert sorted(own[FP8]) == sorted(variables[FP8])

    def grad(module):
        return jax.jit(jax.grad(lambda v, x: jnp.sum(module.apply(v, x) ** 2)))

    grad_layer, grad_mine = grad(layer), grad(mine)
    for step in range(2):
        with te_flax.autocast(enabled=True, recipe=RECIPE):
            expected = grad_layer(variables, _x(step))
        got = grad_mine(variables, _x(step))
        jax.tree.map(np.testing.assert_array_equal, got, expected)
        variables = {**variables, FP8: expected[FP8]}
    assert float(variables[FP8]["x_amax_history"][0]) > 0


def test_generate_quantizer_set_arguments():
    x = _x()

    class Two(TransformerEngineBase):
        @nn.compact
        def __call__(self, x):
            first = self.generate_quantizer_set("_0", quantization_checkpoint_name="q")
            second = self.generate_quantizer_set("_1", variable_collection="fp8_metas")
            grouped = self.generate_quantizer_set("_g", n_groups=3, fp8_recipe=RECIPE)
            current = self.generate_quantizer_set("_c", fp8_recipe=Float8CurrentScaling())
            assert first.checkpoint_name == "q" and second.checkpoint_name is None
            assert grouped.x.n_groups == 3 and grouped.x.quantizer.scale_inv.shape == (3, 1)
            assert grouped.x.quantizers[2].amax_history.shape == (4,)
            assert current.x is not None and current.checkpoint_name is None
            return x

    with te_flax.autocast(enabled=True, recipe=RECIPE):
        variables = Two().init(jax.random.key(0), x)
    assert sorted(variables) == ["_overwrite_with_gradient", "fp8_metas"]
    assert variables[FP8]["kernel_0_scale_inv"].shape == (1,)
    assert variables[FP8]["grad_g_amax_history"].shape == (3, 4)
    assert not any(name.endswith("_c_scale_inv") for name in variables[FP8])  # no state
    assert sorted(variables["fp8_metas"]) == sorted(
        f"{role}_1_{kind}"
        for role in ("x", "kernel", "grad")
        for kind in ("amax_history", "scale_inv")
    )


def test_generate_quantizer_set_without_a_recipe_is_the_noop_set():
    class Probe(TransformerEngineBase):
        @nn.compact
        def __call__(self, x):
            assert self.generate_quantizer_set() == noop_quantizer_set
            return x

    assert Probe().init(jax.random.key(0), _x()) == {}


def test_generate_quantizer_set_refuses_state_the_recipe_does_not_have():
    variables = _Projection().init(jax.random.key(0), _x())  # no FP8
    with pytest.raises(ValueError, match="initialised without FP8"):
        _Projection(recipe=RECIPE).apply(variables, _x())


def test_te_path_of_the_base_module():
    from te_flax.linen import module

    assert module.TransformerEngineBase is TransformerEngineBase
    assert issubclass(te_nn.DenseGeneral, TransformerEngineBase)
    assert issubclass(te_nn.LayerNormMLP, TransformerEngineBase)


# ----------------------------------------------------------------------------- MaxText-shaped


class _Quantization:
    """The shape of MaxText's TransformerEngine quantization: a recipe, and a ``dot_general``
    module class that wraps a function taking ``generate_quantizer_set`` first."""

    def __init__(self, recipe):
        self._recipe = recipe

    def _wrap(self, f, name):
        fp8_recipe = self._recipe

        class TEWrapper(TransformerEngineBase):
            def generate_quantizer_set(self, postfix: str = ""):
                return super().generate_quantizer_set(
                    postfix=postfix,
                    variable_collection=FP8,
                    quantization_checkpoint_name="quantization",
                    fp8_recipe=fp8_recipe,
                )

            @nn.compact
            def __call__(self, *args, **kwargs):
                return f(self.generate_quantizer_set, *args, **kwargs)

        TEWrapper.__name__ = f"TEWrapper_{name}"
        return TEWrapper

    def dot_general_cls(self):
        def te_dot_general(generate_quantizer_set, x, kernel, dims, **kwargs):
            contracting_dims, batch_dims = dims
            assert batch_dims == ((), ())
            return dense(
                x, kernel, contracting_dims=contracting_dims, quantizer_set=generate_quantizer_set()
            )

        return self._wrap(te_dot_general, "dot_general")


class _DenseGeneral(nn.Module):
    """A Linen dense layer that takes its dot_general from the quantization (as MaxText's)."""

    features: int
    quant: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        dot_general = self.quant.dot_general_cls()()
        return dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=None)


def _values(variables: dict) -> dict:
    return {name: variable[...] for name, variable in variables.items()}


def test_maxtext_shaped_wrapper_trains_through_nnx_bridge():
    """A Linen wrapper calling generate_quantizer_set, bridged to NNX, trained by an NNX step
    that splits the ``_overwrite_with_gradient`` collection out of the gradients: the FP8 state
    advances as te_flax's own DenseGeneral's does."""
    xs = [_x(seed) for seed in range(2)]
    model = nnx.bridge.ToNNX(_DenseGeneral(FEATURES, _Quantization(RECIPE)), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, xs[0])
    fp8_type = nnx.variable_type_from_name(FP8)
    wrapper = model.TEWrapper_dot_general_0  # a submodule's variables: a dict of Variables
    assert wrapper["x_amax_history"][...].shape == (4,)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    # The reference: te_flax's DenseGeneral, with the same kernel, trained the same way in Linen.
    reference = te_nn.DenseGeneral(FEATURES, use_bias=False, recipe=RECIPE)
    variables = {
        "params": {"kernel": model.kernel[...]},
        FP8: _values(wrapper),
    }

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x):
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, fp8_type))
        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, x)
        param_grads, fp8_state = nnx.split_state(grads, nnx.Param, fp8_type)
        optimizer.update(model, param_grads)
        nnx.update(model, fp8_state)  # the FP8 state's gradient is its new value
        return loss

    @jax.jit
    def reference_step(variables, x):
        loss, grads = jax.value_and_grad(lambda v: jnp.mean(reference.apply(v, x) ** 2))(variables)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"])
        return loss, {"params": params, FP8: grads[FP8]}

    for x in xs:
        loss = train_step(model, optimizer, x)
        expected_loss, variables = reference_step(variables, x)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    history = wrapper["x_amax_history"][...]
    assert float(history[0]) > 0 and float(history[1]) > 0  # two steps recorded
    assert float(wrapper["x_scale_inv"][...][0]) != 1.0  # the scale moved off its initial value
    got = _values(wrapper)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, variables[FP8])
    np.testing.assert_allclose(model.kernel[...], variables["params"]["kernel"], rtol=1e-6)


# ----------------------------------------------------------------------------- collective ops


def test_dense_takes_the_noop_collective_op_set_in_tes_position():
    import inspect

    from te_flax.collective import CollectiveOp, CollectiveOpSet, noop_collective_op_set

    names = list(inspect.signature(dense).parameters)
    assert names.index("collective_op_set") == names.index("quantizer_set") - 1  # TE's order
    x, kernel = _x(), jax.random.normal(jax.random.key(1), (HIDDEN, FEATURES))
    np.testing.assert_array_equal(
        dense(x, kernel, collective_op_set=noop_collective_op_set), dense(x, kernel)
    )
    assert CollectiveOpSet.create(CollectiveOp.NONE) == noop_collective_op_set
    assert CollectiveOpSet.create(CollectiveOp.ALL_GATHER) == CollectiveOpSet(
        CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    )
    reduce_scatter = CollectiveOpSet.create(CollectiveOp.REDUCE_SCATTER)
    assert reduce_scatter.backward.is_all_gather and reduce_scatter.forward.is_reduce_scatter
    with pytest.raises(ValueError, match="logical axis rules"):
        dense(x, kernel, collective_op_set=reduce_scatter)


# ----------------------------------------------------------------------------- activation


def test_activation_is_the_mlps_activation_and_quantizes_its_output():
    from te_flax._ops.activations import activation_forward
    from te_flax.activation import activation
    from te_flax.quantize import QuantizerFactory
    from tests import helpers

    x = jax.random.normal(jax.random.key(0), (4, 2, 8), jnp.float32) * 3
    swiglu = activation(x, ("silu", "linear"))
    np.testing.assert_array_equal(swiglu, jax.nn.silu(x[:, 0]) * x[:, 1])
    # Read reversed when it starts with "linear"; ("relu", "relu") multiplies two activations.
    np.testing.assert_array_equal(activation(x, ("linear", "silu")), swiglu)
    np.testing.assert_array_equal(
        activation(x, ("relu", "relu")), activation_forward(x, ("relu", "relu"))
    )
    qs = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling())
    quantized = activation(x, ("silu", "linear"), quantizer=qs.x)
    expected = helpers.fake_quant(
        swiglu, helpers.current_scale(swiglu, jnp.float8_e4m3fn), jnp.float8_e4m3fn
    )
    np.testing.assert_allclose(quantized, expected, rtol=1e-6)
    assert not np.array_equal(quantized, swiglu)
    # The gradient passes through the quantization.
    grad = jax.jit(jax.grad(lambda v: jnp.sum(activation(v, ("gelu",), quantizer=qs.x))))
    reference = jax.jit(jax.grad(lambda v: jnp.sum(activation(v, ("gelu",)))))
    np.testing.assert_allclose(grad(x[:, :1]), reference(x[:, :1]))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, H\]"):
        activation(x[:, 0], ("silu", "linear"))
