"""Each kernel configuration checked against its XLA stage on its first use.

On a GPU the first trace of each kernel configuration in a process runs it once on a small
problem beside its XLA stage; a disagreement warns once and hands that configuration to the
XLA stage. Here, without a GPU, ``kernel_checks("1")`` makes the same check in Mosaic GPU's
interpret mode (jax 0.11 and newer): every probe agrees with its XLA stage where the kernel is
right, and a kernel forced to be wrong (or to fail) is caught, reported once, and not used.
"""

from __future__ import annotations

import contextlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_flax.linen as te_nn
from te_flax._base.jax_compat import mosaic_gpu_interpreted
from te_flax._ops import grouped_kernels
from te_flax._ops.kernels import first_use, pallas_kernels
from te_flax._ops.kernels.first_use import KernelCheckWarning, checked, kernel_checks
from te_flax.dense import grouped_dense, grouped_quantizer_set
from te_flax.quantize import DelayedScaling, Float8BlockScaling, QuantizerFactory

interpreted = pytest.mark.skipif(
    not mosaic_gpu_interpreted(), reason="Mosaic GPU's interpret mode needs jax 0.11 or newer"
)
ROWS, HIDDEN, FEATURES, GROUPS = 128, 128, 256, 3
SIZES = (50, 0, 70)


@pytest.fixture(autouse=True)
def _fresh_process():
    """Every test starts as a new process would: no configuration checked yet."""
    first_use.forget()
    yield
    first_use.forget()


def _grouped_step(switch: str, checks: str | None):
    """A delayed-scaling grouped_dense training step traced and run under ``switch`` and
    ``checks`` (None: ``TE_FLAX_KERNEL_CHECK``); its results and the KernelCheckWarnings it
    gave."""
    x = jax.random.normal(jax.random.key(0), (ROWS, HIDDEN), jnp.bfloat16)
    kernel = jax.random.normal(jax.random.key(1), (GROUPS, HIDDEN, FEATURES)) * HIDDEN**-0.5
    recipe_set = QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))
    state = grouped_quantizer_set(recipe_set, GROUPS)

    def loss(x, kernel):
        out = grouped_dense(x, kernel, jnp.array(SIZES, jnp.int32), quantizer_set=state)
        return jnp.sum(jnp.square(out.astype(jnp.float32))), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    checking = contextlib.nullcontext() if checks is None else kernel_checks(checks)
    with pallas_kernels(switch), checking, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        (_, out), grads = step(x, kernel)
    return (out, *grads), [c for c in w if issubclass(c.category, KernelCheckWarning)]


def _wrong_rows_gemm(monkeypatch):
    """The forward GEMM's and dgrad's kernel, off by a factor of 2 (a wrong tile, say)."""
    right = grouped_kernels.rows_gemm
    monkeypatch.setattr(grouped_kernels, "rows_gemm", lambda *a, **k: 2 * right(*a, **k))


@interpreted
def test_every_grouped_gemm_configuration_agrees_with_its_xla_stage():
    _, caught = _grouped_step("1", "1")
    assert caught == []
    verdicts = {configuration: v for (name, configuration), v in checked().items()}
    assert sorted(c.split()[0] for c in verdicts) == ["dgrad", "forward", "wgrad"], verdicts
    assert set(verdicts.values()) == {None}


@interpreted
def test_a_wrong_kernel_is_reported_once_and_the_xla_stage_runs(monkeypatch):
    expected, _ = _grouped_step("0", "1")
    _wrong_rows_gemm(monkeypatch)
    results, caught = _grouped_step("1", "1")
    # The forward GEMM and dgrad disagree (wgrad's kernel is another): one warning each,
    # naming the kernel, the configuration and how far off it was.
    assert len(caught) == 2, [str(c.message) for c in caught]
    for warning, role in zip(caught, ("forward", "dgrad"), strict=True):
        message = str(warning.message)
        assert message.startswith("te_flax's grouped_gemm kernel disagrees with its XLA stage")
        assert f"configuration {role} " in message and "off by" in message, message
        assert "TE_FLAX_KERNEL_CHECK=0" in message
    # Those two GEMMs ran on the XLA stage: the step is right.
    for actual, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2)  # fmt: skip
    # Once per process: traced again, the configurations are not checked again.
    _, again = _grouped_step("1", "1")
    assert again == []


@interpreted
def test_a_kernel_that_fails_is_a_disagreement(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Mosaic GPU lowering failed: no layout for this tile")

    monkeypatch.setattr(grouped_kernels, "group_gemm", broken)
    _, caught = _grouped_step("1", "1")
    (warning,) = caught
    assert "configuration wgrad" in str(warning.message)
    assert "RuntimeError: Mosaic GPU lowering failed" in str(warning.message)


@interpreted
@pytest.mark.parametrize("opt_out", ["context", "environment"])
def test_the_check_can_be_turned_off(opt_out, monkeypatch):
    expected, _ = _grouped_step("0", "1")
    _wrong_rows_gemm(monkeypatch)
    if opt_out == "environment":
        monkeypatch.setenv(first_use.ENV_VAR, "0")
        results, caught = _grouped_step("1", None)
    else:
        results, caught = _grouped_step("1", "0")
    # Unchecked, the wrong kernel runs: nothing was checked, and the output is twice XLA's.
    assert caught == [] and checked() == {}
    np.testing.assert_allclose(results[0].astype(jnp.float32), 2 * expected[0].astype(jnp.float32),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_off_a_gpu_auto_checks_nothing(monkeypatch):
    _wrong_rows_gemm(monkeypatch)
    assert first_use.check_mode() == "auto"
    _, caught = _grouped_step("1", "auto")
    assert caught == [] and checked() == {}


def test_the_mode_is_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"kernel_checks\(value\) must be one of auto, 0, 1"):
        kernel_checks("sometimes").__enter__()
    monkeypatch.setenv(first_use.ENV_VAR, "always")
    with pytest.raises(ValueError, match=r"TE_FLAX_KERNEL_CHECK must be one of auto, 0, 1"):
        first_use.check_mode()


@interpreted
@pytest.mark.parametrize(
    ("layer", "kernels"),
    [
        ("LayerNormMLP", {"quantize", "activation_quantize", "activation_grad", "norm_backward"}),
        ("DenseGeneral", {"blockwise_gemm"}),
    ],
)
def test_the_elementwise_and_blockwise_probes_agree_with_their_xla_stages(layer, kernels):
    """The probes of the other kernels take the XLA stage's arithmetic as their reference: a
    kernel that is right must agree with it, or a GPU would drop a good kernel."""
    if layer == "LayerNormMLP":
        module = te_nn.LayerNormMLP(
            intermediate_dim=256, activations=("silu", "linear"), recipe=DelayedScaling(),
            dtype=jnp.bfloat16,
        )  # fmt: skip
    else:
        module = te_nn.DenseGeneral(features=256, recipe=Float8BlockScaling(), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (2, 64, 128), jnp.bfloat16)
    variables = nn.unbox(module.init(jax.random.key(1), x))

    def loss(variables, x):
        y = module.apply(variables, x)
        return jnp.mean(jnp.square((y[0] if isinstance(y, tuple) else y).astype(jnp.float32)))

    with pallas_kernels("1"), kernel_checks("1"), warnings.catch_warnings():
        warnings.simplefilter("error", KernelCheckWarning)
        jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)
    assert {name for name, _ in checked()} == kernels
    assert set(checked().values()) == {None}
