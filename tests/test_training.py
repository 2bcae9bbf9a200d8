"""Training steps with FP8 state: Flax's TrainState, ``te_flax.training`` with optax chains and
``optax.MultiSteps``, and the delayed-scaling state checked step by step against the recipe."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import freeze
from flax.training import train_state

import te_flax
import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    OptimizerState,
    apply_gradients,
    init_optimizer,
    merge_fp8_state,
)
from tests.helpers import F32, amax_of, assert_delayed_step, assert_tree_close, reference_norm

HISTORY_LEN = 4
RECIPE = DelayedScaling(amax_history_len=HISTORY_LEN)
# An amax recomputed here from an unfused float32 reference (a norm output, a loss gradient).
RECOMPUTED_RTOL = 1e-5
N_STEPS = 10


def _fp8(variables) -> dict:
    return variables[OVERWRITE_WITH_GRADIENT]


def _params(variables) -> dict:
    return nn.meta.unbox(variables["params"])


def _batches(seed: int, n: int, shape, scale: float = 1.0) -> list[jax.Array]:
    # NumPy draws: jax.random would compile a sampler for every shape.
    rng = np.random.default_rng(seed)
    return [jnp.asarray(scale * rng.standard_normal(shape), F32) for _ in range(n)]


def _assert_no_fp8_in(opt_state) -> None:
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        path = jax.tree_util.keystr(path)
        assert OVERWRITE_WITH_GRADIENT not in path, path
        assert "amax_history" not in path and "scale_inv" not in path, path


def _mse(y, target):
    return jnp.mean((y - target) ** 2)


# ----------------------------------------------------------------------------- TrainState


def _layernorm_dense():
    return te_nn.LayerNormDenseGeneral(features=16, recipe=RECIPE)


def _layernorm_mlp():
    # recipe=None: the recipe comes from te_flax.autocast, active around init and every trace.
    return te_nn.LayerNormMLP(intermediate_dim=32, activations=("gelu", "linear"))


def _step_forward(apply):
    """``apply(variables, x)`` jitted as a training step computes it, the FP8 state
    differentiated: with the stored scales (elsewhere a never-updated state is scaled just in
    time)."""

    def forward(variables, x):
        return jax.grad(lambda v: (jnp.zeros((), F32), apply(v, x)), has_aux=True)(variables)[1]

    return jax.jit(forward)


def _expected_amaxes(name: str, variables, x, target, apply):
    """The amax of each GEMM's input, kernel and output gradient in a step at ``variables``."""
    params = _params(variables)
    norm = reference_norm(x, params["scale"], params["ln_bias"])
    y, _ = apply(variables, x)
    grad_y = jax.grad(_mse)(y, target)
    if name == "layernorm_dense":
        return {
            "": {
                "x": (amax_of(norm), RECOMPUTED_RTOL),
                "kernel": (amax_of(params["kernel"]), 0),
                "grad": (amax_of(grad_y), RECOMPUTED_RTOL),
            }
        }
    # The activation output and the gradient of the first GEMM's output depend on FP8 GEMMs,
    # so those two are checked for the history shift and the scale only. As in TE's fused op,
    # the first set's gradient state is the layer's output gradient.
    return {
        "_0": {
            "x": (amax_of(norm), RECOMPUTED_RTOL),
            "kernel": (amax_of(params["wi_kernel"]), 0),
            "grad": (amax_of(grad_y), RECOMPUTED_RTOL),
        },
        "_1": {
            "kernel": (amax_of(params["wo_kernel"]), 0),
        },
    }


@pytest.mark.parametrize(
    ("name", "make_layer", "fp8_context"),
    [
        ("layernorm_dense", _layernorm_dense, contextlib.nullcontext),
        ("layernorm_mlp", _layernorm_mlp, lambda: te_flax.autocast(enabled=True, recipe=RECIPE)),
    ],
)
def test_train_state_fp8_training_loop(name, make_layer, fp8_context):
    layer = make_layer()
    hidden = 32
    features = 16 if name == "layernorm_dense" else hidden  # the MLP maps back to hidden
    xs = _batches(0, N_STEPS, (8, hidden), scale=2.0)
    teacher = jnp.asarray(np.random.default_rng(1).standard_normal((hidden, features)), F32)
    teacher = teacher / np.sqrt(hidden)
    targets = [jnp.tanh(x @ teacher) for x in xs]
    x_eval = _batches(2, 1, (64, hidden), scale=2.0)[0]
    target_eval = jnp.tanh(x_eval @ teacher)

    def loss_fn(variables, x, target):
        y, _ = layer.apply(variables, x)
        return _mse(y, target)

    @jax.jit
    def train_step(state, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, x, target)
        # optax.adam's integer step count needs standard promotion.
        with jax.numpy_dtype_promotion("standard"):
            return state.apply_gradients(grads=grads), loss

    with fp8_context():
        variables = layer.init(jax.random.key(0), xs[0])
        assert set(variables) == {"params", OVERWRITE_WITH_GRADIENT}
        with jax.numpy_dtype_promotion("standard"):
            state = train_state.TrainState.create(
                apply_fn=layer.apply, params=variables, tx=optax.adam(3e-2)
            )
        # Adam's moments cover exactly the parameters; the FP8 state has no optimizer state.
        _assert_no_fp8_in(state.opt_state)
        adam_state = state.opt_state[0]
        params_structure = jax.tree.structure(state.params["params"])
        assert jax.tree.structure(adam_state.mu) == params_structure
        assert jax.tree.structure(adam_state.nu) == params_structure

        evaluate = jax.jit(loss_fn)
        apply = _step_forward(layer.apply)
        initial_eval_loss = float(evaluate(variables, x_eval, target_eval))
        fp8 = _fp8(state.params)
        assert all(np.all(np.asarray(h) == 0) for k, h in fp8.items() if "history" in k)
        assert all(np.all(np.asarray(s) == 1) for k, s in fp8.items() if "scale_inv" in k)
        for step, (x, target) in enumerate(zip(xs, targets, strict=True)):
            expected = _expected_amaxes(name, state.params, x, target, apply)
            old_params = _params(state.params)
            state, _ = train_step(state, x, target)
            assert int(state.step) == step + 1
            for postfix, amaxes in expected.items():
                assert_delayed_step(fp8, _fp8(state.params), postfix, amaxes)
            fp8 = _fp8(state.params)
            changed = jax.tree.map(
                lambda a, b: bool(jnp.any(a != b)), old_params, _params(state.params)
            )
            assert all(jax.tree.leaves(changed)), changed
        final_eval_loss = float(evaluate(state.params, x_eval, target_eval))
    assert final_eval_loss < 0.8 * initial_eval_loss, (initial_eval_loss, final_eval_loss)
    _assert_no_fp8_in(state.opt_state)
    # After 10 steps the 4-slot history holds the newest 4 amax values, all recorded.
    assert all(np.all(np.asarray(h) > 0) for k, h in fp8.items() if "history" in k)


# ----------------------------------------------------------------------------- optax chains


def _dense_problem():
    layer = te_nn.DenseGeneral(features=8, recipe=RECIPE)
    xs = _batches(3, 3, (4, 16), scale=3.0)
    targets = _batches(4, 3, (4, 8))

    def loss_fn(variables, x, target):
        return _mse(layer.apply(variables, x), target)

    variables = layer.init(jax.random.key(0), xs[0])
    return layer, loss_fn, variables, xs, targets


LEARNING_RATE, CLIP_NORM, WEIGHT_DECAY = 0.1, 1e-3, 1e3


def _sgd_chain():
    return optax.chain(
        optax.clip_by_global_norm(CLIP_NORM),
        optax.add_decayed_weights(WEIGHT_DECAY),
        optax.sgd(LEARNING_RATE),
    )


def _adamw_chain():
    return optax.chain(
        optax.clip_by_global_norm(CLIP_NORM), optax.adamw(1e-2, weight_decay=WEIGHT_DECAY)
    )


def _expected_sgd_chain_params(params, grads):
    """Clip by the global norm of the parameter gradients only, add decay, one sgd step."""
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    factor = jnp.minimum(1.0, CLIP_NORM / norm)
    return jax.tree.map(
        lambda p, g: p - LEARNING_RATE * (g * factor + WEIGHT_DECAY * p), params, grads
    )


def _expected_params_by_optax(tx, tx_state, params, grads):
    """The chain applied to the parameters alone, with optax directly."""
    updates, tx_state = tx.update(grads, tx_state, params)
    return optax.apply_updates(params, updates), tx_state


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_apply_gradients_overwrites_fp8_state_untouched_by_clipping_and_decay(optimizer):
    layer, loss_fn, variables, xs, targets = _dense_problem()
    tx = _sgd_chain() if optimizer == "sgd" else _adamw_chain()
    with jax.numpy_dtype_promotion("standard"):
        opt_state = init_optimizer(tx, variables)
        reference_tx_state = tx.init(variables["params"])
    assert isinstance(opt_state, OptimizerState) and opt_state.pending_fp8 is None
    _assert_no_fp8_in(opt_state)
    grad_fn = jax.jit(jax.grad(loss_fn))

    @jax.jit
    def update(variables, grads, opt_state):
        with jax.numpy_dtype_promotion("standard"):
            return apply_gradients(tx, variables, grads, opt_state)

    for x, target in zip(xs, targets, strict=True):
        grads = grad_fn(variables, x, target)
        new_variables, opt_state = update(variables, grads, opt_state)
        # Bit-equal to the gradient's value: no clipping (tiny norm), no decay (huge factor).
        jax.tree.map(np.testing.assert_array_equal, _fp8(new_variables), _fp8(grads))
        # ... which is the recipe's next state for this step's tensors.
        grad_y = jax.grad(_mse)(_step_forward(layer.apply)(variables, x), target)
        amaxes = {
            "x": (amax_of(x), 0),
            "kernel": (amax_of(_params(variables)["kernel"]), 0),
            "grad": (amax_of(grad_y), RECOMPUTED_RTOL),
        }
        assert_delayed_step(_fp8(variables), _fp8(new_variables), "", amaxes)
        # The parameters follow the optimizer, which saw the parameter gradients only.
        if optimizer == "sgd":
            expected = _expected_sgd_chain_params(_params(variables), _params(grads))
        else:
            with jax.numpy_dtype_promotion("standard"):
                expected, reference_tx_state = _expected_params_by_optax(
                    tx, reference_tx_state, variables["params"], grads["params"]
                )
            expected = nn.meta.unbox(expected)
        assert_tree_close(_params(new_variables), expected, 1e-5)
        changed = jax.tree.map(
            lambda a, b: bool(jnp.any(a != b)), _params(variables), _params(new_variables)
        )
        assert all(jax.tree.leaves(changed)), changed
        variables = new_variables


def test_apply_gradients_keeps_other_collections_and_frozen_dicts():
    _, loss_fn, variables, xs, targets = _dense_problem()
    tx = _sgd_chain()
    extra = {"mean": jnp.zeros((8,), F32)}
    variables = freeze({**variables, "batch_stats": extra})
    opt_state = init_optimizer(tx, variables)
    grads = jax.jit(jax.grad(loss_fn))(variables, xs[0], targets[0])
    new_variables, _ = apply_gradients(tx, variables, grads, opt_state)
    assert type(new_variables) is type(variables)
    assert set(new_variables) == {"params", OVERWRITE_WITH_GRADIENT, "batch_stats"}
    np.testing.assert_array_equal(new_variables["batch_stats"]["mean"], extra["mean"])
    jax.tree.map(np.testing.assert_array_equal, _fp8(new_variables), _fp8(grads))


# ----------------------------------------------------------------------------- MultiSteps


def _microbatch_problem():
    """A DenseGeneral and two cycles of two microbatches ``(x, output gradient)``."""
    layer = te_nn.DenseGeneral(features=8, recipe=RECIPE)
    rng = np.random.default_rng(5)

    def draw(shape, scale):
        return jnp.asarray(scale * rng.standard_normal(shape), F32)

    # Per cycle: one microbatch has the larger input, the other the larger output gradient, so
    # the merged state takes entries from both. The second cycle's tensors are smaller, so a
    # state left over from the first cycle would show.
    cycles = [
        [(draw((4, 16), 3.0), draw((4, 8), 0.5)), (draw((4, 16), 1.0), draw((4, 8), 2.0))],
        [(draw((4, 16), 0.5), draw((4, 8), 0.1)), (draw((4, 16), 0.2), draw((4, 8), 0.3))],
    ]

    def loss_fn(variables, x, weight):
        # The output gradient is ``weight`` exactly, so its amax is known bit for bit.
        return jnp.sum(layer.apply(variables, x) * weight)

    variables = layer.init(jax.random.key(0), cycles[0][0][0])
    return layer, loss_fn, variables, cycles


def _merged_amaxes(variables, microbatches) -> dict:
    """The recipe's newest history entries after one step over all ``microbatches``."""
    return {
        "x": (max(amax_of(x) for x, _ in microbatches), 0),
        "kernel": (amax_of(_params(variables)["kernel"]), 0),
        "grad": (max(amax_of(weight) for _, weight in microbatches), 0),
    }


def test_multi_steps_holds_fp8_state_then_applies_the_max_of_the_microbatch_updates():
    _, loss_fn, variables, cycles = _microbatch_problem()
    learning_rate = 0.05
    tx = optax.MultiSteps(optax.sgd(learning_rate), every_k_schedule=2)
    grad_fn = jax.jit(jax.grad(loss_fn))

    @jax.jit
    def update(variables, grads, opt_state):
        # MultiSteps counts microsteps in int32 and divides by the count.
        with jax.numpy_dtype_promotion("standard"):
            return apply_gradients(tx, variables, grads, opt_state)

    opt_state = init_optimizer(tx, variables)
    _assert_no_fp8_in(opt_state.tx_state)
    for microbatches in cycles:
        start = variables
        (x1, w1), (x2, w2) = microbatches
        grads_1 = grad_fn(start, x1, w1)
        variables, opt_state = update(start, grads_1, opt_state)
        # The first microstep changes nothing: not the parameters, not the FP8 state.
        jax.tree.map(np.testing.assert_array_equal, variables, start)

        grads_2 = grad_fn(variables, x2, w2)
        variables, opt_state = update(variables, grads_2, opt_state)
        merged = jax.tree.map(jnp.maximum, _fp8(grads_1), _fp8(grads_2))
        jax.tree.map(np.testing.assert_array_equal, _fp8(variables), merged)
        assert_delayed_step(_fp8(start), _fp8(variables), "", _merged_amaxes(start, microbatches))

        # The parameters take one sgd step on the mean of the microbatch gradients.
        mean_grads = jax.tree.map(lambda a, b: (a + b) / 2, _params(grads_1), _params(grads_2))
        expected = jax.tree.map(lambda p, g: p - learning_rate * g, _params(start), mean_grads)
        assert_tree_close(_params(variables), expected, 1e-5)


class _SharedDense(nn.Module):
    """One DenseGeneral (one FP8 state) applied to every microbatch inside one ``apply``."""

    @nn.compact
    def __call__(self, xs):
        dense = te_nn.DenseGeneral(features=8, recipe=RECIPE)
        return [dense(x) for x in xs]


@pytest.mark.parametrize("where", ["separate_applies", "one_apply"])
def test_one_step_over_microbatches_max_merges_the_module_state(where):
    """Inside one jitted grad that marks the state, the updates of all its uses merge by max.

    That is the state an accumulated ``optax.MultiSteps`` step gives (the test above), so one
    step over k microbatches and k accumulated microsteps leave the same FP8 state.
    """
    layer, _, variables, cycles = _microbatch_problem()
    microbatches = cycles[0]
    if where == "separate_applies":

        def apply_all(variables, xs):
            return [layer.apply(variables, x) for x in xs]

    else:
        shared = _SharedDense()

        def apply_all(variables, xs):
            # The same variables, nested under the shared submodule's name.
            nested = {
                collection: {"DenseGeneral_0": tree} for collection, tree in variables.items()
            }
            return shared.apply(nested, xs)

    def loss_fn(variables, microbatches):
        # Marked before the state fans out to its uses, so that their updates merge by max.
        variables = merge_fp8_state(variables)
        ys = apply_all(variables, [x for x, _ in microbatches])
        return sum(jnp.sum(y * weight) for y, (_, weight) in zip(ys, microbatches, strict=True))

    grad_fn = jax.jit(jax.grad(loss_fn))
    separate = [grad_fn(variables, [microbatch]) for microbatch in microbatches]
    combined = grad_fn(variables, microbatches)
    # Parameter gradients add up over the uses ...
    summed = jax.tree.map(lambda a, b: a + b, _params(separate[0]), _params(separate[1]))
    assert_tree_close(_params(combined), summed, 1e-5)
    # ... and the FP8 state updates merge by elementwise max.
    assert_delayed_step(
        _fp8(variables), _fp8(combined), "", _merged_amaxes(variables, microbatches)
    )
    merged = jax.tree.map(jnp.maximum, _fp8(separate[0]), _fp8(separate[1]))
    jax.tree.map(np.testing.assert_array_equal, _fp8(combined), merged)


# ----------------------------------------------------------------------------- errors


def test_apply_gradients_refuses_an_opt_state_not_from_init_optimizer():
    _, loss_fn, variables, xs, targets = _dense_problem()
    tx = optax.sgd(0.1)
    grads = jax.jit(jax.grad(loss_fn))(variables, xs[0], targets[0])
    with pytest.raises(TypeError, match="init_optimizer"):
        apply_gradients(tx, variables, grads, tx.init(variables["params"]))


def test_variables_without_params_are_refused():
    _, loss_fn, variables, xs, targets = _dense_problem()
    tx = optax.sgd(0.1)
    fp8_only = {OVERWRITE_WITH_GRADIENT: variables[OVERWRITE_WITH_GRADIENT]}
    with pytest.raises(TypeError, match="'params'"):
        init_optimizer(tx, fp8_only)
    with pytest.raises(TypeError, match="'params'"):
        init_optimizer(tx, variables["params"]["kernel"])
    opt_state = init_optimizer(tx, variables)
    grads = jax.jit(jax.grad(loss_fn))(variables, xs[0], targets[0])
    with pytest.raises(TypeError, match="variables must be a Flax variable dict"):
        apply_gradients(tx, fp8_only, grads, opt_state)
    with pytest.raises(TypeError, match="grads must be a Flax variable dict"):
        apply_gradients(
            tx, variables, {OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}, opt_state
        )
