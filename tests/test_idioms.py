"""Everyday JAX and Flax training idioms met with te_flax layers.

Each idiom either gives what the plain path gives, or fails with an error (or, under ``jit``,
one warning) that names the fix:
- FP8 state that a step forgets to differentiate (the NNX loop of Flax's guides, a Linen
  gradient of ``params`` only) computes right (just-in-time scales) and warns once that it
  never calibrates; ``te_nnx.value_and_grad(..., update_fp8_state=True)`` makes that NNX loop
  train FP8 with delayed scaling as written otherwise;
- ``nnx.bridge.ToNNX`` / ``ToLinen`` with and without a mesh;
- ``donate_argnums``, ``optax.MultiSteps`` in NNX, an ensemble under ``vmap``, float16 and
  bfloat16 parameters, orbax save and restore of an NNX model, remat policies, inputs closed
  over by a jitted function under sharding rules.

Covered elsewhere: scans over layers and microbatch accumulation (test_linen, test_nnx,
test_training, test_accumulate), jitted initialization with out_shardings and nnx.split /
nnx.merge steps (test_multidevice).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
import te_flax.nnx._shell as nnx_shell
from te_flax._layers import fp8_state
from te_flax.quantize import DelayedScaling, UncalibratedFp8StateWarning
from te_flax.sharding import use_sharding
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    hold_fp8_state,
    init_optimizer,
    value_and_grad,
)

HIDDEN, FEATURES = 16, 8
RECIPE = DelayedScaling(amax_history_len=4)
FP8 = OVERWRITE_WITH_GRADIENT


def _x(seed: int, shape=(8, HIDDEN)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _mse(model, x):
    return jnp.mean(model(x) ** 2)


def _nnx_layer(**attributes):
    return te_nnx.DenseGeneral(HIDDEN, FEATURES, recipe=RECIPE, rngs=nnx.Rngs(0), **attributes)


def _linen_layer(**attributes):
    return te_nn.DenseGeneral(features=FEATURES, recipe=RECIPE, **attributes)


def _linen_loss(layer):
    def loss(variables, x):
        return jnp.mean(layer.apply(variables, x) ** 2)

    return loss


def _linen_steps(layer, variables, xs, tx=None, jit=jax.jit):
    """``variables`` after one te_flax Linen step per input (``te_flax.training``)."""
    tx = tx or optax.sgd(0.1)
    opt_state = init_optimizer(tx, variables)

    @jit
    def step(variables, opt_state, x):
        _, grads = value_and_grad(_linen_loss(layer))(variables, x)
        return apply_gradients(tx, variables, grads, opt_state)

    for x in xs:
        variables, opt_state = step(variables, opt_state, x)
    return variables


def _nnx_steps(model, xs, tx=None):
    optimizer = nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, _mse, x))
    for x in xs:
        step(model, optimizer, x)
    return model


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, te_nnx.Fp8Meta)))


def _assert_trees_equal(actual, expected, rtol=0.0):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol),
        actual,
        expected,
    )


# ----------------------------------------------------------------------------- stale FP8 state


def _flax_guide_step(value_and_grad_fn):
    """The NNX training step of Flax's guides, with ``value_and_grad_fn`` as given."""

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = value_and_grad_fn(lambda m: _mse(m, x))(model)
        optimizer.update(model, grads)
        return loss

    return step


def _say_again(monkeypatch):
    """The never-updated warning is said once per process: forget it was said."""
    monkeypatch.setattr(fp8_state, "_STALE_WARNED", set())


def test_flax_guide_nnx_loop_warns_once_and_computes_right(monkeypatch):
    # nnx.value_and_grad over nnx.Param drops the FP8 state's update: the state never moves,
    # so the layer scales just in time (right numbers) and says once that it never calibrates.
    model = _nnx_layer()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kernel = np.asarray(model.kernel[...])
    _say_again(monkeypatch)
    with pytest.warns(UncalibratedFp8StateWarning, match="update_fp8_state=True"):
        jax.block_until_ready(_flax_guide_step(nnx.value_and_grad)(model, optimizer, _x(0)))
        jax.effects_barrier()
    _say_again(monkeypatch)
    with jax.disable_jit(), pytest.warns(UncalibratedFp8StateWarning, match="just in time"):
        _flax_guide_step(nnx.value_and_grad)(model, optimizer, _x(0))
    assert not np.array_equal(model.kernel[...], kernel)  # the parameters trained
    np.testing.assert_array_equal(model.x_amax_history[...], np.zeros(4))  # the state did not


def test_a_deliberate_gradient_of_the_parameters_alone_holds_the_fp8_state():
    model = _nnx_layer()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kernel = np.asarray(model.kernel[...])
    with hold_fp8_state():
        _flax_guide_step(nnx.value_and_grad)(model, optimizer, _x(0))
    assert not np.array_equal(model.kernel[...], kernel)  # the parameters trained
    np.testing.assert_array_equal(model.x_amax_history[...], np.zeros(4))  # the state held


def test_flax_guide_nnx_loop_trains_fp8_with_value_and_grad_updating_the_state():
    xs = [_x(seed) for seed in range(3)]
    model = _nnx_layer()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = _flax_guide_step(lambda f: te_nnx.value_and_grad(f, update_fp8_state=True))
    for x in xs:
        with jax.numpy_dtype_promotion("standard"):  # adam mixes int32 and float (not strict)
            step(model, optimizer, x)
    expected = _nnx_steps(_nnx_layer(), xs, optax.adam(1e-2))
    _assert_trees_equal(_pure(model), _pure(expected))
    assert float(model.x_amax_history[...][2]) > 0


def test_update_fp8_state_refuses_gradients_without_fp8_state():
    model = _nnx_layer()
    _, grads = nnx.jit(te_nnx.value_and_grad(lambda m: _mse(m, _x(0)), update_fp8_state=True))(
        model
    )
    assert not nnx.state(grads, te_nnx.Fp8Meta)
    with pytest.raises(ValueError, match="grads holds none"):
        te_nnx.update_fp8_state(model, grads)


def test_transformer_engines_test_pattern_runs_params_only_after_a_state_update():
    """TE's layer tests update the FP8 state in a separate call (differentiating the FP8
    collection), then differentiate the parameters alone: the state, updated before, is
    kept as it is, with and without jit."""
    layer = _linen_layer()
    variables = layer.init(jax.random.key(0), _x(0))
    others = {FP8: variables[FP8]}

    def loss(params, others, x):
        return _linen_loss(layer)({"params": params, **others}, x)

    for _ in range(2):  # TE's update call: the gradient of the FP8 collection is its new value
        new_state = jax.grad(loss, argnums=1)(variables["params"], others, _x(0))
        others = {FP8: new_state[FP8]}
    assert float(others[FP8]["x_amax_history"][0]) > 0
    eager = jax.grad(loss)(variables["params"], others, _x(0))
    jitted = jax.jit(jax.grad(loss))(variables["params"], others, _x(0))
    jax.tree.map(np.testing.assert_allclose, eager, jitted)


def test_linen_gradient_of_params_only_warns_and_is_right(monkeypatch):
    layer = _linen_layer()
    variables = layer.init(jax.random.key(0), _x(0))

    def loss(params, x):
        return _linen_loss(layer)({"params": params, FP8: variables[FP8]}, x)

    _say_again(monkeypatch)
    with pytest.warns(UncalibratedFp8StateWarning, match=r"te_flax\.training\.value_and_grad"):
        jitted = jax.block_until_ready(jax.jit(jax.grad(loss))(variables["params"], _x(0)))
        jax.effects_barrier()
    _say_again(monkeypatch)
    with pytest.warns(UncalibratedFp8StateWarning, match="'_overwrite_with_gradient'"):
        eager = jax.grad(loss)(variables["params"], _x(0))
    jax.tree.map(np.testing.assert_allclose, eager, jitted)
    _say_again(monkeypatch)
    with hold_fp8_state():  # quiet (warnings are errors in this suite)
        grads = jax.jit(jax.grad(loss))(variables["params"], _x(0))
        jax.effects_barrier()
    assert set(grads) == set(variables["params"])


def test_evaluation_and_input_gradients_say_nothing():
    # Warnings are errors in this test suite: none may be given here.
    model = _nnx_layer()
    nnx.jit(_mse)(model, _x(0))
    model(_x(0))
    jax.grad(lambda x: _mse(model, x))(_x(0))
    layer = _linen_layer()
    variables = layer.init(jax.random.key(0), _x(0))
    jax.jit(_linen_loss(layer))(variables, _x(0))
    jax.grad(lambda x: _linen_loss(layer)(variables, x))(_x(0))


def test_stale_state_is_seen_through_scan_and_remat(monkeypatch):
    _say_again(monkeypatch)
    model = _nnx_layer()
    xs = jnp.stack([_x(seed) for seed in range(2)])

    def scanned(model):
        @nnx.scan(in_axes=(nnx.Carry, None, 0), out_axes=nnx.Carry)
        def body(total, model, x):
            return total + nnx.remat(_mse)(model, x)

        return body(jnp.zeros(()), model, xs)

    with pytest.warns(UncalibratedFp8StateWarning, match="FP8 state"):
        jax.block_until_ready(nnx.jit(nnx.grad(scanned))(model))
        jax.effects_barrier()
    _say_again(monkeypatch)
    nnx.jit(te_nnx.value_and_grad(scanned))(model)  # and the right gradient is quiet


def test_the_check_leaves_the_step_program_unchanged(monkeypatch):
    def lowered_step():
        model = _nnx_layer()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, _mse, x))
        return step.lower(model, optimizer, _x(0)).as_text()

    with_check = lowered_step()
    monkeypatch.setattr(nnx_shell, "watch_fp8_state", lambda module, front, p, s: (p, s))
    assert lowered_step() == with_check


# ----------------------------------------------------------------------------- bridges


def _sharding(mesh: bool):
    if not mesh:
        return contextlib.nullcontext()
    return use_sharding("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2})


@pytest.mark.parametrize("mesh", [False, True], ids=["no_mesh", "mesh"])
def test_linen_layer_through_to_nnx_trains_as_in_linen(mesh):
    xs = [_x(seed) for seed in range(2)]
    layer = _linen_layer(kernel_axes=("embed", "mlp"), input_axes=("batch", "embed"))
    with _sharding(mesh):
        # No eager-sharding switch and no mesh needed, as for a stock nn.Dense.
        bridged = nnx.bridge.ToNNX(layer, rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(bridged, xs[0])
        assert isinstance(bridged.x_amax_history, te_nnx.Fp8Meta)
        variables = {
            "params": {"kernel": bridged.kernel[...], "bias": bridged.bias[...]},
            FP8: {name: value[...] for name, value in nnx.state(bridged, te_nnx.Fp8Meta).items()},
        }
        _nnx_steps(bridged, xs)
        expected = _linen_steps(layer, variables, xs)
    assert float(bridged.x_amax_history[...][1]) > 0
    _assert_trees_equal(
        {"params": {"kernel": bridged.kernel[...], "bias": bridged.bias[...]}},
        {"params": expected["params"]},
        rtol=1e-6,
    )
    _assert_trees_equal(nnx.to_pure_dict(nnx.state(bridged, te_nnx.Fp8Meta)), expected[FP8])


@pytest.mark.parametrize("mesh", [False, True], ids=["no_mesh", "mesh"])
def test_nnx_layer_through_to_linen_trains_as_in_nnx(mesh):
    xs = [_x(seed) for seed in range(2)]
    attributes = {"kernel_axes": ("embed", "mlp"), "recipe": RECIPE}
    bridged = nnx.bridge.ToLinen(te_nnx.DenseGeneral, args=(HIDDEN, FEATURES), kwargs=attributes)
    with _sharding(mesh):
        variables = nn.meta.unbox(bridged.init(jax.random.key(0), xs[0]))
        assert set(variables) == {"params", FP8}
        model = te_nnx.DenseGeneral(HIDDEN, FEATURES, rngs=nnx.Rngs(1), **attributes)
        te_nnx.load_linen_variables(model, variables)
        trained = _linen_steps(bridged, variables, xs)
        _nnx_steps(model, xs)
    assert te_nnx.linen_variables(model).keys() == trained.keys()
    _assert_trees_equal(te_nnx.linen_variables(model)[FP8], trained[FP8])
    _assert_trees_equal(te_nnx.linen_variables(model)["params"], trained["params"], rtol=1e-6)


# ----------------------------------------------------------------------------- the sweep


def test_jitted_init_with_out_shardings_from_the_partition_specs():
    # MaxText's way: shapes and logical axes from jax.eval_shape, then a jitted init that
    # creates every variable in place.
    x = _x(0)
    layer = _linen_layer(kernel_axes=("embed", "mlp"), bias_axes=("mlp",))
    with _sharding(True) as mesh:
        abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
        specs = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, nn.get_logical_axis_rules())
        variables = jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)
    assert set(variables) == {"params", FP8}
    kernel = variables["params"]["kernel"]
    assert kernel.names == ("embed", "mlp")
    assert kernel.value.sharding.spec == shardings["params"]["kernel"].spec
    _assert_trees_equal(nn.meta.unbox(variables), nn.meta.unbox(layer.init(jax.random.key(0), x)))


def test_donated_train_state_gives_the_same_steps():
    xs = [_x(seed) for seed in range(2)]
    layer = _linen_layer()
    variables = layer.init(jax.random.key(0), xs[0])
    plain = _linen_steps(layer, variables, xs)
    donated = _linen_steps(layer, variables, xs, jit=lambda f: jax.jit(f, donate_argnums=(0, 1)))
    _assert_trees_equal(donated, plain)

    model = _nnx_layer()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, x: te_nnx.train_step(m, o, _mse, x), donate_argnums=(0, 1))
    for x in xs:
        step(model, optimizer, x)
    _assert_trees_equal(_pure(model), _pure(_nnx_steps(_nnx_layer(), xs)))


def test_nnx_multi_steps_advances_fp8_state_per_microbatch_and_never_optimizes_it():
    # In NNX the FP8 state is applied with every mini-step (each microbatch is a step of
    # delayed scaling); the parameters take the mean gradient once every k mini-steps.
    k, xs = 2, [_x(seed) for seed in range(2)]
    model = _nnx_layer()
    _nnx_steps(model, xs, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k))

    reference = _nnx_layer()
    initial = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    grads = []
    for x in xs:  # the same mini-steps by hand: FP8 state applied, gradients kept
        _, g = nnx.jit(te_nnx.value_and_grad(_mse, update_fp8_state=True))(reference, x)
        grads.append(nnx.to_pure_dict(g))
    mean = jax.tree.map(lambda *g: sum(g) / k, *grads)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, initial, mean)
    _assert_trees_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), expected, rtol=1e-6)
    _assert_trees_equal(
        nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8Meta)),
        nnx.to_pure_dict(nnx.state(reference, te_nnx.Fp8Meta)),
    )


@pytest.mark.slow
def test_vmapped_ensemble_keeps_fp8_state_per_member():
    members, xs = 3, jnp.stack([_x(seed) for seed in range(3)])
    layer, tx = _linen_layer(), optax.sgd(0.1)
    keys = jax.random.split(jax.random.key(0), members)
    ensemble = jax.vmap(layer.init)(keys, xs)

    @jax.jit
    @jax.vmap
    def step(variables, x):
        _, grads = value_and_grad(_linen_loss(layer))(variables, x)
        return apply_gradients(tx, variables, grads, init_optimizer(tx, variables))[0]

    trained = step(ensemble, xs)
    member = 1
    single = jax.tree.map(lambda a: a[member], ensemble)
    expected = _linen_steps(layer, single, [xs[member]], tx)
    _assert_trees_equal(jax.tree.map(lambda a: a[member], trained), expected, rtol=1e-6)

    @nnx.split_rngs(splits=members)
    @nnx.vmap
    def create(rngs):
        return te_nnx.DenseGeneral(HIDDEN, FEATURES, recipe=RECIPE, rngs=rngs)

    models = create(nnx.Rngs(0))
    optimizers = nnx.vmap(lambda m: nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))(models)
    nnx.jit(nnx.vmap(lambda m, o, x: te_nnx.train_step(m, o, _mse, x)))(models, optimizers, xs)
    history = np.asarray(models.x_amax_history[...])
    np.testing.assert_allclose(history[:, 0], jnp.max(jnp.abs(xs), axis=(1, 2)))


@pytest.mark.parametrize(
    "param_dtype",
    [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)],
    ids=["bf16", "fp16"],
)
def test_half_precision_parameters_train_alike_in_both_front_ends(param_dtype):
    xs = [_x(seed) for seed in range(2)]
    layer = _linen_layer(param_dtype=param_dtype)
    variables = nn.meta.unbox(layer.init(jax.random.key(0), xs[0]))
    model = te_nnx.DenseGeneral(
        HIDDEN, FEATURES, recipe=RECIPE, param_dtype=param_dtype, rngs=nnx.Rngs(0)
    )
    te_nnx.load_linen_variables(model, variables)
    trained = _linen_steps(layer, variables, xs)
    _nnx_steps(model, xs)
    assert {a.dtype for a in jax.tree.leaves(trained["params"])} == {jnp.dtype(param_dtype)}
    assert {a.dtype for a in jax.tree.leaves(trained[FP8])} == {jnp.dtype(jnp.float32)}
    # The kernel's amax is that of the kernel as stored.
    kernel = np.asarray(variables["params"]["kernel"], np.float32)
    np.testing.assert_allclose(trained[FP8]["kernel_amax_history"][1], np.abs(kernel).max())
    _assert_trees_equal(te_nnx.linen_variables(model), trained)


def test_orbax_restores_an_nnx_model_with_its_fp8_state(tmp_path):
    xs = [_x(seed) for seed in range(3)]
    model = _nnx_steps(_nnx_layer(), xs[:2])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", nnx.state(model))
        checkpointer.wait_until_finished()
        graphdef, abstract_state = nnx.split(nnx.eval_shape(_nnx_layer))
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", abstract_state))
    _assert_trees_equal(_pure(restored), _pure(model))
    # Training resumes where it stopped: the restored history feeds the next scales.
    _assert_trees_equal(_pure(_nnx_steps(restored, xs[2:])), _pure(_nnx_steps(model, xs[2:])))


@pytest.mark.parametrize(
    "policy",
    [jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.dots_saveable],
    ids=["nothing_saveable", "dots_saveable"],
)
def test_remat_policies_keep_gradients_and_fp8_state(policy):
    x = _x(0)
    layer = _linen_layer()
    variables = layer.init(jax.random.key(0), x)
    remat_layer = nn.remat(te_nn.DenseGeneral, policy=policy)(features=FEATURES, recipe=RECIPE)
    grads = jax.jit(value_and_grad(_linen_loss(layer)))(variables, x)
    remat_grads = jax.jit(value_and_grad(_linen_loss(remat_layer)))(variables, x)
    _assert_trees_equal(remat_grads, grads, rtol=1e-6)

    model = _nnx_layer()
    remat_loss = lambda m, x: jnp.mean(nnx.remat(lambda m, x: m(x), policy=policy)(m, x) ** 2)  # noqa: E731
    nnx_grads = nnx.jit(te_nnx.value_and_grad(_mse))(model, x)
    nnx_remat_grads = nnx.jit(te_nnx.value_and_grad(remat_loss))(model, x)
    _assert_trees_equal(nnx.to_pure_dict(nnx_remat_grads[1]), nnx.to_pure_dict(nnx_grads[1]), 1e-6)


def test_inputs_closed_over_under_jit_with_sharding_rules():
    x = _x(0)
    layer = _linen_layer(kernel_axes=("embed", "mlp"), input_axes=("batch", "embed"))
    variables = layer.init(jax.random.key(0), x)
    model = _nnx_layer(kernel_axes=("embed", "mlp"), input_axes=("batch", "embed"))
    with _sharding(True):
        passed = jax.jit(layer.apply)(variables, x)
        closed_over = jax.jit(lambda v: layer.apply(v, x))(variables)
        nnx_passed = nnx.jit(lambda m, x: m(x))(model, x)
        nnx_closed_over = nnx.jit(lambda m: m(x))(model)
    np.testing.assert_array_equal(closed_over, passed)
    np.testing.assert_array_equal(nnx_closed_over, nnx_passed)
