"""Training-step faults: non-finite batches, FP8 state summed instead of merged, strict promotion.

* ``skip_nonfinite``: a batch with a NaN in the input or an infinite loss leaves parameters,
  optimizer state and FP8 state unchanged (Linen ``apply_gradients`` and the NNX ``train_step``,
  every recipe) and is counted; without the option the documented behaviour holds.
* A state reused without ``merge_fp8_state`` comes back summed; ``check_merged`` (called by the
  helpers where the new state is applied) catches it: a layer applied twice, a Python loop over
  microbatches, an ``nn.scan`` broadcasting one state, a TransformerEngine-style loop.
* The tests run under strict dtype promotion (tests/conftest.py), with optax's AdamW.
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
from te_flax.nnx import Fp8Meta
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    check_merged,
)
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    all_finite,
    apply_gradients,
    init_optimizer,
    value_and_grad,
)

FP8 = OVERWRITE_WITH_GRADIENT
DELAYED = DelayedScaling(amax_history_len=4)
RECIPES = {
    "delayed": DELAYED,
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
HIDDEN, FEATURES = 32, 32


def _x(seed: int = 0) -> jax.Array:
    return 3.0 * jax.random.normal(jax.random.key(seed), (32, HIDDEN), jnp.float32)


def _bad_batch(kind: str) -> tuple[jax.Array, jax.Array]:
    """(input, loss weight): a NaN in one input element, or an infinite loss."""
    if kind == "nan_input":
        return _x(1).at[1, 3].set(jnp.nan), jnp.asarray(1.0)
    return _x(1), jnp.asarray(jnp.inf)


def _assert_same(tree_a, tree_b) -> None:
    jax.tree.map(np.testing.assert_array_equal, tree_a, tree_b)


# ----------------------------------------------------------------------------- skip_nonfinite


def _linen_step(layer, tx, skip_nonfinite: bool):
    @jax.jit
    def step(variables, opt_state, x, weight):
        def loss_fn(variables):
            return jnp.mean(jnp.square(layer.apply(variables, x))) * weight

        loss, grads = value_and_grad(loss_fn)(variables)
        variables, opt_state = apply_gradients(
            tx, variables, grads, opt_state, skip_nonfinite=skip_nonfinite
        )
        return variables, opt_state, loss

    return step


@pytest.mark.parametrize("bad", ["nan_input", "inf_loss"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linen_step_skips_a_nonfinite_batch_and_counts_it(recipe, bad):
    layer = te_nn.DenseGeneral(features=FEATURES, recipe=RECIPES[recipe])
    variables = layer.init(jax.random.key(0), _x())
    tx = optax.adamw(1e-2)
    step = _linen_step(layer, tx, skip_nonfinite=True)
    variables, opt_state, _ = step(variables, init_optimizer(tx, variables), _x(), 1.0)
    assert int(opt_state.skipped_steps) == 0

    x, weight = _bad_batch(bad)
    after, after_opt, loss = step(variables, opt_state, x, weight)
    assert not np.isfinite(float(loss))
    _assert_same(after, variables)  # parameters and FP8 state
    _assert_same(after_opt.tx_state, opt_state.tx_state)
    assert int(after_opt.skipped_steps) == 1
    assert bool(all_finite(after)) and bool(all_finite(after_opt.tx_state))

    # The next good batch trains as usual; the count stays.
    trained, trained_opt, _ = step(after, after_opt, _x(2), 1.0)
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), trained["params"], after["params"]
    )
    assert all(jax.tree.leaves(changed))
    assert int(trained_opt.skipped_steps) == 1


def test_linen_step_without_the_option_applies_nonfinite_gradients():
    """Documented behaviour: NaN reaches the parameters, the FP8 state stays finite."""
    layer = te_nn.DenseGeneral(features=FEATURES, recipe=DELAYED)
    variables = layer.init(jax.random.key(0), _x())
    tx = optax.adamw(1e-2)
    step = _linen_step(layer, tx, skip_nonfinite=False)
    variables, opt_state, _ = step(variables, init_optimizer(tx, variables), _x(), 1.0)
    after, after_opt, _ = step(variables, opt_state, *_bad_batch("nan_input"))
    assert not bool(all_finite(after["params"]))
    assert bool(all_finite(after[FP8]))
    fp8, before = after[FP8], variables[FP8]
    # The NaN amax is recorded as 0 ("no information") and the scale of that tensor is kept.
    assert float(fp8["x_amax_history"][0]) == 0.0
    np.testing.assert_array_equal(fp8["x_amax_history"][1:], before["x_amax_history"][:-1])
    np.testing.assert_array_equal(fp8["x_scale_inv"], before["x_scale_inv"])
    assert int(after_opt.skipped_steps) == 0


def test_a_skipped_microbatch_is_left_out_of_the_accumulation():
    layer = te_nn.DenseGeneral(features=FEATURES, recipe=DELAYED)
    variables = layer.init(jax.random.key(0), _x())
    tx = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)
    step = _linen_step(layer, tx, skip_nonfinite=True)
    opt_state = init_optimizer(tx, variables)
    # good, bad, good: the bad microbatch changes nothing, so the two good ones make one step.
    variables_1, opt_1, _ = step(variables, opt_state, _x(2), 1.0)
    variables_2, opt_2, _ = step(variables_1, opt_1, *_bad_batch("nan_input"))
    _assert_same((variables_2, opt_2.tx_state, opt_2.pending_fp8), (variables_1, *opt_1[:2]))
    variables_3, opt_3, _ = step(variables_2, opt_2, _x(3), 1.0)
    reference, reference_opt, _ = step(
        *step(variables, opt_state, _x(2), 1.0)[:2], _x(3), jnp.asarray(1.0)
    )
    _assert_same(variables_3, reference)
    assert int(opt_3.skipped_steps) == 1 and int(reference_opt.skipped_steps) == 0


def _nnx_layer(recipe):
    return te_nnx.DenseGeneral(HIDDEN, FEATURES, recipe=recipe, rngs=nnx.Rngs(0))


def _nnx_loss(model, x, weight):
    return jnp.mean(jnp.square(model(x))) * weight


@pytest.mark.parametrize("bad", ["nan_input", "inf_loss"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_nnx_train_step_skips_a_nonfinite_batch(recipe, bad):
    model = _nnx_layer(RECIPES[recipe])
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = nnx.jit(lambda m, o, x, w: te_nnx.train_step(m, o, _nnx_loss, x, w, skip_nonfinite=True))
    _, skipped = step(model, optimizer, _x(), jnp.asarray(1.0))
    assert not bool(skipped)
    before = jax.tree.map(jnp.asarray, nnx.state((model, optimizer)))
    loss, skipped = step(model, optimizer, *_bad_batch(bad))
    assert bool(skipped) and not np.isfinite(float(loss))
    _assert_same(nnx.state((model, optimizer)), before)
    assert int(optimizer.step[...]) == 1


# ----------------------------------------------------------------------------- summed FP8 state


class _Twice(nn.Module):
    """One DenseGeneral (one FP8 state) applied to two inputs."""

    @nn.compact
    def __call__(self, xs):
        dense = te_nn.DenseGeneral(features=FEATURES, recipe=DELAYED, name="dense")
        return sum(jnp.sum(jnp.square(dense(x))) for x in xs)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + te_nn.DenseGeneral(features=HIDDEN, recipe=DELAYED, name="dense")(x), None


class _ScannedBroadcast(nn.Module):
    """Three layers under nn.scan sharing one broadcast FP8 state."""

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(
            _Block,
            variable_axes={"params": 0},
            variable_broadcast=FP8,
            split_rngs={"params": True},
            length=3,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        y, _ = scan(name="layers")(xs[0], None)
        return jnp.sum(jnp.square(y))


def _loop_over_microbatches(model):
    def loss(variables, xs):
        return sum(model.apply(variables, [x]) for x in xs)  # one apply per microbatch

    return loss


def _scan_over_microbatches(model):
    def loss(variables, xs):
        def body(total, x):  # the body reads the state once; the scan adds the iterations'
            return total + model.apply(variables, [x]), None

        return jax.lax.scan(body, jnp.zeros(()), jnp.stack(xs))[0]

    return loss


REUSES = {
    "applied_twice": (_Twice, lambda model: lambda v, xs: model.apply(v, xs)),
    "microbatch_loop": (_Twice, _loop_over_microbatches),
    "microbatch_scan": (_Twice, _scan_over_microbatches),
    "scan_broadcast": (_ScannedBroadcast, lambda model: lambda v, xs: model.apply(v, xs)),
}


def _after_one_step(name):
    """A model whose FP8 state has taken one (merged) step, so its histories are not all 0."""
    make_model, make_loss = REUSES[name]
    model = make_model()
    xs = [0.1 * _x(4), 0.1 * _x(5)]
    loss = make_loss(model)
    variables = model.init(jax.random.key(0), xs)
    tx = optax.sgd(1e-3)
    _, grads = jax.jit(value_and_grad(loss))(variables, xs)
    variables, _ = apply_gradients(tx, variables, grads, init_optimizer(tx, variables))
    return variables, loss, xs, tx


@pytest.mark.parametrize("name", ["applied_twice", "microbatch_loop"])
def test_a_state_read_twice_merges_by_max_under_plain_jax_grad_and_train_state(name):
    # The same arrays read twice, within one apply or in one apply per microbatch: the reads
    # share one mark, so Flax's TrainState with jax.grad (no te_flax helper) gets the
    # max-merged state.
    variables, loss, xs, _ = _after_one_step(name)
    plain = jax.jit(jax.grad(loss))(variables, xs)
    _, merged = jax.jit(value_and_grad(loss))(variables, xs)
    check_merged(variables[FP8], plain[FP8])
    for a, b in zip(jax.tree.leaves(plain[FP8]), jax.tree.leaves(merged[FP8]), strict=True):
        np.testing.assert_array_equal(a, b)
    state = train_state.TrainState.create(apply_fn=None, params=variables, tx=optax.sgd(1e-3))
    state = state.apply_gradients(grads=plain)
    history = state.params[FP8]["dense"]["x_amax_history"]
    np.testing.assert_array_equal(history[1:], variables[FP8]["dense"]["x_amax_history"][:-1])


UNSEEN = ["microbatch_scan", "scan_broadcast"]  # loops of JAX's own: one read per body


@pytest.mark.parametrize("name", UNSEEN)
def test_a_reuse_without_the_merge_is_refused_where_the_state_is_applied(name):
    variables, loss, xs, tx = _after_one_step(name)
    opt_state = init_optimizer(tx, variables)
    summed = jax.jit(jax.grad(loss))(variables, xs)  # no merge_fp8_state
    with pytest.raises(ValueError, match=r"summed over its uses.*merge_fp8_state"):
        apply_gradients(tx, variables, summed, opt_state)
    with pytest.raises(ValueError, match="summed"):
        check_merged(variables[FP8], summed[FP8])

    # Through te_flax's value_and_grad the same step max-merges: the history shifts by one.
    _, merged = jax.jit(value_and_grad(loss))(variables, xs)
    new_variables, _ = apply_gradients(tx, variables, merged, opt_state)
    for old, new in zip(
        jax.tree.leaves(variables[FP8]), jax.tree.leaves(new_variables[FP8]), strict=True
    ):
        if old.shape[-1] > 1:  # a history
            np.testing.assert_array_equal(new[..., 1:], old[..., :-1])


def test_under_jit_a_summed_state_is_refused_as_outside_it():
    variables, loss, xs, tx = _after_one_step("microbatch_scan")
    opt_state = init_optimizer(tx, variables)

    @jax.jit
    def step(variables, opt_state):
        return apply_gradients(tx, variables, jax.grad(loss)(variables, xs), opt_state)

    # Every call, not once per process: the check's host callback stops the step.
    for _ in range(2):
        with pytest.raises(Exception, match=r"\['dense'\]\['x_amax_history'\] \(2x\)"):
            jax.block_until_ready(step(variables, opt_state))
            jax.effects_barrier()


def test_a_transformer_engine_style_loop_is_covered_by_check_merged():
    """TE's examples keep the FP8 collection of the gradients as the next variables."""
    variables, loss, xs, _ = _after_one_step("microbatch_scan")
    grads = jax.jit(jax.grad(loss))(variables, xs)
    next_variables = {
        "params": jax.tree.map(lambda p, g: p - 1e-3 * g, variables["params"], grads["params"]),
        FP8: grads[FP8],
    }
    with pytest.raises(ValueError, match=r"x_amax_history'\] \(2x\)"):
        check_merged(variables[FP8], next_variables[FP8])


def test_a_first_step_cannot_tell_a_sum_and_passes():
    """With an all-zero history the shifted part is 0 either way: nothing to compare yet."""
    model = _Twice()
    xs = [_x(4), _x(5)]
    variables = model.init(jax.random.key(0), xs)
    grads = jax.jit(jax.grad(lambda v: model.apply(v, xs)))(variables)
    check_merged(variables[FP8], grads[FP8])


def test_nnx_gradients_without_the_merge_are_refused_by_update_fp8_state():
    model = _nnx_layer(DELAYED)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    xs = jnp.stack([_x(), 2 * _x()])

    def scanned(model, xs):  # microbatches under nnx.scan: a reuse the layer cannot see
        @nnx.scan(in_axes=(nnx.Carry, None, 0), out_axes=nnx.Carry)
        def body(total, model, x):
            return total + jnp.sum(jnp.square(model(x)))

        return body(jnp.zeros(()), model, xs)

    nnx.jit(lambda m, o, xs: te_nnx.train_step(m, o, scanned, xs))(model, optimizer, xs)
    diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    grads = nnx.jit(nnx.grad(scanned, argnums=diff))(model, xs)
    with pytest.raises(ValueError, match="summed over its uses"):
        te_nnx.update_fp8_state(model, grads)
    # te_flax's train_step merges: the second step's history is the first one shifted.
    history = jnp.asarray(model.x_amax_history[...])
    nnx.jit(lambda m, o, xs: te_nnx.train_step(m, o, scanned, xs))(model, optimizer, xs)
    np.testing.assert_array_equal(model.x_amax_history[...][1:], history[:-1])


def test_an_nnx_layer_called_twice_merges_by_max_under_plain_nnx_grad():
    model = _nnx_layer(DELAYED)

    def twice(model, x):
        return jnp.sum(jnp.square(model(x))) + jnp.sum(jnp.square(model(2 * x)))

    diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    grads = nnx.jit(nnx.grad(twice, argnums=diff))(model, _x())
    history = nnx.state(grads, Fp8Meta)["x_amax_history"][...]
    np.testing.assert_allclose(history[0], 2 * float(jnp.max(jnp.abs(_x()))), rtol=1e-6)


def test_check_merged_refuses_trees_of_different_structure():
    with pytest.raises(ValueError, match="same tree structure"):
        check_merged({"x_amax_history": jnp.ones(4)}, {"y_amax_history": jnp.ones(4)})


# ----------------------------------------------------------------------------- strict promotion


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
        optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    ],
    ids=["adamw_schedule", "multi_steps_adam", "clip_adamw"],
)
def test_optax_optimizers_run_under_strict_promotion(tx):
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    layer = te_nn.DenseGeneral(features=FEATURES, recipe=DELAYED)
    variables = layer.init(jax.random.key(0), _x())
    step = _linen_step(layer, tx, skip_nonfinite=False)
    opt_state = init_optimizer(tx, variables)
    for i in range(2):
        variables, opt_state, loss = step(variables, opt_state, _x(i), 1.0)
    assert np.isfinite(float(loss)) and bool(all_finite(variables))
