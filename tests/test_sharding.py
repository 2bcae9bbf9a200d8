"""``with_logical_constraint``: no-op cases, rules on a mesh, shard_map, and the ops' *_axes."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

import te_flax
import te_flax.linen as te_nn
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.quantize import DelayedScaling, QuantizerFactory, noop_quantizer_set
from te_flax.sharding import (
    BATCH_AXES,
    W_TP_AXES,
    MeshResource,
    global_mesh_resource,
    global_shard_guard,
    load_axis_rules,
    mesh_resource_rules,
    use_sharding,
    with_logical_constraint,
)
from tests import helpers

F32 = jnp.float32
P = PartitionSpec
RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")


def _mesh() -> Mesh:
    """8 CPU devices as data=2 x model=4, with Auto axes (sharding by constraints)."""
    devices = np.asarray(jax.devices()[:8]).reshape(MESH_SHAPE)
    return Mesh(devices, MESH_AXES)


@contextlib.contextmanager
def _rules_on_mesh(rules=RULES):
    """``RULES`` (or ``rules``) active on the data=2 x model=4 mesh."""
    with jax.set_mesh(_mesh()), nn.logical_axis_rules(rules):
        yield


def _make_mesh_auto() -> Mesh:
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def _constraints(hlo: str) -> list[str]:
    """The sharding_constraint lines of a lowered (StableHLO / Shardy) module."""
    return [line.strip() for line in hlo.splitlines() if "sharding_constraint" in line]


def _spec(array) -> tuple:
    """``array``'s PartitionSpec as a tuple with one entry per dimension (JAX trims trailing
    Nones)."""
    sharding = array.sharding
    assert isinstance(sharding, jax.sharding.NamedSharding), sharding
    spec = tuple(sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def _x():
    return jnp.arange(8 * 16, dtype=F32).reshape(8, 16)


def test_the_test_environment_has_eight_devices():
    assert len(jax.devices()) >= 8


# ----------------------------------------------------------------------------- no-op cases


def test_no_op_without_rules():
    x = _x()
    with jax.set_mesh(_mesh()):
        assert with_logical_constraint(x, ("batch", "mlp")) is x
        hlo = _hlo(lambda x: with_logical_constraint(x, ("batch", "mlp")), x)
    assert _constraints(hlo) == []


def test_no_op_without_mesh():
    x = _x()
    with nn.logical_axis_rules(RULES):
        assert jax.sharding.get_abstract_mesh().empty
        assert with_logical_constraint(x, ("batch", "mlp")) is x
        hlo = _hlo(lambda x: with_logical_constraint(x, ("batch", "mlp")), x)
    assert _constraints(hlo) == []


@pytest.mark.parametrize("axes", [None, ()])
def test_no_op_for_empty_axes(axes):
    x = _x()
    with _rules_on_mesh():
        assert with_logical_constraint(x, axes) is x
        hlo = _hlo(lambda x: with_logical_constraint(x, axes), x)
        out = jax.jit(lambda x: with_logical_constraint(x, axes))(x)
    assert _constraints(hlo) == []
    np.testing.assert_array_equal(out, x)


def test_none_array_passes_through():
    with _rules_on_mesh():
        assert with_logical_constraint(None, ("batch", "mlp")) is None


def test_eager_call_under_rules_and_mesh_keeps_values():
    # Outside jit, with rules and a mesh, on an ordinary single-device array: the module
    # promises that the same code runs on one device and on many.
    x = _x()
    with _rules_on_mesh():
        out = with_logical_constraint(x, ("batch", "mlp"))
    np.testing.assert_array_equal(out, x)


def test_eager_op_call_under_rules_and_mesh_keeps_values():
    x, kernel = _x(), jnp.ones((16, 4), F32)
    expected = dense(x, kernel)
    with _rules_on_mesh():
        out = dense(x, kernel, input_axes=("batch", "embed"), kernel_axes=("embed", "mlp"))
    np.testing.assert_array_equal(out, expected)


# ----------------------------------------------------------------------------- wrong axes


@pytest.mark.parametrize("axes", [("batch",), ("batch", "embed", "mlp")])
@pytest.mark.parametrize("active", [False, True])
def test_wrong_number_of_axis_names_is_refused(axes, active):
    x = _x()
    message = rf"name {len(axes)} dimensions but the array has 2 \(shape \(8, 16\)\)"
    context = _rules_on_mesh() if active else contextlib.nullcontext()
    with context, pytest.raises(ValueError, match=message):
        with_logical_constraint(x, axes)


def test_wrong_number_of_axis_names_is_refused_inside_jit():
    with _rules_on_mesh(), pytest.raises(ValueError, match=r"one name \(or None\) per dimension"):
        jax.jit(lambda x: with_logical_constraint(x, ("batch",)))(_x())


# ----------------------------------------------------------------------------- rules on a mesh


@pytest.mark.parametrize("make_mesh", [_mesh, _make_mesh_auto], ids=["Mesh", "make_mesh"])
@pytest.mark.parametrize(
    ("axes", "spec"),
    [
        (("batch", "embed"), P("data", None)),
        (("batch", "mlp"), P("data", "model")),
        (("embed", "mlp"), P(None, "model")),
        ((None, "mlp"), P(None, "model")),
        (("batch", "heads"), P("data", None)),  # a name without a rule stays unsharded
    ],
)
def test_rules_give_the_output_sharding_inside_jit(make_mesh, axes, spec):
    x = _x()
    with jax.set_mesh(make_mesh()), nn.logical_axis_rules(RULES):
        out = jax.jit(lambda x: with_logical_constraint(x * 2.0, axes))(x)
    assert _spec(out) == tuple(spec)
    np.testing.assert_array_equal(out, 2.0 * x)


def test_constraint_appears_in_the_lowered_module():
    x = _x()
    with _rules_on_mesh():
        hlo = _hlo(lambda x: with_logical_constraint(x, ("batch", "mlp")), x)
    assert _constraints(hlo) == [
        '%0 = sdy.sharding_constraint %arg0 <@mesh, [{"data"}, {"model"}]> : tensor<8x16xf32>'
    ]


def test_rules_map_one_name_to_two_mesh_axes():
    x = _x()
    with _rules_on_mesh((("batch", ("data", "model")),)):
        out = jax.jit(lambda x: with_logical_constraint(x, ("batch", None)))(x)
    assert _spec(out) == (("data", "model"), None)


def test_explicit_mesh_axes_are_resharded():
    # On Explicit axes lax.with_sharding_constraint is an assertion, not a constraint: the
    # helper reshards instead, and the result's type carries the rules' sharding.
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES)
    assert mesh.axis_types == (AxisType.Explicit,) * 2
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        out = jax.jit(lambda x: with_logical_constraint(x * 2.0, ("batch", "mlp")))(_x())
    assert _spec(out) == ("data", "model")


# ----------------------------------------------------------------------------- shard_map


def test_manual_axis_inside_shard_map_is_dropped():
    x = _x()

    def body(block):  # [4, 16]: the "data" half of x
        assert jax.sharding.get_abstract_mesh().manual_axes == ("data",)
        return with_logical_constraint(block * 2.0 + 1.0, ("batch", "mlp"))

    with _rules_on_mesh():
        fn = jax.shard_map(body, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
        out = jax.jit(fn)(x)
        hlo = _hlo(fn, x)
    np.testing.assert_array_equal(out, 2.0 * x + 1.0)
    # Only the automatic "model" axis is constrained inside the manual computation.
    named = [c for c in _constraints(hlo) if '"data"' in c or '"model"' in c]
    assert named and all('[{}, {"model"}]' in c for c in named), named


def test_manual_axis_is_dropped_from_a_multi_axis_rule():
    x = _x()

    def body(block):
        return with_logical_constraint(block + 1.0, ("batch", None))

    rules = (("batch", ("data", "model")),)
    with _rules_on_mesh(rules):
        fn = jax.shard_map(body, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
        out = jax.jit(fn)(x)
        hlo = _hlo(fn, x)
    np.testing.assert_array_equal(out, x + 1.0)
    assert any('[{"model"}, {}]' in c for c in _constraints(hlo))


def test_all_axes_manual_is_a_no_op():
    x = _x()

    def body(block):  # [4, 4]
        return with_logical_constraint(block - 1.0, ("batch", "mlp"))

    with _rules_on_mesh():
        fn = jax.shard_map(body, in_specs=P("data", "model"), out_specs=P("data", "model"))
        out = jax.jit(fn)(x)
        hlo = _hlo(fn, x)
    np.testing.assert_array_equal(out, x - 1.0)
    assert not any('"data"' in c or '"model"' in c for c in _constraints(hlo))


# ----------------------------------------------------------------------------- the ops' *_axes


def _quantizer_set(fp8: bool):
    if not fp8:
        return noop_quantizer_set
    return QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))


def _dense_problem():
    keys = jax.random.split(jax.random.key(0), 4)
    x = helpers.normal(keys[0], (8, 4, 16))  # [batch, seq, embed]
    kernel = helpers.normal(keys[1], (16, 32), scale=0.25)  # [embed, mlp]
    bias = helpers.normal(keys[2], (32,), scale=0.1)
    cotangent = helpers.normal(keys[3], (8, 4, 32))
    return x, kernel, bias, cotangent


def _dense_grad(fp8: bool):
    """The gradient function of a ``dense`` loss with ``*_axes``, and its arguments."""
    x, kernel, bias, cotangent = _dense_problem()

    def loss(x, kernel, bias, quantizer_set):
        out = dense(
            x,
            kernel,
            bias,
            input_axes=("batch", None, "embed"),
            kernel_axes=("embed", "mlp"),
            output_axes=("batch", None, "mlp"),
            quantizer_set=quantizer_set,
        )
        return jnp.sum(out * cotangent)

    return jax.grad(loss, argnums=(0, 1, 2, 3)), (x, kernel, bias, _quantizer_set(fp8))


def _layernorm_dense_grad(fp8: bool):
    """The gradient function of a ``layernorm_dense`` loss with ``*_axes``, and its arguments."""
    x, kernel, bias, cotangent = _dense_problem()
    gamma = 1.0 + helpers.normal(jax.random.key(5), (16,), scale=0.1)
    beta = helpers.normal(jax.random.key(6), (16,), scale=0.1)

    def loss(x, kernel, gamma, beta, bias, quantizer_set):
        out = layernorm_dense(
            x,
            kernel,
            gamma,
            beta,
            bias,
            layernorm_input_axes=("batch", None, "embed"),
            dot_input_axes=("batch", None, "embed"),
            kernel_axes=("embed", "mlp"),
            quantizer_set=quantizer_set,
        )
        return jnp.sum(out * cotangent)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    return grad, (x, kernel, gamma, beta, bias, _quantizer_set(fp8))


@pytest.mark.parametrize("fp8", [False, True], ids=["no-fp8", "fp8"])
@pytest.mark.parametrize("problem", [_dense_grad, _layernorm_dense_grad])
def test_kernel_gradient_follows_kernel_axes_and_values_match_unsharded(problem, fp8):
    grad, args = problem(fp8)
    unsharded = jax.jit(grad)(*args)
    with _rules_on_mesh():
        sharded_grad = jax.jit(grad)
        sharded = sharded_grad(*args)
        constraints = _constraints(sharded_grad.lower(*args).as_text())
    d_x, d_kernel = sharded[0], sharded[1]
    # kernel_axes ("embed", "mlp") -> (None, "model"); x's axes ("batch", None, "embed").
    assert _spec(d_kernel) == (None, "model")
    assert _spec(d_x) == ("data", None, None)
    assert any('[{}, {"model"}]' in c for c in constraints)
    assert any('[{"data"}, {}, {}]' in c for c in constraints)
    # Summation order changes with the sharding; the values do not, beyond float32 rounding.
    tol = helpers.tolerance(F32) * (10 if fp8 else 1)
    helpers.assert_tree_close(sharded[:-1], unsharded[:-1], tol)
    # Under jit with sharded operands jnp.max(jnp.abs(x)) is a global amax: the new FP8 state
    # is exactly the unsharded one.
    jax.tree.map(np.testing.assert_array_equal, sharded[-1], unsharded[-1])


# ----------------------------------------------------------------------------- MeshResource


def _te_style_run(layer, x, rules_source):
    """A TransformerEngine-style sharded script: parameters placed by the logical rules,
    initialised and applied under jit. ``rules_source`` gives the rules inside the contexts."""
    rules = rules_source()
    with nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract), jax.sharding.get_mesh(), rules
        )
        variables = jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)
        out, _ = jax.jit(layer.apply)(variables, x)
    return variables, out


DP_FSDP_TP = MeshResource(dp_resource="data", tp_resource="tensor", fsdp_resource="fsdp")


@pytest.mark.parametrize(
    ("resource", "rule_set"),
    [
        (DP_FSDP_TP, "dp_fsdp_tp"),
        (MeshResource(dp_resource="data", tpsp_resource="tensor"), "tp_sp"),
    ],
    ids=["dp_fsdp_tp", "tp_sp"],
)
def test_mesh_resource_stands_for_the_shipped_rule_set(resource, rule_set):
    """TE's MeshResource on a (data, fsdp, tensor) mesh gives te_flax's rule set, name for name
    (every te_flax name the rule set leaves out is replicated)."""
    shipped = dict(load_axis_rules(rule_set))
    with use_sharding(rule_set, {"data": 2, "fsdp": 2, "tensor": 2}), global_shard_guard(resource):
        ours = dict(mesh_resource_rules())
    assert {name: ours[name] for name in shipped} == shipped
    assert all(name in shipped or axes is None for name, axes in ours.items() if "nvte" not in name)


def test_te_style_sharded_script_runs_as_with_the_rule_set():
    """A TE-style script (MeshResource in autocast, parameters placed by its rules) shards and
    computes a layer as te_flax's dp_fsdp_tp rule set does."""
    layer = te_nn.LayerNormDenseGeneral(
        32, kernel_axes=("embed", "mlp"), recipe=DelayedScaling(amax_history_len=4)
    )
    x = helpers.normal(jax.random.key(0), (8, 4, 16))
    with use_sharding("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}):
        expected_vars, expected = _te_style_run(layer, x, lambda: load_axis_rules("dp_fsdp_tp"))
        with te_flax.autocast(mesh_resource=DP_FSDP_TP):
            got_vars, got = _te_style_run(layer, x, mesh_resource_rules)
    specs = jax.tree.map(_spec, nn.meta.unbox(got_vars))
    assert specs == jax.tree.map(_spec, nn.meta.unbox(expected_vars))
    assert specs["params"]["kernel"] == ("fsdp", "tensor")
    assert _spec(got) == _spec(expected)
    np.testing.assert_array_equal(got, expected)


def test_mesh_resource_rules_apply_without_flax_rules():
    """TE's fallback: with a MeshResource active and no Flax rules, the constraints use the
    resource's rules, TE's own names included."""
    x = _x()
    with jax.set_mesh(_mesh()):
        assert _constraints(_hlo(lambda x: with_logical_constraint(x, ("batch", "mlp")), x)) == []
        with global_shard_guard(MeshResource(dp_resource="data", tp_resource="model")):
            ours = _hlo(lambda x: with_logical_constraint(x, ("batch", "mlp")), x)
            theirs = _hlo(lambda x: with_logical_constraint(x, (BATCH_AXES, W_TP_AXES)), x)
            out = jax.jit(lambda x: with_logical_constraint(x, ("batch", "act_mlp")))(x)
    assert any('[{"data"}, {"model"}]' in c for c in _constraints(ours))
    assert any('[{"data"}, {"model"}]' in c for c in _constraints(theirs))
    assert _spec(out) == ("data", "model")
    np.testing.assert_array_equal(out, x)


def test_mesh_resource_context_and_refusals():
    with pytest.raises(ValueError, match="no MeshResource is active"):
        global_mesh_resource()
    with global_shard_guard(MeshResource(dp_resource="data")):
        with te_flax.autocast(enabled=True, mesh_resource=MeshResource(tp_resource="model")):
            assert global_mesh_resource() == MeshResource(tp_resource="model")
        deprecated = pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated")
        with deprecated, te_flax.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            assert global_mesh_resource() == MeshResource(dp_resource="data")
    both = MeshResource(tp_resource="data", tpsp_resource="model")
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="cannot both be on"):
        mesh_resource_rules(both)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="mesh axis 'tp'"):
        mesh_resource_rules(MeshResource(tp_resource="tp"))


def test_global_shard_guard_of_none_makes_none_active():
    with (
        global_shard_guard(MeshResource(dp_resource="data")),
        global_shard_guard(None),
        pytest.raises(ValueError, match="no MeshResource is active"),
    ):
        global_mesh_resource()
