"""JAX's default sharding style: ``jax.make_mesh`` with ``Explicit`` axes and ``jax.set_mesh``.

Each layer trains there as on one device: the loss and every gradient (FP8 state included)
agree with the unsharded step, and every gradient has its parameter's sharding. The layouts are
a data-parallel batch with replicated parameters, FSDP (the kernels' first axis sharded too),
tensor parallelism (the GEMMs' features), all placed by hand with ``jax.device_put``, and the
``dp_fsdp_tp`` logical-axis rules of ``configs/rules`` (parameters placed by their logical axes,
te_flax's constraints inside the ops). The FP8 amaxes of sharded tensors are global under
``jit``, so the FP8 scales are those of one device: the results agree to float32 summation
order.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from te_flax.sharding import load_axis_rules
from te_flax.training import merge_fp8_state
from tests.helpers import assert_close

BATCH, SEQ, HIDDEN, FEATURES = 8, 16, 128, 256
RECIPES = {
    "none": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
}
RULES = load_axis_rules("dp_fsdp_tp")
BATCH_SPEC = PartitionSpec(("data", "fsdp"))


def _mesh():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert mesh.axis_types == (AxisType.Explicit,) * 3  # JAX's default
    return mesh


def _linen_layer(name, recipe):
    return {
        "dense": lambda: te_nn.DenseGeneral(features=FEATURES, recipe=recipe),
        "layernorm_dense": lambda: te_nn.LayerNormDenseGeneral(features=FEATURES, recipe=recipe),
        "layernorm_mlp": lambda: te_nn.LayerNormMLP(
            intermediate_dim=FEATURES, activations=("gelu", "linear"), recipe=recipe
        ),
        "layernorm": lambda: te_nn.LayerNorm(),
    }[name]()


# Each hand-placed layout: (parameter path, shape) -> PartitionSpec.
def _data_parallel(path, shape):
    return PartitionSpec()


def _fsdp(path, shape):
    return PartitionSpec("fsdp") if len(shape) >= 2 else PartitionSpec()


def _tensor_parallel(path, shape):
    if path[-1] in ("kernel", "wi_kernel"):  # column-parallel
        return PartitionSpec(*([None] * (len(shape) - 1)), "tensor")
    if path[-1] == "wo_kernel":  # row-parallel
        return PartitionSpec("tensor")
    if path[-1] in ("bias", "wi_bias"):
        return PartitionSpec(*([None] * (len(shape) - 1)), "tensor")
    return PartitionSpec()


LAYOUTS = {"dp": _data_parallel, "fsdp": _fsdp, "tp": _tensor_parallel, "rules": None}


def _input():
    return jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, SEQ, HIDDEN)), jnp.float32)


def _loss(apply, merge=True):
    # merge_fp8_state: the Linen rule for FP8 state (NNX state here is used once per step).
    def loss(variables, x):
        y = apply(merge_fp8_state(variables) if merge else variables, x)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.mean(jnp.sin(y) * y)

    return jax.jit(jax.value_and_grad(loss))


def _placed(variables, boxed, layout):
    if layout == "rules":
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), _mesh(), RULES)
        return jax.device_put(variables, shardings)

    def place(path, array):
        names = tuple(getattr(key, "key", getattr(key, "name", None)) for key in path)
        return jax.device_put(array, LAYOUTS[layout](names, array.shape))

    return jax.tree_util.tree_map_with_path(place, variables)


def _one_device(apply, boxed, variables=None, merge=True):
    """A layer's apply, variables and step on one device: what its layouts' cases share (the
    builders below are cached), so that the one-device step is compiled once, not per layout."""
    variables = nn.unbox(boxed) if variables is None else variables
    return apply, variables, boxed, merge, _loss(apply, merge)(variables, _input())


def _check_step(layer, layout):
    apply, variables, boxed, merge, (expected_loss, expected_grads) = layer
    x = _input()
    rules = nn.logical_axis_rules(RULES) if layout == "rules" else contextlib.nullcontext()
    with jax.set_mesh(_mesh()), rules:
        placed = _placed(variables, boxed, layout)
        loss, grads = _loss(apply, merge)(placed, jax.device_put(x, BATCH_SPEC))
    assert_close(loss, expected_loss, 1e-5, "loss")
    flat_expected = jax.tree_util.tree_leaves_with_path(expected_grads)
    for (path, actual), (_, expected), parameter in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        flat_expected,
        jax.tree.leaves(placed),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        assert_close(actual, expected, 1e-5, name)
        # Every gradient has its parameter's sharding (its type, under Explicit axes).
        assert jax.typeof(actual).sharding.spec == jax.typeof(parameter).sharding.spec, name


def _cases():
    for layer in ("dense", "layernorm_dense", "layernorm_mlp", "layernorm"):
        for recipe in RECIPES:
            if layer == "layernorm" and recipe != "none":
                continue
            for layout in LAYOUTS:
                yield pytest.param(layer, recipe, layout, id=f"{layer}-{recipe}-{layout}")


@functools.cache
def _linen(layer, recipe):
    module = _linen_layer(layer, RECIPES[recipe])
    return _one_device(module.apply, module.init(jax.random.key(0), _input()))


@pytest.mark.parametrize(("layer", "recipe", "layout"), list(_cases()))
def test_linen_layer_trains_on_explicit_axes_as_on_one_device(layer, recipe, layout):
    _check_step(_linen(layer, recipe), layout)


BLOCK_RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
    "blockwise": Float8BlockScaling(),
}


def _block_cases():
    for recipe in BLOCK_RECIPES:
        for layout in LAYOUTS:
            yield pytest.param(
                "layernorm_mlp", recipe, layout, id=f"layernorm_mlp-{recipe}-{layout}"
            )
    for layer in ("dense", "layernorm_dense"):
        for layout in ("fsdp", "tp"):
            yield pytest.param(layer, "mxfp8", layout, id=f"{layer}-mxfp8-{layout}")


@functools.cache
def _block_scaled(layer, recipe):
    module = _linen_layer(layer, BLOCK_RECIPES[recipe])

    def apply(variables, x):  # NVFP4 rounds stochastically
        return module.apply(variables, x, rngs={"sr_rng": jax.random.key(3)})

    return _one_device(apply, module.init(jax.random.key(0), _input()))


@pytest.mark.parametrize(("layer", "recipe", "layout"), list(_block_cases()))
def test_block_scaled_recipes_train_on_explicit_axes_as_on_one_device(layer, recipe, layout):
    # Block-scaled quantization reshapes sharded axes into blocks, which JAX cannot type axis
    # by axis: the ops run with the Explicit axes as Auto inside (sharding.on_auto_axes).
    _check_step(_block_scaled(layer, recipe), layout)


@functools.cache
def _transformer(recipe):
    module = te_nn.TransformerLayer(**_TRANSFORMER, recipe=RECIPES[recipe])

    def apply(variables, x):
        return module.apply(variables, x, deterministic=True)

    return _one_device(apply, module.init(jax.random.key(0), _input(), deterministic=True))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_transformer_layer_trains_on_explicit_axes_as_on_one_device(recipe, layout):
    _check_step(_transformer(recipe), layout)


_TRANSFORMER = dict(
    hidden_size=HIDDEN,
    mlp_hidden_size=FEATURES,
    num_attention_heads=4,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    intermediate_dropout=0.0,
)


@pytest.mark.parametrize("layout", ["dp", "fsdp", "rules"])
@pytest.mark.parametrize(
    ("recipe", "capacity_factor"), [("none", None), ("delayed", None), ("delayed", 2.0)]
)
def test_moe_block_trains_on_explicit_axes_as_on_one_device(recipe, capacity_factor, layout):
    # Dropless (ragged) and capacity lowerings; the routing runs with the axes as Auto.
    _check_step(_moe(recipe, capacity_factor), layout)


@functools.cache
def _moe(recipe, capacity_factor):
    capacity = {} if capacity_factor is None else {"capacity_factor": capacity_factor}
    module = te_nn.MoEBlock(**_MOE, recipe=RECIPES[recipe], **capacity)
    return _one_device(module.apply, module.init(jax.random.key(0), _input()))


_MOE = dict(num_experts=4, num_experts_per_tok=2, intermediate_dim=64)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_nnx_layernorm_mlp_trains_on_explicit_axes_as_on_one_device(recipe, layout):
    _check_step(_nnx_layernorm_mlp(recipe), layout)


@functools.cache
def _nnx_layernorm_mlp(recipe):
    module = te_nnx.LayerNormMLP(
        HIDDEN, intermediate_dim=FEATURES, recipe=RECIPES[recipe], rngs=nnx.Rngs(0)
    )
    return _nnx_one_device(module)


def _nnx_one_device(module):
    graphdef, state = nnx.split(module)
    apply = _nnx_apply(graphdef, state)
    return _one_device(apply, _nnx_boxed(state), nnx.to_pure_dict(state), merge=False)


def _nnx_apply(graphdef, state):
    def apply(variables, x):
        new_state = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(new_state, variables)
        return nnx.merge(graphdef, new_state)(x)

    return apply


def _nnx_boxed(state):
    """The state's logical axes as Linen boxes, for ``nn.get_partition_spec``."""
    specs = nnx.get_partition_spec(state)
    return nnx.to_pure_dict(
        jax.tree.map(
            lambda spec: nn.LogicallyPartitioned(
                jnp.zeros(()), tuple(spec) if spec is not None else ()
            ),
            specs,
            is_leaf=lambda s: isinstance(s, PartitionSpec) or s is None,
        )
    )


def test_nnx_transformer_layer_trains_on_explicit_axes_as_on_one_device():
    module = te_nnx.TransformerLayer(**_TRANSFORMER, recipe=RECIPES["delayed"], rngs=nnx.Rngs(0))
    _check_step(_nnx_one_device(module), "rules")
