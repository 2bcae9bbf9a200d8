"""TransformerEngine's API surface that te_flax offers under TE's names: the base module's
``generate_quantizer_set``, ``activation``, collective-op sets and ``MeshResource``."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import transformer_engine.jax.cpp_extensions as tex
import transformer_engine.jax.sharding as te_sharding
from transformer_engine.jax.activation import activation as te_activation
from transformer_engine.jax.dense import dense as te_dense
from transformer_engine.jax.flax.module import TransformerEngineBase as TEBase

from te_flax import collective, sharding
from te_flax.activation import activation
from te_flax.dense import dense
from te_flax.linen.module import TransformerEngineBase
from tests.parity import te_reference as ref


@pytest.mark.parametrize(
    "activation_type",
    [
        ("gelu",),
        ("silu", "linear"),
        ("gelu", "linear"),
        ("squared_relu",),
        ("clamped_silu", "clamped_linear"),
    ],
)
def test_activation_equals_tes(activation_type):
    x = jax.random.normal(jax.random.key(0), (3, len(activation_type), 16), jnp.float32) * 3
    np.testing.assert_array_equal(activation(x, activation_type), te_activation(x, activation_type))

    def loss(fn):
        return jax.grad(lambda v: jnp.sum(fn(v, activation_type) ** 2))(x)

    np.testing.assert_array_equal(loss(activation), loss(te_activation))


def test_collective_op_sets_are_tes():
    assert [op.name for op in collective.CollectiveOp] == [op.name for op in tex.CollectiveOp]
    for op in tex.CollectiveOp:
        theirs = tex.CollectiveOpSet.create(op)
        ours = collective.CollectiveOpSet.create(collective.CollectiveOp[op.name])
        assert (ours.forward.name, ours.backward.name) == (
            theirs.forward.name,
            theirs.backward.name,
        )
    noop = collective.noop_collective_op_set
    assert (noop.forward.name, noop.backward.name) == (
        tex.noop_collective_op_set.forward.name,
        tex.noop_collective_op_set.backward.name,
    )


RESOURCES = [
    sharding.MeshResource(dp_resource="data", tp_resource="tensor"),
    sharding.MeshResource(dp_resource="data", fsdp_resource="fsdp", tp_resource="tensor"),
    sharding.MeshResource(dp_resource="data", tpsp_resource="tensor", cp_resource="fsdp"),
]


@pytest.mark.parametrize("resource", RESOURCES, ids=["dp_tp", "dp_fsdp_tp", "dp_tpsp_cp"])
def test_mesh_resource_maps_tes_axis_names_as_te(resource):
    assert [f.name for f in dataclasses.fields(sharding.MeshResource)] == [
        f.name for f in dataclasses.fields(te_sharding.MeshResource)
    ]
    theirs_resource = te_sharding.MeshResource(**dataclasses.asdict(resource))
    with jax.set_mesh(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
        with te_sharding.global_shard_guard(theirs_resource):
            theirs = te_sharding.get_sharding_map_logic_axis_to_mesh_axis()
        with sharding.global_shard_guard(resource):
            ours = dict(sharding.mesh_resource_rules())
    assert {name: ours[name] for name in theirs} == theirs


class _TEProjection(TEBase):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 8))
        return te_dense(x, kernel, quantizer_set=self.generate_quantizer_set())


class _OurProjection(TransformerEngineBase):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 8))
        return dense(x, kernel, quantizer_set=self.generate_quantizer_set())


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_module_on_the_base_class_computes_as_tes(recipe):
    """The same module written on TE's base and TE's dense, and on te_flax's: the same FP8
    variables (up to TE's names) and the same output and gradients at the first step."""
    ours_recipe, te_recipe = ref.RECIPES[recipe]
    x = jax.random.normal(jax.random.key(1), (4, 16), jnp.float32)
    with ref.te_context(te_recipe):
        te_vars = _TEProjection().init(jax.random.key(0), x)
        te_out, te_grad = jax.value_and_grad(lambda v: jnp.sum(_TEProjection().apply(v, x) ** 2))(
            te_vars
        )
    with ref.our_context(ours_recipe):
        our_vars = _OurProjection().init(jax.random.key(0), x)
        our_out, our_grad = jax.value_and_grad(
            lambda v: jnp.sum(_OurProjection().apply(v, x) ** 2)
        )(our_vars)
    te_state = te_vars.get("fp8_metas", {})
    our_state = our_vars.get(ref.OURS_FP8_COLLECTION, {})
    assert sorted(n.replace("_scale", "_scale_inv") for n in te_state) == sorted(our_state)
    np.testing.assert_array_equal(our_vars["params"]["kernel"], te_vars["params"]["kernel"])
    np.testing.assert_allclose(our_out, te_out, rtol=1e-6)
    np.testing.assert_allclose(
        our_grad["params"]["kernel"], te_grad["params"]["kernel"], rtol=1e-5, atol=1e-6
    )
