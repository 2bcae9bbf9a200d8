"""Expert parallelism on the 8 CPU devices equals one device: outputs, gradients, FP8 state."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.sharding import load_axis_rules, use_sharding
from te_flax.training import OVERWRITE_WITH_GRADIENT, merge_fp8_state
from te_flax.training import value_and_grad as linen_value_and_grad
from tests.helpers import normal, relative_error

HIDDEN, EXPERTS = 16, 8
X = normal(jax.random.key(1), (8, 6, HIDDEN))  # the batch splits 8 ways


def _layer(**attributes):
    return te_nn.MoEBlock(
        num_experts=EXPERTS, num_experts_per_tok=2, intermediate_dim=24, aux_loss_coeff=0.01,
        **attributes,
    )  # fmt: skip


def _step(layer):
    def loss(variables, x):
        out, aux_loss = layer.apply(merge_fp8_state(variables), x)
        return jnp.sum(jnp.sin(out)) + aux_loss, (out, aux_loss)

    @jax.jit
    def step(variables, x):
        (_, (out, aux_loss)), grads = linen_value_and_grad(loss, has_aux=True)(variables, x)
        return out, aux_loss, grads

    return step


def _sharded(variables, values, mesh):
    """``values`` placed as the boxed ``variables``' logical axes say under the active rules."""
    specs = nn.get_partition_spec(variables)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, nn.get_logical_axis_rules())
    return jax.device_put(values, shardings)


def _compare(single, sharded, tolerance):
    for path, expected in jax.tree_util.tree_flatten_with_path(single)[0]:
        actual = dict(jax.tree_util.tree_flatten_with_path(sharded)[0])[path]
        name = jax.tree_util.keystr(path)
        if not np.any(np.asarray(expected)):
            np.testing.assert_array_equal(actual, expected, err_msg=name)
        else:
            assert relative_error(actual, expected) <= tolerance, name


# 8 ways (and 4 x 2 with FP8 below) in the quick suite; 2 and 4 ways among the slow tests.
@pytest.mark.parametrize("ways", [pytest.param(w, marks=pytest.mark.slow) for w in (2, 4)] + [8])
def test_expert_parallel_equals_one_device(ways):
    layer = _layer()
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    values = nn.meta.unbox(variables)
    single = _step(layer)(values, X)
    with use_sharding("ep", {"data": ways, "fsdp": 8 // ways}) as mesh:
        sharded = _step(layer)(_sharded(variables, values, mesh), X)
        hlo = _step(layer).lower(_sharded(variables, values, mesh), X).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo
    _compare(single, sharded, 1e-6)


def test_expert_parallel_fp8_state_and_capacity_equal_one_device():
    layer = _layer(recipe=DelayedScaling(amax_history_len=4), capacity_factor=1.0)
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    values = nn.meta.unbox(variables)
    single = _step(layer)(values, X)
    with use_sharding("ep", {"data": 4, "fsdp": 2}) as mesh:
        sharded = _step(layer)(_sharded(variables, values, mesh), X)
    new_state = sharded[2][OVERWRITE_WITH_GRADIENT]
    assert new_state["x_0_amax_history"].shape == (EXPERTS, 4)
    # Per-expert amaxes over each expert's own rows (the last bits of the output gradient's
    # amax can differ: its float32 sums run in another order).
    _compare(single[2][OVERWRITE_WITH_GRADIENT], new_state, 1e-6)
    _compare(single, sharded, 1e-5)


def test_experts_not_dividing_the_expert_axis_are_refused():
    layer = te_nn.MoEBlock(num_experts=6, intermediate_dim=8)
    expected = "num_experts \\(6\\) must be divisible by the expert"
    with use_sharding("ep", {"data": 4, "fsdp": 2}), pytest.raises(ValueError, match=expected):
        layer.init(jax.random.key(0), X)


@pytest.mark.parametrize("recipe", [None, DelayedScaling(amax_history_len=4)], ids=["bf16", "fp8"])
def test_expert_parallel_on_explicit_axes_equals_one_device(recipe):
    """JAX's default mesh (``jax.make_mesh``: ``Explicit`` axes) with the ``ep`` rules and the
    batch placed on ``data``: the parameters and tokens are resharded for the experts'
    ``shard_map``, and the gradients come back with the parameters' shardings."""
    layer = _layer() if recipe is None else _layer(recipe=recipe, capacity_factor=1.0)
    variables = jax.jit(layer.init)(jax.random.key(0), X)
    values = nn.meta.unbox(variables)
    single = _step(layer)(values, X)
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
    with jax.set_mesh(mesh), nn.logical_axis_rules(load_axis_rules("ep")):
        placed = _sharded(variables, values, mesh)
        x = jax.device_put(X, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        sharded = _step(layer)(placed, x)
    _compare(single, sharded, 1e-5)
    for path, grad in jax.tree_util.tree_flatten_with_path(sharded[2]["params"])[0]:
        param = dict(jax.tree_util.tree_flatten_with_path(placed["params"])[0])[path]
        assert grad.sharding.spec == param.sharding.spec, jax.tree_util.keystr(path)
