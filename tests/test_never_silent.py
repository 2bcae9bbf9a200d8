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
from te_flax._ops.kernels import pallas_kernels
from te_flax.accumulate import combine_gradients
from te_flax.dense import dense as te_dense
from te_flax.layernorm import layernorm
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    QuantizerFactory,
    UncalibratedFp8StateWarning,
    max_merge,
    noop_quantizer_set,
)
from te_flax.quantize.recipes import MAX_AMAX_HISTORY_LEN
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    accumulate_gradients,
    all_finite,
    apply_gradients,
    drop_amax_spikes,
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
        variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
    assert kernel_error(variables, _x(5)) == pytest.approx(1.0)  # every gradient is gone
    guarded = {**variables, FP8: drop_amax_spikes(variables[FP8], recipe)}
    assert kernel_error(guarded, _x(5)) < 0.2
    # Without a spike the guard changes nothing.
    again = drop_amax_spikes(guarded[FP8], recipe)
    jax.tree.map(np.testing.assert_array_equal, again, guarded[FP8])


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
