"""``accumulate_gradients``: microbatches in one step, the kernels quantized once per step."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_flax.linen as te_nn
from te_flax.accumulate import accumulate_gradients, split_microbatches
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    init_optimizer,
    merge_fp8_state,
)
from tests.helpers import normal

K, BATCH, SEQ, HIDDEN, INTERMEDIATE = 4, 2, 8, 32, 64
KERNEL_ELEMENTS = HIDDEN * INTERMEDIATE  # both kernels of a non-gated LayerNormMLP
RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling,
    "none": lambda: None,
}
FLOAT8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _model(recipe: str, dtype=jnp.float32) -> te_nn.LayerNormMLP:
    return te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE, activations=("gelu",), recipe=RECIPES[recipe](), dtype=dtype
    )


@functools.cache
def _problem(recipe: str, dtype=jnp.float32):
    """``(loss_fn, variables, microbatches)``, the same objects for the same arguments (so
    that jitted steps of one problem compile once)."""
    model = _model(recipe, dtype)
    # Microbatches of different scales, so that their amaxes (and FP8 updates) differ.
    x = normal(jax.random.key(1), (K, BATCH, SEQ, HIDDEN))
    x = (x * jnp.arange(1.0, K + 1.0).reshape(K, 1, 1, 1)).astype(dtype)
    variables = jax.tree.map(
        lambda leaf: leaf.value if hasattr(leaf, "value") else leaf,
        model.init(jax.random.key(0), x[0]),
        is_leaf=lambda leaf: hasattr(leaf, "value"),
    )

    def loss_fn(variables, microbatch):
        out, _ = model.apply(merge_fp8_state(variables), microbatch)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return loss_fn, variables, x


@functools.partial(jax.jit, static_argnums=(0, 3))
def _accumulated(loss_fn, variables, microbatches, quantize_once):
    return accumulate_gradients(loss_fn, variables, microbatches, quantize_once=quantize_once)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
    "recipe", ["delayed", *(pytest.param(r, marks=pytest.mark.slow) for r in ("current", "none"))]
)
def test_quantizing_once_gives_the_same_loss_gradients_and_fp8_state(recipe):
    loss_fn, variables, x = _problem(recipe)
    once = _accumulated(loss_fn, variables, x, True)
    every = _accumulated(loss_fn, variables, x, False)
    # The same operations on the same values, only moved out of the loop: bit for bit. (In
    # bf16 compute XLA may skip a bf16 rounding inside a fusion, xla_allow_excess_precision,
    # and the two programs fuse differently; with that flag off bf16 is bit-exact too.)
    jax.tree.map(np.testing.assert_array_equal, once, every)


def test_result_is_the_mean_gradient_and_the_max_merged_fp8_state():
    loss_fn, variables, x = _problem("delayed")
    loss, grads = _accumulated(loss_fn, variables, x, True)
    singles = [jax.jit(jax.value_and_grad(loss_fn))(variables, x[i]) for i in range(K)]
    np.testing.assert_allclose(loss, np.mean([s[0] for s in singles]), rtol=1e-6)
    for name in grads["params"]:
        mean = np.mean([s[1]["params"][name] for s in singles], axis=0)
        np.testing.assert_allclose(grads["params"][name], mean, rtol=1e-5, atol=1e-7, err_msg=name)
    for name, state in grads[OVERWRITE_WITH_GRADIENT].items():
        merged = np.max([s[1][OVERWRITE_WITH_GRADIENT][name] for s in singles], axis=0)
        np.testing.assert_array_equal(state, merged, err_msg=name)
    # The microbatches' amaxes differ, so the merge is not a copy of one of them.
    histories = [s[1][OVERWRITE_WITH_GRADIENT]["x_0_amax_history"][0] for s in singles]
    assert len(set(np.asarray(histories).tolist())) == K


def test_one_accumulated_step_equals_k_optax_multisteps_mini_steps():
    loss_fn, variables, x = _problem("delayed")
    tx = optax.sgd(0.1)
    _, grads = _accumulated(loss_fn, variables, x, True)
    accumulated, _ = apply_gradients(tx, variables, grads, init_optimizer(tx, variables))

    multi = optax.MultiSteps(tx, every_k_schedule=K)
    stepped, opt_state = variables, init_optimizer(multi, variables)
    grad_fn = jax.jit(jax.grad(loss_fn))
    for i in range(K):
        mini_grads = grad_fn(stepped, x[i])
        # MultiSteps counts microsteps in int32 and divides by the count.
        with jax.numpy_dtype_promotion("standard"):
            stepped, opt_state = apply_gradients(multi, stepped, mini_grads, opt_state)
    for name, value in accumulated["params"].items():
        np.testing.assert_allclose(value, stepped["params"][name], rtol=1e-6, err_msg=name)
    for name, value in accumulated[OVERWRITE_WITH_GRADIENT].items():
        np.testing.assert_array_equal(value, stepped[OVERWRITE_WITH_GRADIENT][name], name)


# ----------------------------------------------------------------------------- what runs where


def _kernel_quantizations(jaxpr) -> int:
    """float8 casts of kernel-sized arrays in ``jaxpr`` and the jaxprs it calls."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            (out,) = eqn.outvars
            if out.aval.dtype in FLOAT8 and math.prod(out.aval.shape) == KERNEL_ELEMENTS:
                count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _kernel_quantizations(sub)
    return count


def _scan_body_and_outside(quantize_once: bool):
    loss_fn, variables, x = _problem("delayed")
    step = functools.partial(accumulate_gradients, quantize_once=quantize_once)
    jaxpr = jax.make_jaxpr(step, static_argnums=0)(loss_fn, variables, x).jaxpr
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    inside = _kernel_quantizations(scan.params["jaxpr"].jaxpr)
    return inside, _kernel_quantizations(jaxpr) - inside


def test_quantize_once_moves_the_kernel_quantization_out_of_the_microbatch_loop():
    # Both kernels once, before the loop: no float8 kernel is made inside it.
    assert _scan_body_and_outside(True) == (0, 2)
    # Without the option the loop body quantizes both kernels, each microbatch.
    assert _scan_body_and_outside(False) == (2, 0)


# ----------------------------------------------------------------------------- deviceless H100


_WHILE_BODY = re.compile(r"\swhile\(.*body=%([^\s,}]+)")


def _h100_loop_quantizations(quantize_once: bool) -> tuple[int, int]:
    """Kernel quantizations (instructions writing a float8 kernel) in and outside the
    microbatch loop of the optimized H100 program."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from tests.gpu_target import h100_sharding

    loss_fn, variables, x = _problem("delayed", jnp.bfloat16)
    sharding = h100_sharding()
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
    step = functools.partial(accumulate_gradients, loss_fn, quantize_once=quantize_once)
    hlo = jax.jit(step).lower(jax.tree.map(abstract, variables), abstract(x)).compile().as_text()
    computations, current = {}, None
    for line in hlo.splitlines():
        if match := re.match(r"^(ENTRY )?%(\S+) .*\{$", line):
            current = computations.setdefault("ENTRY" if match[1] else match[2], [])
        elif current is not None:
            current.append(line)

    def quantizes(line: str) -> bool:
        for dims in re.findall(r"f8e(?:4m3fn|5m2)\[([0-9,]*)\]\S* convert\(", line):
            if math.prod(int(d) for d in dims.split(",")) == KERNEL_ELEMENTS:
                return True
        return any(
            quantizes(inner)
            for callee in re.findall(r"calls=%([^\s,}]+)", line)
            for inner in computations.get(callee, [])
        )

    (body,) = {
        b for lines in computations.values() for line in lines for b in _WHILE_BODY.findall(line)
    }
    inside = sum(quantizes(line) for line in computations[body])
    outside = sum(quantizes(line) for line in computations["ENTRY"] if " while(" not in line)
    return inside, outside


@pytest.mark.gpu_compile
def test_h100_compile_quantizes_the_kernels_once_per_step_only_with_the_option():
    # XLA:GPU does not move the kernel quantization out of the loop by itself (XLA:CPU does):
    # without the option each microbatch quantizes both kernels again (at this size in two
    # fusions each, the GEMM's layout and the transposed one for dgrad).
    inside, outside = _h100_loop_quantizations(False)
    assert inside >= 2 and outside == 0, (inside, outside)
    # With it, one fusion per kernel before the loop writes both layouts.
    assert _h100_loop_quantizations(True) == (0, 2)


# ----------------------------------------------------------------------------- arguments


def test_split_microbatches_reshapes_every_leaf():
    batch = {"x": jnp.zeros((8, 3)), "y": jnp.zeros((8,))}
    split = split_microbatches(batch, 4)
    assert split["x"].shape == (4, 2, 3) and split["y"].shape == (4, 2)


@pytest.mark.parametrize(
    ("batch", "k", "message"),
    [
        ({"x": jnp.zeros((6, 3))}, 4, r"shape \(6, 3\) cannot be split into 4 microbatches"),
        (
            {"x": jnp.zeros((8,))},
            0,
            r"num_microbatches must be a positive int, got 0; 1 means no accumulation",
        ),
    ],
)
def test_split_microbatches_refuses_what_does_not_divide(batch, k, message):
    with pytest.raises(ValueError, match=message):
        split_microbatches(batch, k)


def test_microbatches_must_agree_on_k():
    loss_fn, variables, x = _problem("none")
    with pytest.raises(ValueError, match="disagree on the number of microbatches"):
        accumulate_gradients(loss_fn, variables, {"a": x, "b": x[:2]})
    with pytest.raises(ValueError, match="leading microbatch axis"):
        accumulate_gradients(loss_fn, variables, jnp.float32(1.0))
