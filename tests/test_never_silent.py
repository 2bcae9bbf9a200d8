"""Never silent: for each recipe, front end and loop style, a fault is skipped, trained through
correctly, or refused with a named error; never wrong numbers with no signal.

The faults are those of long FP8 runs: an infinite loss or input (bias-less layers included,
whose gradients all pass through quantized GEMMs), a layer applied twice under Flax's own
``TrainState`` and plain ``jax.grad``, a frozen layer that never calibrates, a finite loss
spike, and a check that must say the same with and without ``jit``. The loop styles are
te_flax's helpers (``apply_gradients`` / ``te_flax.nnx.train_step`` with ``skip_nonfinite``),
Flax's ``TrainState`` with ``optax.apply_if_finite``, a plain finiteness check, and gradient
accumulation.
"""

from __future__ import annotations

import warnings
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._ops import custom_op
from te_flax._ops.kernels import pallas_kernels
from te_flax.accumulate import combine_gradients
from te_flax.convert import RecomputedFp8ScalesWarning, migrate_fp8_state
from te_flax.dense import dense as te_dense
from te_flax.dense import grouped_dense, grouped_quantizer_set
from te_flax.layernorm import layernorm
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    UncalibratedFp8StateWarning,
    max_merge,
    noop_quantizer_set,
)
from te_flax.quantize.recipes import MAX_AMAX_HISTORY_LEN
from te_flax.quantize.tensor_quantizers import DelayedScaleQuantizer
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    accumulate_gradients,
    all_finite,
    apply_gradients,
    drop_amax_spikes,
    hold_fp8_state,
    init_optimizer,
    merge_fp8_state,
    value_and_grad,
)
from tests import test_training_faults as training_faults

FP8 = OVERWRITE_WITH_GRADIENT
HIDDEN = 128  # a multiple of every recipe's block
DELAYED = DelayedScaling(amax_history_len=8)
# The per-tensor and block-scaled recipes of the training-fault tests, and blockwise FP8.
RECIPES = {**training_faults.RECIPES, "delayed": DELAYED, "blockwise": Float8BlockScaling()}


def _x(seed: int = 0, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), (4, 32, HIDDEN), jnp.float32)


def _layer(kind: str, recipe):
    if kind == "dense_without_bias":  # every gradient passes through a quantized GEMM
        return te_nn.DenseGeneral(features=HIDDEN, use_bias=False, recipe=recipe)
    return te_nn.LayerNormMLP(intermediate_dim=HIDDEN, recipe=recipe)


def _output(y):
    return y[0] if isinstance(y, tuple) else y


FAULTS = {
    "inf_loss": lambda: (_x(1), jnp.float32(jnp.inf)),
    "inf_input": lambda: (_x(1).at[0, 3, 5].set(jnp.inf), jnp.float32(1.0)),
    "nan_input": lambda: (_x(1).at[0, 3, 5].set(jnp.nan), jnp.float32(1.0)),
}


# ----------------------------------------------------------------------------- non-finite steps


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("layer_kind", ["dense_without_bias", "layernorm_mlp"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_nonfinite_step_is_seen_by_every_check(recipe, layer_kind, fault):
    layer = _layer(layer_kind, RECIPES[recipe])
    variables = nn.unbox(layer.init(jax.random.key(0), _x()))

    def loss_fn(variables, x, weight):
        y = layer.apply(variables, x, rngs={"sr_rng": jax.random.key(1)})
        return jnp.mean(jnp.square(_output(y))) * weight

    x, weight = FAULTS[fault]()
    _, grads = jax.jit(value_and_grad(loss_fn))(variables, x, weight)
    # A plain finiteness check of the parameter gradients sees it; the FP8 state stays finite.
    assert not bool(all_finite(grads["params"]))
    assert bool(all_finite(grads.get(FP8, {})))

    # te_flax's step skips it and counts it.
    tx = optax.adamw(1e-2)
    opt_state = init_optimizer(tx, variables)
    after, after_opt = jax.jit(lambda v, g, o: apply_gradients(tx, v, g, o, skip_nonfinite=True))(
        variables, grads, opt_state
    )
    jax.tree.map(np.testing.assert_array_equal, after, variables)
    assert int(after_opt.skipped_steps) == 1

    # Flax's TrainState with optax.apply_if_finite leaves the parameters as they were.
    state = train_state.TrainState.create(
        apply_fn=layer.apply, params=variables, tx=optax.apply_if_finite(optax.adamw(1e-2), 3)
    )
    # (the FP8 state's "gradient" is its new value, finite, as checked above)
    with jax.numpy_dtype_promotion("standard"):  # optax's counters mix int and float
        state = state.apply_gradients(grads=grads)
    jax.tree.map(np.testing.assert_array_equal, state.params["params"], variables["params"])


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_nnx_train_step_skips_an_infinite_loss_of_a_layer_without_bias(recipe):
    model = te_nnx.DenseGeneral(HIDDEN, HIDDEN, use_bias=False, recipe=RECIPES[recipe],
                                rngs=nnx.Rngs(0))  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    before = nnx.to_pure_dict(nnx.state(model))

    def loss_fn(model, x, weight):
        return jnp.mean(jnp.square(model(x))) * weight

    step = nnx.jit(lambda m, o, x, w: te_nnx.train_step(m, o, loss_fn, x, w, skip_nonfinite=True))
    loss, skipped = step(model, optimizer, *FAULTS["inf_loss"]())
    assert not np.isfinite(float(loss)) and bool(skipped)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)), before)


def test_an_infinite_microbatch_makes_the_accumulated_gradients_nonfinite():
    layer = _layer("dense_without_bias", DELAYED)
    variables = nn.unbox(layer.init(jax.random.key(0), _x()))

    def loss_fn(variables, batch):
        x, weight = batch
        return jnp.mean(jnp.square(layer.apply(merge_fp8_state(variables), x))) * weight

    xs = jnp.stack([_x(2), _x(3)])
    weights = jnp.array([1.0, jnp.inf], jnp.float32)
    _, grads = jax.jit(lambda v, b: accumulate_gradients(loss_fn, v, b))(variables, (xs, weights))
    assert not bool(all_finite(grads["params"]))
    assert bool(all_finite(grads[FP8]))


# ----------------------------------------------------------------------------- reuse


class _Tied(nn.Module):
    """One layer applied twice (weight tying, a shared block)."""

    @nn.compact
    def __call__(self, x):
        layer = te_nn.DenseGeneral(features=HIDDEN, recipe=DELAYED, name="shared")
        return layer(layer(x))


def test_a_layer_applied_twice_trains_under_flax_train_state_as_under_te_flax():
    model = _Tied()
    variables = nn.unbox(model.init(jax.random.key(0), _x()))
    tx = optax.sgd(1e-3)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    ours, opt_state = variables, init_optimizer(tx, variables)

    def loss_fn(variables, x):
        return jnp.mean(jnp.square(model.apply(variables, x)))

    @jax.jit
    def flax_step(state, x):  # Flax's own idiom: jax.grad of everything, no te_flax helper
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x))

    @jax.jit
    def te_flax_step(variables, opt_state, x):
        _, grads = value_and_grad(loss_fn)(variables, x)
        return apply_gradients(tx, variables, grads, opt_state)

    for step in range(6):
        x = _x(step, scale=1.0 + step)
        state = flax_step(state, x)
        ours, opt_state = te_flax_step(ours, opt_state, x)
    jax.tree.map(np.testing.assert_array_equal, state.params[FP8], ours[FP8])
    shared = state.params[FP8]["shared"]
    # Each history entry is one step's amax (the larger of the two uses), never a sum.
    assert float(shared["kernel_amax_history"][0]) == pytest.approx(
        float(jnp.max(jnp.abs(state.params["params"]["shared"]["kernel"]))), rel=1e-2
    )


SMALL = DelayedScaling(amax_history_len=4)


def _small_x(scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(3), (2, 16), jnp.float32)


class _TwoUses(nn.Module):
    """One layer applied to x and to 5 x: the merged amax of its input is 5 amax(x)."""

    @nn.compact
    def __call__(self, x):
        layer = te_nn.DenseGeneral(features=16, recipe=SMALL, name="shared")
        return layer(x) + layer(5.0 * x)


class _TwoUsesNnx(nnx.Module):
    def __init__(self):
        self.shared = te_nnx.DenseGeneral(16, 16, recipe=SMALL, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.shared(x) + self.shared(5.0 * x)


def _two_uses_history(front_end: str, mode: str) -> jax.Array:
    """The input amax history of a layer applied twice, after one differentiated step."""
    x = _small_x()
    if front_end == "linen":
        model = _TwoUses()
        variables = model.init(jax.random.key(0), x)
        grad = jax.grad(lambda v: jnp.sum(model.apply(v, x)))  # Flax's plain idiom
        step = jax.jit(grad) if mode == "jit" else grad
        return step(variables)[FP8]["shared"]["x_amax_history"]
    module = _TwoUsesNnx()
    grad = te_nnx.value_and_grad(lambda m: jnp.sum(m(x)), update_fp8_state=True)
    (nnx.jit(grad) if mode == "jit" else grad)(module)
    return module.shared.x_amax_history[...]


@pytest.mark.parametrize("mode", ["eager", "jit", "disable_jit"])
@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_a_layer_applied_twice_merges_by_max_with_and_without_jit(front_end, mode):
    # Outside jit JAX had no rule to add the marked state's cotangents (KeyError: EArray).
    if mode == "disable_jit":
        with jax.disable_jit():
            history = _two_uses_history(front_end, mode)
    else:
        history = _two_uses_history(front_end, mode)
    amax = float(jnp.max(jnp.abs(_small_x())))
    np.testing.assert_allclose(np.asarray(history), [5.0 * amax, 0.0, 0.0, 0.0], rtol=1e-6)


class _TeStyleProjection(te_nn.TransformerEngineBase):
    """A module written on TE's base class, its FP8 state from generate_quantizer_set."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 16))
        quantizer_set = self.generate_quantizer_set(fp8_recipe=SMALL)
        return te_dense(x, kernel, quantizer_set=quantizer_set)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("module", ["DenseGeneral", "TransformerEngineBase"])
def test_one_variable_dict_in_two_applies_merges_under_flax_train_state(module, jit):
    # A two-view loss: the same variables applied twice per step, Flax's TrainState and
    # jax.grad, no te_flax helper. The state was summed: scales doubled every step.
    if module == "DenseGeneral":
        layer = te_nn.DenseGeneral(features=16, recipe=SMALL)
    else:
        layer = _TeStyleProjection()
    x = _small_x()
    variables = layer.init(jax.random.key(0), x)
    state = train_state.TrainState.create(
        apply_fn=layer.apply, params=variables, tx=optax.sgd(1e-3)
    )

    def loss_fn(params, x):
        return jnp.sum(state.apply_fn(params, x)) + jnp.sum(state.apply_fn(params, 2.0 * x))

    def step(state, x):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x))

    step = jax.jit(step) if jit else step
    amaxes = []
    for i in range(3):
        batch = (1.0 + i) * x
        amaxes.insert(0, 2.0 * float(jnp.max(jnp.abs(batch))))  # the larger view's
        state = step(state, batch)
    history = state.params[FP8]["x_amax_history"]
    np.testing.assert_allclose(np.asarray(history), [*amaxes, 0.0], rtol=1e-6)


def _microbatch_grads(layer, variables, scales):
    grad = jax.jit(jax.grad(lambda v, x: jnp.sum(layer.apply(v, x))))
    return [grad(variables, scale * _small_x()) for scale in scales]


def test_hand_combined_microbatch_gradients_keep_the_max_or_are_refused():
    layer = te_nn.DenseGeneral(features=16, recipe=SMALL)
    variables = nn.unbox(layer.init(jax.random.key(0), _small_x()))
    tx = optax.sgd(1e-3)
    opt_state = init_optimizer(tx, variables)
    # A step first, so that the check can see the shifted part of a history.
    variables, opt_state = apply_gradients(
        tx, variables, _microbatch_grads(layer, variables, [1.0])[0], opt_state
    )
    first, second = _microbatch_grads(layer, variables, [1.0, 4.0])
    amax = float(jnp.max(jnp.abs(_small_x())))
    combined = combine_gradients(first, second)
    assert float(combined[FP8]["x_amax_history"][0]) == pytest.approx(4.0 * amax)
    np.testing.assert_allclose(
        combined["params"]["kernel"], (first["params"]["kernel"] + second["params"]["kernel"]) / 2
    )
    apply_gradients(tx, variables, combined, opt_state)  # accepted
    # A sum or a scaling of the new state (clipping by hand) is refused where it is applied.
    summed = jax.tree.map(jnp.add, first, second)
    clipped = jax.tree.map(lambda g: 0.5 * g, first)
    for wrong in (summed, clipped):
        with pytest.raises(ValueError, match="summed over its uses"):
            apply_gradients(tx, variables, wrong, opt_state)


# ----------------------------------------------------------------------------- frozen layers


class _FrozenBackbone(nn.Module):
    backbone_recipe: object

    @nn.compact
    def __call__(self, x):
        features = te_nn.DenseGeneral(features=HIDDEN, recipe=self.backbone_recipe,
                                      name="backbone")(x)  # fmt: skip
        head = te_nn.DenseGeneral(features=8, recipe=DELAYED, name="head")
        return head(jax.lax.stop_gradient(features))


def _frozen_step(backbone_recipe):
    model = _FrozenBackbone(backbone_recipe)
    x = _x(scale=1e3)
    variables = nn.unbox(model.init(jax.random.key(0), x))
    tx = optax.sgd(1e-3)

    def loss_fn(variables, x):
        return jnp.mean(jnp.square(model.apply(variables, x)))

    def step(variables, opt_state, x):
        _, grads = value_and_grad(loss_fn)(variables, x)
        return apply_gradients(tx, variables, grads, opt_state)

    return step, variables, init_optimizer(tx, variables), x


@pytest.mark.parametrize("jit", [False, True])
def test_a_frozen_layer_that_never_calibrates_warns_with_the_fix(jit, monkeypatch):
    monkeypatch.setattr(max_merge, "_WARNED", set())  # said once per process
    step, variables, opt_state, x = _frozen_step(DELAYED)
    step = jax.jit(step) if jit else step
    with pytest.warns(UncalibratedFp8StateWarning, match=r"backbone.*Float8CurrentScaling"):
        jax.block_until_ready(step(variables, opt_state, x))
        jax.effects_barrier()


class _FrozenBackboneNnx(nnx.Module):
    def __init__(self):
        self.backbone = te_nnx.DenseGeneral(HIDDEN, HIDDEN, recipe=DELAYED, rngs=nnx.Rngs(0))
        self.head = te_nnx.DenseGeneral(HIDDEN, 8, recipe=DELAYED, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.head(jax.lax.stop_gradient(self.backbone(x)))


def test_a_frozen_nnx_layer_that_never_calibrates_warns_too(monkeypatch):
    # check_calibrated matched names ending in "_amax_history']"; NNX state paths end in
    # ".value" after the name, so the NNX warning never fired.
    monkeypatch.setattr(max_merge, "_WARNED", set())
    model = _FrozenBackboneNnx()
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    def loss_fn(model, x):
        return jnp.mean(jnp.square(model(x)))

    with pytest.warns(UncalibratedFp8StateWarning, match=r"backbone.*Float8CurrentScaling"):
        te_nnx.train_step(model, optimizer, loss_fn, _x(scale=1e3))
        jax.effects_barrier()


def test_a_frozen_layer_with_current_scaling_is_calibrated_and_quiet():
    step, variables, opt_state, x = _frozen_step(Float8CurrentScaling())
    jax.block_until_ready(jax.jit(step)(variables, opt_state, x))  # no warning
    exact = te_nn.DenseGeneral(features=HIDDEN).apply(
        {"params": variables["params"]["backbone"]}, x
    )
    quantized = te_nn.DenseGeneral(features=HIDDEN, recipe=Float8CurrentScaling()).apply(
        {"params": variables["params"]["backbone"]}, x
    )
    assert float(jnp.linalg.norm(quantized - exact) / jnp.linalg.norm(exact)) < 0.1


# ----------------------------------------------------------------------------- never-updated state

LOUD = 1e3  # far from 1: with the fresh state's scale 1, e4m3 (max 448) clips such values
LAYERS = ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"]


def _loud_x(seed: int = 7) -> jax.Array:
    return LOUD * jax.random.normal(jax.random.key(seed), (2, 8, 64), jnp.float32)


def _fresh_layer(kind: str, recipe=DELAYED, front_end: str = "linen"):
    """A layer whose first GEMM reads values near LOUD (the input, or a norm scaled by it)."""
    modules = te_nn if front_end == "linen" else te_nnx
    # NNX layers take their input features and rngs at construction.
    args, nnx_args = ((), {}) if front_end == "linen" else ((64,), {"rngs": nnx.Rngs(0)})
    loud_scale = nn.initializers.constant(LOUD)
    if kind == "DenseGeneral":
        return modules.DenseGeneral(*args, features=64, recipe=recipe, **nnx_args)
    if kind == "LayerNormDenseGeneral":
        return modules.LayerNormDenseGeneral(
            *args, features=64, scale_init=loud_scale, recipe=recipe, **nnx_args
        )
    return modules.LayerNormMLP(
        *args, intermediate_dim=64, scale_init=loud_scale, recipe=recipe, **nnx_args
    )


def _relative_error(y, exact) -> float:
    y = _output(y)
    return float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))


class _Scanned(nn.Module):
    """The layer over a leading axis of its input, by ``nn.scan`` of an ``nn.remat`` body."""

    kind: str
    recipe: object = DELAYED

    @nn.compact
    def __call__(self, xs):
        class Body(nn.Module):
            @nn.compact
            def __call__(body, carry, x):
                return carry, _output(_fresh_layer(self.kind, self.recipe)(x))

        scan = nn.scan(
            nn.remat(Body),
            variable_broadcast=["params", FP8],
            split_rngs={"params": False},
            in_axes=0,
            out_axes=0,
        )
        return scan(name="scan")(jnp.zeros(()), xs)[1]


def _linen_outputs(kind: str, loop: str):
    """The output of a layer with a fresh (never-updated) delayed-scaling state under ``loop``,
    and the unquantized output of the same parameters."""
    x = _loud_x()
    if loop == "scan_remat_grad":
        model, exact_model, x = _Scanned(kind), _Scanned(kind, None), jnp.stack([x, -x])
    else:
        model, exact_model = _fresh_layer(kind), _fresh_layer(kind, None)
    variables = nn.unbox(model.init(jax.random.key(0), x))
    exact = _output(exact_model.apply({"params": variables["params"]}, x))

    def apply(variables, x):
        return _output(model.apply(variables, x))

    if loop == "apply":
        return apply(variables, x), exact
    if loop == "jit":
        return jax.jit(apply)(variables, x), exact
    if loop == "frozen_backbone":  # jax.grad of a Flax head over the frozen layer
        head = nn.Dense(4)
        head_params = head.init(jax.random.key(1), exact)["params"]

        def loss(head_params):
            features = apply(variables, x)
            return jnp.mean(head.apply({"params": head_params}, features)), features

        return jax.grad(loss, has_aux=True)(head_params)[1], exact
    if loop == "params_held":  # a gradient of the parameters alone, the state held

        def loss(params):
            y = apply({**variables, "params": params}, x)
            return jnp.mean(y), y

        with hold_fp8_state():
            return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])[1], exact
    # grad_of_input, scan_remat_grad: a gradient of the input only

    def input_loss(x):
        y = apply(variables, x)
        return jnp.mean(y), y

    return jax.grad(input_loss, has_aux=True)(x)[1], exact


# params_held: the shells' watch on the FP8 state passes the state on as it came (it used to
# return it from its custom_vjp, which the ops then saw as differentiated).
LOOPS = ["apply", "jit", "frozen_backbone", "grad_of_input", "scan_remat_grad", "params_held"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", LAYERS)
def test_a_never_updated_state_computes_right_in_any_loop(kind, loop):
    # Its update cannot leave these steps: the layer scales just in time while its state is
    # fresh. It computed with scale 1 before, 68% off for DenseGeneral.
    y, exact = _linen_outputs(kind, loop)
    assert _relative_error(y, exact) < 0.1


@pytest.mark.parametrize("loop", ["call", "jit", "frozen_backbone"])
@pytest.mark.parametrize("kind", LAYERS)
def test_a_never_updated_nnx_layer_computes_right_in_any_loop(kind, loop):
    layer, exact_layer = _fresh_layer(kind, front_end="nnx"), _fresh_layer(kind, None, "nnx")
    nnx.update(exact_layer, nnx.state(layer, nnx.Param))
    x = _loud_x()
    exact = _output(exact_layer(x))
    if loop == "call":
        y = layer(x)
    elif loop == "jit":
        y = nnx.jit(lambda layer, x: _output(layer(x)))(layer, x)
    else:  # nnx.grad of a head over the frozen layer (only the head is differentiated)
        head = nnx.Linear(64, 4, rngs=nnx.Rngs(1))

        def loss(head, backbone):
            features = _output(backbone(x))
            return jnp.mean(head(features)), features

        _, y = nnx.grad(loss, has_aux=True)(head, layer)
    assert _relative_error(y, exact) < 0.1


@pytest.mark.parametrize("kernels", ["0", "1"])  # "1": the Pallas kernels, interpreted on a CPU
def test_the_ops_scale_a_never_updated_state_just_in_time_for_a_gradient_of_their_kernels(
    kernels,
):
    # The quantizer sets are not differentiated, so their update cannot leave the step: the
    # norm output and the activation (near 1e3 here) and the output and activation gradients
    # (near 1e-6) are quantized with their own scales, in the forward and in the backward.
    x = _loud_x()
    gamma = jnp.full((64,), LOUD)
    keys = jax.random.split(jax.random.key(3), 2)
    weights = [jax.random.normal(keys[0], (64, 2, 64)), jax.random.normal(keys[1], (64, 64))]
    weights = [0.1 * weight for weight in weights]

    @jax.jit
    def gradients(weights, quantizer_sets):
        def loss(weights):
            y = layernorm_mlp(
                x, gamma, None, weights, [None, None], "rmsnorm",
                activation_type=("gelu", "linear"), quantizer_sets=quantizer_sets,
            )  # fmt: skip
            return jnp.sum(y.astype(jnp.float32)) / LOUD**2, y

        return jax.grad(loss, has_aux=True)(weights)

    with pallas_kernels(kernels):
        d_weights, y = gradients(weights, QuantizerFactory.create_set(2, fp8_recipe=DELAYED))
        exact_d_weights, exact = gradients(weights, (noop_quantizer_set, noop_quantizer_set))
    assert _relative_error(y, exact) < 0.1
    for d_weight, exact_d_weight in zip(d_weights, exact_d_weights, strict=True):
        assert _relative_error(d_weight, exact_d_weight) < 0.1


@pytest.mark.parametrize("lowering", ["ragged", "capacity"])
def test_a_never_updated_grouped_state_scales_each_group_just_in_time(lowering):
    # Evaluation of a grouped GEMM (the experts of a mixture of experts): one scale per group.
    x = _loud_x().reshape(16, 64) * jnp.repeat(jnp.array([1.0, 1e-3]), 8)[:, None]
    kernel = 0.1 * jax.random.normal(jax.random.key(3), (2, 64, 32))
    sizes = jnp.array([8, 8], jnp.int32)
    fresh = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=DELAYED), 2)
    y = jax.jit(partial(grouped_dense, lowering=lowering))(x, kernel, sizes, quantizer_set=fresh)
    exact = grouped_dense(x, kernel, sizes, lowering=lowering)
    for rows in (slice(0, 8), slice(8, 16)):  # near 1e3 and near 1: each group right
        assert _relative_error(y[rows], exact[rows]) < 0.1


def _programs() -> tuple[str, str, str]:
    """The StableHLO of LayerNormMLP's training steps that differentiate the FP8 state
    (te_flax's ``value_and_grad``; ``jax.grad`` of the whole variable dict, as under Flax's
    ``TrainState``) and of its evaluation."""
    layer = _fresh_layer("LayerNormMLP")
    x = _loud_x()
    variables = nn.unbox(layer.init(jax.random.key(0), x))

    def loss_fn(variables, x):
        return jnp.mean(jnp.square(_output(layer.apply(variables, x))))

    te_flax_step = jax.jit(value_and_grad(loss_fn)).lower(variables, x).as_text()
    flax_step = jax.jit(jax.grad(loss_fn)).lower(variables, x).as_text()
    evaluate = jax.jit(partial(layer.apply, variables)).lower(x).as_text()
    return te_flax_step, flax_step, evaluate


def test_scaling_just_in_time_leaves_the_training_step_unchanged(monkeypatch):
    te_flax_step, flax_step, evaluate = _programs()
    # Every quantizer as before (the stored scale, one pass over each tensor):
    monkeypatch.setattr(custom_op, "_in_mode", lambda quantizer, just_in_time: quantizer)
    stored_te_flax_step, stored_flax_step, stored_evaluate = _programs()
    assert te_flax_step == stored_te_flax_step
    assert flax_step == stored_flax_step
    assert evaluate != stored_evaluate  # evaluation scales just in time


# ----------------------------------------------------------------------------- checkpoints
# across FP8 formats: a delayed-scaling scale is a function of its history and the recipe, so a
# checkpoint of another format, margin, rule or history length is converted by recomputing it.

E4M3_DELAYED = DelayedScaling(amax_history_len=8, fp8_format=Format.E4M3)


def _input_grad_error(layer, variables, x) -> float:
    """The layer's input gradient against the unquantized layer's, normwise."""

    def input_grad(module, variables):
        return jax.grad(lambda x: jnp.mean(jnp.square(module.apply(variables, x))))(x)

    exact_layer = te_nn.DenseGeneral(features=HIDDEN, use_bias=False)
    exact = input_grad(exact_layer, {"params": variables["params"]})
    quantized = input_grad(layer, variables)
    return float(jnp.linalg.norm(quantized - exact) / jnp.linalg.norm(exact))


def test_a_hybrid_checkpoint_restored_into_an_e4m3_model_is_converted():
    hybrid = _layer("dense_without_bias", DELAYED)  # Format.HYBRID: e5m2 gradients
    variables = nn.unbox(hybrid.init(jax.random.key(0), _x()))
    tx = optax.sgd(1e-2)
    opt_state = init_optimizer(tx, variables)

    @jax.jit
    def step(variables, opt_state, x):
        _, grads = value_and_grad(lambda v: jnp.mean(jnp.square(hybrid.apply(v, x))))(variables)
        return apply_gradients(tx, variables, grads, opt_state)

    for index in range(3):
        variables, opt_state = step(variables, opt_state, _x(index))
    e4m3 = _layer("dense_without_bias", E4M3_DELAYED)
    target = jax.eval_shape(e4m3.init, jax.random.key(0), _x())
    # A raw restore (the tree as saved) quantizes the first step's gradients with e5m2's
    # scales in e4m3: 128x too small, nearly every gradient clips.
    assert _input_grad_error(e4m3, variables, _x(5)) > 0.9
    with pytest.raises(ValueError, match=r"128x too small.*recipe=DelayedScaling"):
        migrate_fp8_state(variables, target)
    with pytest.warns(RecomputedFp8ScalesWarning, match=r"grad_scale_inv x128"):
        migrated = migrate_fp8_state(variables, target, recipe=E4M3_DELAYED)
    error = _input_grad_error(e4m3, migrated, _x(5))
    # As close as a model calibrated under E4M3 from the start: its state after the same steps.
    calibrated = {**variables, FP8: _state_after(E4M3_DELAYED, variables[FP8])}
    assert error < 0.1
    assert error == pytest.approx(_input_grad_error(e4m3, calibrated, _x(5)), rel=1e-6)
    # The NNX model takes the converted tree as it is.
    model = te_nnx.DenseGeneral(HIDDEN, HIDDEN, use_bias=False, recipe=E4M3_DELAYED,
                                rngs=nnx.Rngs(0))  # fmt: skip
    te_nnx.load_linen_variables(model, migrated)
    assert float(model.grad_scale_inv[...][0]) == float(migrated[FP8]["grad_scale_inv"][0])


def _state_after(recipe, saved_state) -> dict:
    """The state ``recipe``'s own update rule keeps after the amaxes of ``saved_state``'s
    histories (oldest first), one step at a time."""
    state = {}
    for name, history in saved_state.items():
        if not name.endswith("_amax_history"):
            continue
        stem = name.removesuffix("_amax_history")
        q_dtype = recipe.fp8_format.value[1 if stem.startswith("grad") else 0]
        quantizer = DelayedScaleQuantizer.fresh(q_dtype, recipe)
        for amax in np.asarray(history)[::-1]:
            quantizer = quantizer.update(jnp.asarray(amax, jnp.float32))
        state[name], state[stem + "_scale_inv"] = quantizer.amax_history, quantizer.scale_inv
    return state


def _custom_scale(amax, scale, fp8_max, recipe):
    del scale, recipe
    return fp8_max / (2.0 * amax)


# Each saved recipe against each model recipe that keeps delayed-scaling state.
def _delayed(**fields) -> DelayedScaling:
    return DelayedScaling(**{"amax_history_len": 8, **fields})


FORMAT_PAIRS = {
    "hybrid->e4m3": (DELAYED, E4M3_DELAYED),
    "e4m3->hybrid": (E4M3_DELAYED, DELAYED),
    "margin 0->3": (DELAYED, _delayed(margin=3)),
    "margin 2->0": (_delayed(margin=2), DELAYED),
    "max->most_recent": (DELAYED, _delayed(amax_compute_algo="most_recent")),
    "most_recent->max": (_delayed(amax_compute_algo="most_recent"), DELAYED),
    "history 8->4": (DELAYED, _delayed(amax_history_len=4)),
    "custom scaling factor": (DELAYED, _delayed(scaling_factor_compute_algo=_custom_scale)),
    "same recipe": (DELAYED, DELAYED),
}


@pytest.mark.parametrize("pair", list(FORMAT_PAIRS))
def test_migrated_scales_are_those_the_model_recipe_keeps(pair):
    saved_recipe, model_recipe = FORMAT_PAIRS[pair]
    # Amaxes oldest first; the last step's was not finite (recorded as 0, the scale kept).
    amaxes = np.array([0.0, 0.0, 3.0, 40.0, 0.5, 2.0, 0.25, 0.0], np.float32)[::-1]
    saved = _state_after(saved_recipe, {"x_amax_history": amaxes, "grad_amax_history": amaxes})
    expected = _state_after(model_recipe, saved)
    target = jax.tree.map(jnp.zeros_like, expected)
    tree = {"params": {}, FP8: saved}
    resize = saved_recipe.amax_history_len != model_recipe.amax_history_len
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        migrated = migrate_fp8_state(
            tree, {"params": {}, FP8: target}, recipe=model_recipe, resize_history=resize
        )
    jax.tree.map(np.testing.assert_array_equal, migrated[FP8], expected)
    assert [type(w.message) for w in said] == (
        [] if pair == "same recipe" else [RecomputedFp8ScalesWarning]
    )


def test_a_recipe_that_is_not_the_models_is_refused():
    delayed = {"params": {}, FP8: _state_after(DELAYED, {"x_amax_history": np.ones(8, np.float32)})}
    with pytest.raises(ValueError, match=r"Float8CurrentScaling\(\) keeps no FP8 state"):
        migrate_fp8_state(delayed, delayed, recipe=Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"amax_history_len=4, but .* length 8"):
        migrate_fp8_state(delayed, delayed, recipe=DelayedScaling(amax_history_len=4))
    with pytest.raises(ValueError, match=r"keeps delayed-scaling state, but the model holds none"):
        migrate_fp8_state({"params": {}}, {"params": {}}, recipe=DELAYED)
    tx = optax.sgd(1e-2)
    with pytest.raises(TypeError, match="drop_amax_spikes must be a bool"):
        apply_gradients(tx, delayed, delayed, init_optimizer(tx, delayed), drop_amax_spikes=1)
    with pytest.raises(TypeError, match="drop_amax_spikes must be a bool"):
        te_nnx.value_and_grad(jnp.sum, drop_amax_spikes="yes")


# ----------------------------------------------------------------------------- spikes


def test_drop_amax_spikes_brings_the_gradients_back_after_a_finite_spike():
    recipe = DelayedScaling(amax_history_len=8)
    layer = te_nn.LayerNormMLP(intermediate_dim=HIDDEN, recipe=recipe)
    exact_layer = te_nn.LayerNormMLP(intermediate_dim=HIDDEN)
    variables = nn.unbox(layer.init(jax.random.key(0), _x()))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))

    def loss_fn(variables, x, weight, module=layer):
        return jnp.mean(jnp.square(module.apply(variables, x)[0])) * weight

    grad = jax.jit(value_and_grad(loss_fn))
    exact = jax.jit(jax.grad(lambda p, x: loss_fn({"params": p}, x, 1.0, exact_layer)))

    def kernel_error(variables, x):
        grads = grad(variables, x, 1.0)[1]["params"]["wi_kernel"]
        reference = exact(variables["params"], x)["wi_kernel"]
        return float(jnp.linalg.norm(grads - reference) / jnp.linalg.norm(reference))

    opt_state = init_optimizer(tx, variables)
    for step, weight in enumerate([1.0, 1.0, 1e12]):  # the last step a finite spike
        _, grads = grad(variables, _x(step), weight)
        # The helpers' own guard off: the spike enters the history (the old behaviour).
        options = {"drop_amax_spikes": False}
        variables, opt_state = apply_gradients(tx, variables, grads, opt_state, **options)
    assert kernel_error(variables, _x(5)) == pytest.approx(1.0)  # every gradient is gone
    guarded = {**variables, FP8: drop_amax_spikes(variables[FP8], recipe)}
    assert kernel_error(guarded, _x(5)) < 0.2
    # Without a spike the guard changes nothing.
    again = drop_amax_spikes(guarded[FP8], recipe)
    jax.tree.map(np.testing.assert_array_equal, again, guarded[FP8])


SPIKE_WEIGHTS = (1.0, 1.0, 1e12, 1.0, 1.0)  # step 2 a finite loss spike
SPIKE_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))


def _linen_spike_run(options: dict) -> tuple[list[float], list[jax.Array]]:
    """Each step's gradient scale after it, and its kernel gradient, through apply_gradients."""
    layer = _layer("dense_without_bias", DELAYED)
    variables = nn.unbox(layer.init(jax.random.key(0), _x()))
    opt_state = init_optimizer(SPIKE_TX, variables)

    def loss_fn(variables, x, weight):
        return jnp.mean(jnp.square(layer.apply(variables, x))) * weight

    @jax.jit
    def step(variables, opt_state, x, weight):
        _, grads = value_and_grad(loss_fn)(variables, x, weight)
        new = apply_gradients(SPIKE_TX, variables, grads, opt_state, **options)
        return new, grads["params"]["kernel"]

    scales, kernel_grads = [], []
    for index, weight in enumerate(SPIKE_WEIGHTS):
        (variables, opt_state), kernel_grad = step(variables, opt_state, _x(index), weight)
        scales.append(float(variables[FP8]["grad_scale_inv"][0]))
        kernel_grads.append(kernel_grad)
    return scales, kernel_grads


def _nnx_spike_run(helper: str, options: dict) -> tuple[list[float], list]:
    """The same through te_flax.nnx.train_step or value_and_grad(update_fp8_state=True)."""
    model = te_nnx.DenseGeneral(HIDDEN, HIDDEN, use_bias=False, recipe=DELAYED,
                                rngs=nnx.Rngs(0))  # fmt: skip
    optimizer = nnx.Optimizer(model, SPIKE_TX, wrt=nnx.Param)

    def loss_fn(model, x, weight):
        return jnp.mean(jnp.square(model(x))) * weight

    @nnx.jit
    def step(model, optimizer, x, weight):
        if helper == "train_step":
            te_nnx.train_step(model, optimizer, loss_fn, x, weight, **options)
            return None  # train_step gives no gradients back
        grad_fn = te_nnx.value_and_grad(loss_fn, update_fp8_state=True, **options)
        _, grads = grad_fn(model, x, weight)
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)
        return grads["kernel"][...]

    scales, kernel_grads = [], []
    for index, weight in enumerate(SPIKE_WEIGHTS):
        kernel_grads.append(step(model, optimizer, _x(index), weight))
        scales.append(float(model.grad_scale_inv[...][0]))
    return scales, kernel_grads


@pytest.mark.parametrize("helper", ["apply_gradients", "nnx.train_step", "nnx.value_and_grad"])
def test_the_training_helpers_leave_a_finite_spike_out_by_default(helper):
    def run(options):
        if helper == "apply_gradients":
            return _linen_spike_run(options)
        return _nnx_spike_run(helper.removeprefix("nnx."), options)

    scales, kernel_grads = run({})
    # The spike's step keeps the scale it had; the steps after it train.
    assert scales[2] == scales[1]
    assert max(scales) / min(scales) < 10
    for kernel_grad in kernel_grads[3:]:
        assert kernel_grad is None or bool(jnp.any(kernel_grad != 0))
    # Opted out: the old behaviour, a scale 1e12 too coarse and no kernel gradient after it.
    scales, kernel_grads = run({"drop_amax_spikes": False})
    assert scales[2] > 1e9 * scales[1] and scales[4] == scales[2]
    for kernel_grad in kernel_grads[3:]:
        assert kernel_grad is None or not bool(jnp.any(kernel_grad != 0))


def test_drop_amax_spikes_refuses_what_cannot_work():
    with pytest.raises(TypeError, match="DelayedScaling recipe"):
        drop_amax_spikes({}, Float8CurrentScaling())
    with pytest.raises(ValueError, match="above 1"):
        drop_amax_spikes({}, DELAYED, factor=0.5)
    with pytest.raises(TypeError, match="nested mapping"):
        drop_amax_spikes([jnp.ones(4)], DELAYED)


# ----------------------------------------------------------------------------- odd shapes

EMPTY = jnp.zeros((0, 32, HIDDEN), jnp.float32)  # a batch of no sequences
EMPTY_STEP_KINDS = ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"]
EMPTY_STEP_CASES = [(r, k) for r in ["none", *RECIPES] for k in EMPTY_STEP_KINDS]


def _empty_step_layer(kind: str, recipe: str | None):
    recipe_object = RECIPES.get(recipe) if recipe else None
    if kind == "LayerNorm":
        return te_nn.LayerNorm()
    if kind == "LayerNormMLP":
        return te_nn.LayerNormMLP(intermediate_dim=HIDDEN, recipe=recipe_object)
    return getattr(te_nn, kind)(features=HIDDEN, recipe=recipe_object)


def _empty_step(layer, variables, x, jit=True):
    """A gradient step of ``layer`` on ``x``: (gradients, output)."""

    def loss_fn(variables, x):
        y = _output(layer.apply(variables, x, rngs={"sr_rng": jax.random.key(1)}))
        return jnp.sum(y * y), y

    step = jax.grad(loss_fn, has_aux=True)
    return (jax.jit(step) if jit else step)(variables, x)


@pytest.mark.parametrize(
    ("recipe", "kind"), [*EMPTY_STEP_CASES, ("none", "LayerNorm")], ids=lambda v: str(v)
)
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(recipe, kind):
    # As Flax's own layers do: init, apply and gradient of a batch of size 0 (under jit; the
    # eager paths below). It failed on numpy's "zero-size array to reduction operation max"
    # (per-tensor recipes) and, in the gradient of block-scaled ones, on a ZeroDivisionError.
    layer = _empty_step_layer(kind, recipe)
    keys = {"params": jax.random.key(0), "sr_rng": jax.random.key(1)}
    variables = jax.jit(layer.init)(keys, EMPTY)
    grads, y = _empty_step(layer, variables, EMPTY)
    assert y.shape == EMPTY.shape
    for gradient in jax.tree.leaves(grads["params"]):
        np.testing.assert_array_equal(gradient, np.zeros_like(gradient))
    assert bool(all_finite(grads.get(FP8, {})))


@pytest.mark.parametrize("recipe", ["none", *RECIPES])
def test_an_empty_batch_runs_eagerly_in_nnx_and_the_functional_ops(recipe):
    recipe_object = RECIPES.get(recipe)
    # NNX's LayerNormMLP (a norm and two GEMMs) without jit; Linen's in the test below.
    model = te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=HIDDEN, recipe=recipe_object,
                                rngs=nnx.Rngs(0, sr_rng=1))  # fmt: skip

    def empty_tensors_state():  # the state of x and grad; the kernels are not empty
        state = nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8Meta))
        return {name: value for name, value in state.items() if not name.startswith("kernel")}

    before = empty_tensors_state()
    loss, grads = te_nnx.value_and_grad(
        lambda m: jnp.sum(_output(m(EMPTY))), update_fp8_state=True
    )(model)
    assert float(loss) == 0.0
    assert not any(np.any(g) for g in jax.tree.leaves(nnx.to_pure_dict(grads)))
    # The never-updated state (scale 1, a history of zeros) stays so: an empty step's amax is 0.
    jax.tree.map(np.testing.assert_array_equal, empty_tensors_state(), before)
    # The functional ops, TE's signatures.
    sets = (
        QuantizerFactory.create_set(2, fp8_recipe=recipe_object)
        if recipe_object is not None
        else (noop_quantizer_set, noop_quantizer_set)
    )
    kernel, gamma, beta = jnp.ones((HIDDEN, HIDDEN)), jnp.ones(HIDDEN), jnp.zeros(HIDDEN)
    kernels = [kernel[:, None, :], kernel]
    ops = {
        "dense": lambda x: te_dense(x, kernel, quantizer_set=sets[0]),
        "layernorm": lambda x: layernorm(x, gamma, beta, "layernorm"),
        "layernorm_dense": lambda x: layernorm_dense(x, kernel, gamma, beta, quantizer_set=sets[0]),
        "layernorm_mlp": lambda x: layernorm_mlp(
            x, gamma, beta, kernels, [None, None], "layernorm", quantizer_sets=sets
        ),
    }
    for name, op in ops.items():
        assert op(EMPTY).shape == EMPTY.shape, name
        gradient = jax.grad(lambda x, op=op: jnp.sum(op(x)))(EMPTY)
        np.testing.assert_array_equal(gradient, EMPTY)


def test_an_empty_batch_steps_the_delayed_scaling_state_as_transformer_engine_does():
    # TransformerEngine's amax kernel gives 0 for an empty tensor, and its update records that
    # 0 as the newest entry of the history and keeps the scale where the window's max is 0:
    # delayed scaling's ordinary rule for a step whose amax is 0.
    layer = _empty_step_layer("LayerNormMLP", "delayed")
    variables = layer.init(jax.random.key(0), _x())
    grads, _ = _empty_step(layer, variables, _x())  # one real step: nonzero histories
    variables = {**variables, FP8: grads[FP8]}
    grads, y = _empty_step(layer, variables, EMPTY, jit=False)  # Linen, eagerly
    assert y.shape == EMPTY.shape
    assert not any(np.any(g) for g in jax.tree.leaves(grads["params"]))
    old, new = variables[FP8], grads[FP8]
    for name in ("x_0", "grad_0", "x_1", "grad_1"):  # empty tensors; the kernels are not
        history = old[f"{name}_amax_history"]
        assert float(history[0]) > 0
        expected = jnp.concatenate([jnp.zeros(1), history[:-1]])
        np.testing.assert_array_equal(new[f"{name}_amax_history"], expected)
        np.testing.assert_array_equal(new[f"{name}_scale_inv"], old[f"{name}_scale_inv"])


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_an_empty_batch_takes_the_xla_stages_where_the_kernels_are_on(recipe):
    # Every kernel on (Pallas's interpreter here): an empty tensor takes the XLA stage, as a GPU
    # cannot launch a grid of 0 blocks; the blockwise GEMM kernel refused the empty weight
    # gradient (K = 0) outright.
    layer = _empty_step_layer("LayerNormMLP", recipe)
    with pallas_kernels("1"):
        variables = jax.jit(layer.init)(jax.random.key(0), EMPTY)
        grads, y = _empty_step(layer, variables, EMPTY)
    assert y.shape == EMPTY.shape
    assert not any(np.any(g) for g in jax.tree.leaves(grads["params"]))


def test_amax_history_len_is_bounded():
    assert DelayedScaling(amax_history_len=MAX_AMAX_HISTORY_LEN).amax_history_len == 2**16
    with pytest.raises(ValueError, match=r"amax_history_len=65537\) is longer than te_flax"):
        DelayedScaling(amax_history_len=MAX_AMAX_HISTORY_LEN + 1)
