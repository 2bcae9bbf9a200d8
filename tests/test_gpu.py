"""On a real GPU: the FP8 ops agree with the CPU emulation, and the example GPT trains in FP8.

Marked ``gpu`` and skipped without a GPU backend. ``scripts/gpu_check`` runs them on one with
``JAX_PLATFORMS=cuda,cpu``, so one process holds both backends: the same inputs go through the
GPU (cuBLASLt FP8 GEMMs on Hopper and newer) and through XLA:CPU's emulation of the same
program, and the results must agree within the FP8 tolerances of ``tests/helpers.py``.

Environment:
  ``TE_FLAX_GPU_SMOKE=1``: run on the CPU alone, tiny sizes and few steps, a second CPU device
  standing in for the GPU. It checks these tests (``scripts/gpu_check --smoke``), not a GPU.
  ``TE_FLAX_GPU_FIGURES=DIR``: each test writes what it measured to ``DIR/<test>.json``, and
  the training test its loss report to ``DIR/lm``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_flax.dense import dense, grouped_dense, grouped_quantizer_set
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    noop_quantizer_set,
)
from tests.helpers import (
    BLOCK_BACKWARD_TOLERANCE,
    BLOCK_FORWARD_TOLERANCE,
    F32,
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    assert_close,
    normal,
    relative_error,
)

SMOKE = os.environ.get("TE_FLAX_GPU_SMOKE") == "1"
FIGURES = os.environ.get("TE_FLAX_GPU_FIGURES")


def _devices() -> tuple[jax.Device | None, jax.Device | None, str]:
    """(accelerator, cpu, reason to skip)."""
    cpus = jax.devices("cpu")
    if SMOKE:
        return cpus[-1], cpus[0], ""
    try:
        return jax.devices("gpu")[0], cpus[0], ""
    except RuntimeError as error:
        return (
            None,
            None,
            (
                f"no GPU backend ({error}); scripts/gpu_check runs these tests on a GPU machine "
                "(or: JAX_PLATFORMS=cuda,cpu pytest -m gpu)"
            ),
        )


ACCELERATOR, CPU, NO_GPU = _devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(ACCELERATOR is None, reason=NO_GPU)]

# Tokens (batch x seq), hidden and output features; multiples of 32 for the block-scaled
# recipes and of 16 for cuBLASLt's FP8 GEMMs.
BATCH, SEQ, HIDDEN, FEATURES = (2, 16, 32, 64) if SMOKE else (4, 128, 1024, 2048)
STEPS = 3
# The input shrinks over the steps, so delayed scaling (the scale from the previous steps'
# amax) never clips, and every history entry differs.
INPUT_FACTORS = (1.0, 0.8, 0.6)
FP8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'
OTHER_GEMM = re.compile(r'custom_call_target="__cublas\$(gemm|lt\$matmul)"')

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=16),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
# Every op under the per-tensor recipes; the block-scaled ones (jax.nn.scaled_matmul on a GPU,
# lax.scaled_dot elsewhere: different code on the two backends) through layernorm_dense.
CASES = [
    *(
        (op, recipe)
        for op in ("dense", "layernorm_dense", "layernorm_mlp")
        for recipe in ("delayed", "current")
    ),
    ("layernorm_dense", "mxfp8"),
    ("layernorm_dense", "nvfp4"),
]
GEMMS_PER_STEP = {"dense": 3, "layernorm_dense": 3, "layernorm_mlp": 6}


@pytest.fixture
def record(request):
    """A dict of what the test measured, written to ``$TE_FLAX_GPU_FIGURES/<test>.json``."""
    figures = {
        "test": request.node.nodeid,
        "accelerator": str(ACCELERATOR),
        "cpu": str(CPU),
        "smoke": SMOKE,
        "sizes": {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "features": FEATURES},
    }
    yield figures
    if FIGURES:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")
        path = Path(FIGURES) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=1, default=float) + "\n")


# ----------------------------------------------------------------------------- the ops


@functools.cache
def _inputs(op: str) -> dict:
    """The op's inputs as host arrays, so that both devices get the very same values."""
    with jax.default_device(CPU):
        return jax.device_get(_make_inputs(op))


def _make_inputs(op: str) -> dict:
    keys = jax.random.split(jax.random.key(17), 9)
    # bf16 activations and float32 parameters, as in training.
    x = normal(keys[0], (BATCH, SEQ, HIDDEN), jnp.bfloat16, 2.0) + jnp.asarray(0.5, jnp.bfloat16)
    arrays = {"x": x}
    if op == "layernorm_mlp":
        arrays |= {
            "gamma": 1.0 + normal(keys[1], (HIDDEN,), F32, 0.1),
            "beta": normal(keys[2], (HIDDEN,), F32, 0.1),
            # [hidden, n_act, intermediate] (SwiGLU) and [intermediate, hidden]
            "kernel_1": normal(keys[3], (HIDDEN, 2, FEATURES), F32, HIDDEN**-0.5),
            "kernel_2": normal(keys[4], (FEATURES, HIDDEN), F32, FEATURES**-0.5),
            "bias_1": normal(keys[5], (2, FEATURES), F32, 0.1),
            "bias_2": normal(keys[6], (HIDDEN,), F32, 0.1),
        }
        out_features = HIDDEN
    else:
        arrays |= {
            "kernel": normal(keys[3], (HIDDEN, FEATURES), F32, HIDDEN**-0.5),
            "bias": normal(keys[5], (FEATURES,), F32, 0.1),
        }
        if op == "layernorm_dense":
            arrays["gamma"] = 1.0 + normal(keys[1], (HIDDEN,), F32, 0.1)
            arrays["beta"] = normal(keys[2], (HIDDEN,), F32, 0.1)
        out_features = FEATURES
    cotangent = normal(keys[8], (BATCH, SEQ, out_features), F32)
    return {"arrays": arrays, "cotangent": cotangent}


def _apply(op: str, arrays: dict, sets):
    a = arrays
    if op == "dense":
        return dense(a["x"], a["kernel"], a["bias"], quantizer_set=sets[0])
    if op == "layernorm_dense":
        return layernorm_dense(
            a["x"], a["kernel"], a["gamma"], a["beta"], a["bias"], quantizer_set=sets[0]
        )
    return layernorm_mlp(
        a["x"],
        a["gamma"],
        a["beta"],
        [a["kernel_1"], a["kernel_2"]],
        [a["bias_1"], a["bias_2"]],
        "layernorm",
        activation_type=("silu", "linear"),
        quantizer_sets=tuple(sets),
    )


def _quantizer_sets(op: str, recipe: str | None):
    n = 2 if op == "layernorm_mlp" else 1
    if recipe is None:
        return [noop_quantizer_set] * n
    sets = QuantizerFactory.create_set(n, fp8_recipe=RECIPES[recipe])
    return list(sets) if n > 1 else [sets]


def _make_step(op: str, stateful: bool):
    """One jitted training step of the op: output, gradients of all arrays, new FP8 state."""

    def loss(arrays, sets, cotangent):
        y = _apply(op, arrays, sets)
        return jnp.sum(y.astype(F32) * cotangent), y

    argnums = (0, 1) if stateful else 0

    @jax.jit
    def step(arrays, sets, cotangent):
        (_, y), grads = jax.value_and_grad(loss, argnums, has_aux=True)(arrays, sets, cotangent)
        # With state, the "gradient" of the quantizer sets is their new state.
        return (y, *grads) if stateful else (y, grads, sets)

    return step


@dataclasses.dataclass
class Run:
    outputs: list  # per step: (y, gradients of the arrays)
    state: object  # the quantizer sets after the last step
    lowered: object  # the last step, lowered for the device


@functools.cache
def _run(op: str, recipe: str | None, device_kind: str) -> Run:
    """``STEPS`` steps of the op on one device, the FP8 state carried from step to step."""
    device = {"accelerator": ACCELERATOR, "cpu": CPU}[device_kind]
    inputs = jax.device_put(_inputs(op), device)
    sets = jax.device_put(_quantizer_sets(op, recipe), device)
    step = _make_step(op, stateful=recipe == "delayed")
    outputs = []
    for factor in INPUT_FACTORS[:STEPS]:
        arrays = dict(inputs["arrays"], x=inputs["arrays"]["x"] * jnp.asarray(factor, jnp.bfloat16))
        y, grads, sets = step(arrays, sets, inputs["cotangent"])
        outputs.append(jax.device_get((y, grads)))
    assert all(d == device for d in y.devices()), (y.devices(), device)
    lowered = step.lower(arrays, sets, inputs["cotangent"])
    return Run(outputs, jax.device_get(sets), lowered)


def _tolerances(recipe: str) -> tuple[float, float]:
    if recipe in BLOCK_FORWARD_TOLERANCE:
        return BLOCK_FORWARD_TOLERANCE[recipe], BLOCK_BACKWARD_TOLERANCE[recipe]
    return FP8_FORWARD_TOLERANCE, FP8_BACKWARD_TOLERANCE


def _assert_within(errors: dict, forward_tol: float, backward_tol: float, what: str, record):
    """The output's error within the forward tolerance, every gradient's within the backward."""
    assert errors["y"] <= forward_tol, (what, "y", record)
    for name, error in errors.items():
        assert name == "y" or error <= backward_tol, (what, name, record)


@pytest.mark.parametrize(("op", "recipe"), CASES)
def test_forward_and_backward_agree_with_the_cpu(op, recipe, record):
    forward_tol, backward_tol = _tolerances(recipe)
    accelerator = _run(op, recipe, "accelerator")
    cpu = _run(op, recipe, "cpu")
    # The same op unquantized, on the CPU: what FP8 approximates on either device.
    unquantized = _run(op, None, "cpu")
    record |= {"op": op, "recipe": recipe, "tolerances": [forward_tol, backward_tol]}
    for step, ((y, grads), (y_cpu, grads_cpu)) in enumerate(
        zip(accelerator.outputs, cpu.outputs, strict=True), 1
    ):
        errors = {"y": relative_error(y, y_cpu)}
        errors |= {f"d{name}": relative_error(g, grads_cpu[name]) for name, g in grads.items()}
        record[f"step_{step}_error_vs_cpu"] = errors
        _assert_within(errors, forward_tol, backward_tol, f"step {step}, GPU vs CPU", record)
    # At the last step (delayed scaling then has real scales) both devices are as close to the
    # unquantized op as FP8 allows.
    y_ref, grads_ref = unquantized.outputs[-1]
    for name, run in (("accelerator", accelerator), ("cpu", cpu)):
        y, grads = run.outputs[-1]
        errors = {"y": relative_error(y, y_ref)}
        errors |= {f"d{key}": relative_error(g, grads_ref[key]) for key, g in grads.items()}
        record[f"{name}_error_vs_unquantized"] = errors
        _assert_within(errors, forward_tol, backward_tol, f"{name} vs unquantized", record)


@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "layernorm_mlp"])
def test_fp8_state_after_three_steps_agrees_with_the_cpu(op, record):
    accelerator = _run(op, "delayed", "accelerator").state
    cpu = _run(op, "delayed", "cpu").state
    record["op"] = op
    for index, (sets, sets_cpu) in enumerate(zip(accelerator, cpu, strict=True)):
        for role, tol in (
            ("x", FP8_FORWARD_TOLERANCE),
            ("kernel", FP8_FORWARD_TOLERANCE),
            ("dgrad", FP8_BACKWARD_TOLERANCE),
        ):
            quantizer, quantizer_cpu = getattr(sets, role), getattr(sets_cpu, role)
            history = np.asarray(quantizer.amax_history)
            history_cpu = np.asarray(quantizer_cpu.amax_history)
            record[f"gemm_{index}_{role}"] = {
                "amax_history": history[:STEPS].tolist(),
                "amax_history_cpu": history_cpu[:STEPS].tolist(),
                "scale_inv": float(quantizer.scale_inv[0]),
                "scale_inv_cpu": float(quantizer_cpu.scale_inv[0]),
            }
            # Three steps recorded, newest first, the rest of the history still empty.
            assert (history_cpu[:STEPS] > 0).all() and (history_cpu[STEPS:] == 0).all()
            what = f"GEMM {index} {role}"
            assert_close(history, history_cpu, tol, f"{what} amax history")
            assert_close(quantizer.scale_inv, quantizer_cpu.scale_inv, tol, f"{what} scale_inv")


@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "layernorm_mlp"])
def test_the_gpu_runs_cublaslt_fp8_gemms(op, record):
    # The training step of the accelerator's agreement test, as the GPU compiled it.
    hlo = _run(op, "delayed", "accelerator").lowered.compile().as_text()
    record |= {
        "op": op,
        "fp8_gemms": hlo.count(FP8_GEMM),
        "other_gemms": len(OTHER_GEMM.findall(hlo)),
        "expected_fp8_gemms": GEMMS_PER_STEP[op],
    }
    if SMOKE:
        pytest.skip("CPU smoke run: XLA:CPU has no cuBLASLt")
    capability = getattr(ACCELERATOR, "compute_capability", "")
    record["compute_capability"] = capability
    if tuple(int(part) for part in capability.split(".")) < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9 or newer; this GPU has {capability}")
    assert record["fp8_gemms"] == GEMMS_PER_STEP[op], record
    assert record["other_gemms"] == 0, record


# ----------------------------------------------------------------------------- the example GPT

TRAIN_STEPS = 10 if SMOKE else 200
LOSS_AGREEMENT = 0.02


def test_example_gpt_trains_as_well_in_fp8_as_in_bf16(tmp_path, record):
    for module in ("omegaconf", "tqdm", "matplotlib", "yaml"):  # the examples extra
        pytest.importorskip(module, reason=f"the example needs {module} (te_flax[examples])")
    from examples.lm.config import DEFAULT_CONFIG, load_config
    from examples.lm.report import write_report
    from examples.lm.train import train
    from tests.test_example_lm import TINY  # the example's test model: a few seconds a run

    out = Path(FIGURES) / "lm" if FIGURES else tmp_path
    overrides = [
        *(TINY if SMOKE else []),
        f"train.steps={TRAIN_STEPS}",
        f"train.eval_every={max(TRAIN_STEPS // 4, 1)}",
        "checkpoint_every=0",
        f"output_dir={out}",
    ]
    # The accelerator is JAX's default device here (first in JAX_PLATFORMS).
    assert jax.devices()[0].platform == ACCELERATOR.platform
    configs = {
        name: load_config(DEFAULT_CONFIG, [*overrides, f"train.recipe={recipe}"])
        for name, recipe in (("fp8", "delayed"), ("bf16", "none"))
    }
    results = [train(config, name, progress=False) for name, config in configs.items()]
    write_report(configs["fp8"], results)
    fp8 = results[0]
    tail = max(TRAIN_STEPS // 10, 1)
    record |= {
        "device": str(jax.devices()[0]),
        "steps": TRAIN_STEPS,
        **{
            f"{r.name}_{key}": value
            for r in results
            for key, value in (
                ("final_eval_loss", r.eval_loss[-1]),
                ("first_eval_loss", r.eval_loss[0]),
                ("final_train_loss", float(np.mean(r.train_loss[-tail:]))),
                ("step_time_ms", 1000 * r.step_time_s),
                ("tokens_per_s", r.tokens_per_s),
            )
        },
    }
    for key in ("final_eval_loss", "final_train_loss"):
        difference = record[f"fp8_{key}"] / record[f"bf16_{key}"] - 1
        record[f"{key}_fp8_vs_bf16"] = difference
        assert abs(difference) <= LOSS_AGREEMENT, (key, record)
    assert np.isfinite(fp8.train_loss).all() and fp8.eval_loss[-1] < 0.9 * fp8.eval_loss[0]


# ----------------------------------------------------------------------------- MoE GEMMs

# Rows sorted by expert, an empty expert, rows past the experts' total; feature sizes the
# grouped GEMM kernels take (multiples of 64, the contraction of 128 bytes).
GROUP_SIZES = (5, 0, 9) if SMOKE else (300, 0, 700, 24)
GROUP_ROWS, GROUP_HIDDEN, GROUP_FEATURES = (16, 128, 128) if SMOKE else (1280, 1024, 2048)


def _grouped_step(recipe: str | None, device_kind: str):
    """One grouped_dense training step on one device: output and gradients (te_flax's grouped
    GEMM kernels on the GPU, XLA's ragged_dot on the CPU)."""
    device = {"accelerator": ACCELERATOR, "cpu": CPU}[device_kind]
    groups = len(GROUP_SIZES)
    keys = jax.random.split(jax.random.key(23), 4)
    with jax.default_device(CPU):
        x = normal(keys[0], (GROUP_ROWS, GROUP_HIDDEN), jnp.bfloat16)
        kernel = normal(keys[1], (groups, GROUP_HIDDEN, GROUP_FEATURES), F32, GROUP_HIDDEN**-0.5)
        bias = normal(keys[2], (groups, GROUP_FEATURES), F32, 0.1)
        cotangent = normal(keys[3], (GROUP_ROWS, GROUP_FEATURES), F32)
        sets = noop_quantizer_set
        if recipe is not None:
            sets = grouped_quantizer_set(
                QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe]), groups
            )
    arrays = jax.device_put((x, kernel, bias, sets, cotangent), device)

    def loss(x, kernel, bias, sets, cotangent):
        sizes = jnp.array(GROUP_SIZES, jnp.int32)
        out = grouped_dense(x, kernel, sizes, bias=bias, quantizer_set=sets)
        return jnp.sum(out.astype(F32) * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = step(*arrays)
    return jax.device_get((out, grads)), step.lower(*arrays)


@pytest.mark.parametrize("recipe", [None, "delayed", "current"], ids=["bf16", "delayed", "current"])
def test_grouped_dense_on_the_gpu_kernels_agrees_with_the_cpu(recipe, record):
    """te_flax's grouped GEMM kernels (Pallas Mosaic GPU, on the GPU) against XLA's ragged_dot
    (on the CPU) on the same inputs: the output and the gradients of x, the kernels and the
    biases, within the FP8 tolerances (bfloat16's without FP8)."""
    (out, grads), lowered = _grouped_step(recipe, "accelerator")
    (out_cpu, grads_cpu), _ = _grouped_step(recipe, "cpu")
    forward_tol, backward_tol = _tolerances(recipe) if recipe else (1e-2, 1e-2)
    errors = {"y": relative_error(out, out_cpu)}
    for name, grad, grad_cpu in zip(("dx", "dkernel", "dbias"), grads, grads_cpu, strict=True):
        errors[name] = relative_error(grad, grad_cpu)
    record |= {"moe_recipe": recipe or "bf16", "errors": errors, "group_sizes": GROUP_SIZES}
    _assert_within(errors, forward_tol, backward_tol, "grouped_dense, GPU vs CPU", record)
    if SMOKE:  # a CPU stands in for the GPU: XLA's ragged_dot on both sides, no kernel
        record["kernel_calls"] = "not checked: CPU smoke run"
        return
    hlo = lowered.compile().as_text()
    record["kernel_calls"] = hlo.count('"mosaic_gpu_v2"')
    assert "te_flax_rows_gemm" in hlo and "te_flax_group_gemm" in hlo, record


# MoEBlock's dropless FP8 step: on a GPU the grouped GEMM kernels and, in the backward, the
# experts' activation gradient quantized in one pass (te_flax_activation_grad_rows).
MOE_TOKENS, MOE_HIDDEN, MOE_FFN = (16, 64, 64) if SMOKE else (1024, 1024, 1024)


def _moe_block_step(device_kind: str):
    """One FP8 training step of a dropless MoEBlock (4 experts, top-2) on one device: its
    output and the gradients of its parameters and input."""
    from te_flax.linen import MoEBlock

    device = {"accelerator": ACCELERATOR, "cpu": CPU}[device_kind]
    layer = MoEBlock(
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_dim=MOE_FFN,
        recipe=RECIPES["delayed"],
    )
    with jax.default_device(CPU):
        x = normal(jax.random.key(29), (MOE_TOKENS, MOE_HIDDEN), jnp.bfloat16)
        variables = layer.init(jax.random.key(0), x)
    variables, x = jax.device_put((variables, x), device)

    def loss(variables, x):
        out, aux = layer.apply(variables, x)
        return jnp.sum(jnp.square(out.astype(F32))) + aux, out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, out), (grads, d_x) = step(variables, x)
    return jax.device_get((out, grads["params"], d_x)), step.lower(variables, x)


def test_moe_block_on_the_gpu_kernels_agrees_with_the_cpu(record):
    """MoEBlock's FP8 step on the GPU (the grouped GEMM kernels, the activation gradient's
    kernel) against the CPU's XLA stages on the same inputs, within the FP8 tolerances."""
    (out, params, d_x), lowered = _moe_block_step("accelerator")
    (out_cpu, params_cpu, d_x_cpu), _ = _moe_block_step("cpu")
    errors = {"y": relative_error(out, out_cpu), "dx": relative_error(d_x, d_x_cpu)}
    for (path, grad), grad_cpu in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_cpu), strict=True
    ):
        errors[jax.tree_util.keystr(path)] = relative_error(grad, grad_cpu)
    record |= {"moe_block_errors": errors}
    _assert_within(errors, *_tolerances("delayed"), "MoEBlock, GPU vs CPU", record)
    if SMOKE:
        return
    hlo = lowered.compile().as_text()
    assert "te_flax_activation_grad_rows" in hlo and "te_flax_rows_gemm" in hlo, record
