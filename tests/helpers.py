"""Shared test helpers: independent pure-JAX references, input makers and tolerances.

The references are written from the maths, not from te_flax's code: unfused float32 norms and
GEMMs, and a fake-quant variant that applies quantize-dequantize with given scales.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# Elementwise tolerance relative to the RMS of the expected value, per compute dtype.
# float16 keeps 3 more mantissa bits than bfloat16 (10 against 7).
TOLERANCE = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.bfloat16): 2**-6,
    jnp.dtype(jnp.float16): 2**-9,
}
# Normwise relative error allowed for FP8 against the unquantized result. e4m3 keeps 3 mantissa
# bits (about 3.6% RMS rounding error per element), e5m2 2 bits (about 7%).
FP8_FORWARD_TOLERANCE = 0.08
FP8_BACKWARD_TOLERANCE = 0.15
# Normwise error of a sharded FP8 step against the single-device one, where float32 sums run in
# another order before a quantization (attention, norms of a multi-layer stack): a last-bit
# difference can move an element to the neighbouring float8 value. Measured at most 1.1e-3 for
# a 2-layer TransformerLayer stack; a sharding mistake (a missing reduction) is of order 1.
SHARDED_FP8_TOLERANCE = 1e-2
# Normwise error against the unquantized op. MXFP8 keeps e4m3's 3 mantissa bits with exact
# power-of-two block scales (about 3.6% per GEMM, as per-tensor FP8), so FP8's tolerances apply.
# e2m1 has one mantissa bit (about 13% per GEMM); the MLP's output passes two NVFP4 GEMMs and its
# gradients up to four (measured at most 0.23 forward and 0.30 backward with SwiGLU).
BLOCK_FORWARD_TOLERANCE = {"mxfp8": FP8_FORWARD_TOLERANCE, "nvfp4": 0.3}
BLOCK_BACKWARD_TOLERANCE = {"mxfp8": FP8_BACKWARD_TOLERANCE, "nvfp4": 0.4}


def tolerance(dtype) -> float:
    return TOLERANCE[jnp.dtype(dtype)]


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    """``|actual - expected| <= tol * (|expected| + rms(expected))`` elementwise."""
    actual = np.asarray(jnp.asarray(actual, F32))
    expected = np.asarray(jnp.asarray(expected, F32))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(np.sqrt(np.mean(np.square(expected)))) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


# XLA's own optimization level for the code it emits, as users compile. The suite compiles at
# level 0 (tests/conftest.py); a test that asserts two different programs agree bit for bit
# compiles both at this level, since whether two roundings coincide depends on the code
# generator (level 0 contracts no multiply-add into an FMA).
USERS_OPTIMIZATION = {"xla_backend_optimization_level": 2}


def xla_flags(devices: int) -> str:
    """The test run's ``XLA_FLAGS`` (tests/conftest.py) for a subprocess with ``devices`` CPU
    devices instead of eight."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ["XLA_FLAGS"])
    return f"{flags.strip()} --xla_force_host_platform_device_count={devices}"


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float32."""
    actual, expected = jnp.asarray(actual, F32), jnp.asarray(expected, F32)
    return float(jnp.linalg.norm(actual - expected) / jnp.linalg.norm(expected))


def assert_tree_close(actual, expected, tol: float) -> None:
    paths_a, _ = jax.tree_util.tree_flatten_with_path(actual)
    paths_e, _ = jax.tree_util.tree_flatten_with_path(expected)
    assert [p for p, _ in paths_a] == [p for p, _ in paths_e]
    for (path, a), (_, e) in zip(paths_a, paths_e, strict=True):
        assert_close(a, e, tol, jax.tree_util.keystr(path))


def normal(key, shape, dtype=F32, scale=1.0):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


# ----------------------------------------------------------------------------- references


def reference_norm(x, gamma, beta, norm_type="layernorm", zero_centered_gamma=False, eps=1e-6):
    """Unfused float32 layernorm / rmsnorm over the last axis."""
    x = x.astype(F32)
    if norm_type == "layernorm":
        x = (x - jnp.mean(x, -1, keepdims=True)) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + eps)
    else:
        x = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
    scale = gamma.astype(F32) + (1.0 if zero_centered_gamma else 0.0)
    y = x * jnp.broadcast_to(scale, x.shape)
    return y if beta is None else y + jnp.broadcast_to(beta.astype(F32), x.shape)


def reference_dense(x, kernel, bias=None, n_contract=1):
    """``x . kernel + bias`` in float32 with HIGHEST precision."""
    out = jnp.tensordot(x.astype(F32), kernel.astype(F32), axes=n_contract, precision=HIGHEST)
    return out if bias is None else out + jnp.broadcast_to(bias.astype(F32), out.shape)


def fake_quant(x, scale_inv, dtype):
    """Quantize-dequantize in float32 with a fixed scale, saturating at the format's max."""
    limit = float(jnp.finfo(dtype).max)
    q = jnp.clip(x.astype(F32) / scale_inv, -limit, limit).astype(dtype)
    return q.astype(F32) * scale_inv


def _fake_quant_or_current(x, scale_inv, dtype):
    """``fake_quant`` with the given scale, or with x's own (current) scale for None."""
    return fake_quant(x, current_scale(x, dtype) if scale_inv is None else scale_inv, dtype)


def straight_through_fake_quant(x, scale_inv, dtype):
    """Quantize-dequantize forward (current scaling for ``scale_inv=None``), identity backward."""
    return x + lax.stop_gradient(_fake_quant_or_current(x, scale_inv, dtype) - x)


def grad_fake_quant(scale_inv, dtype):
    """The identity forward; quantize-dequantize of the incoming gradient backward (with the
    gradient's own current scale for ``scale_inv=None``)."""

    @jax.custom_vjp
    def identity(y):
        return y

    identity.defvjp(
        lambda y: (y, None), lambda _, g: (_fake_quant_or_current(g, scale_inv, dtype),)
    )
    return identity


def current_scale(x, dtype):
    """The current-scaling ``scale_inv`` of x: ``amax / fp8_max`` (1 for an all-zero x)."""
    amax = jnp.max(jnp.abs(x.astype(F32)))
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def amax_of(x):
    return jnp.max(jnp.abs(x.astype(F32)))


# ----------------------------------------------------------------------------- FP8 state


_ROLE_FP8_MAX = {"x": 448.0, "kernel": 448.0, "grad": 57344.0}  # e4m3, e4m3, e5m2 (HYBRID)
# ``scale_inv = amax * (1 / fp8_max)`` rounds twice in float32: within 2**-22 of amax / fp8_max.
_SCALE_RTOL = 2.0**-22


def assert_delayed_step(old: dict, new: dict, postfix: str, amaxes: dict) -> None:
    """``new`` is ``old`` (FP8 variables by name) after one delayed-scaling step (margin 0).

    ``amaxes`` maps a role (``"x"``, ``"kernel"``, ``"grad"``) to ``(amax, rtol)``: the amax of
    that step's tensor, which must be the history's newest entry. Roles not in it are checked
    for the shift and the scale only.
    """
    for role, fp8_max in _ROLE_FP8_MAX.items():
        name = f"{role}{postfix}"
        old_history = np.asarray(old[f"{name}_amax_history"])
        history = np.asarray(new[f"{name}_amax_history"])
        scale_inv = np.asarray(new[f"{name}_scale_inv"])
        assert history.shape == old_history.shape and scale_inv.shape == (1,), name
        # Every entry moves one slot older; the oldest drops out.
        np.testing.assert_array_equal(history[1:], old_history[:-1], err_msg=name)
        assert history[0] > 0, name
        if role in amaxes:
            amax, rtol = amaxes[role]
            np.testing.assert_allclose(history[0], amax, rtol=rtol, err_msg=name)
        # The scale the next step uses: the history's max over the format's max.
        np.testing.assert_allclose(scale_inv, [history.max() / fp8_max], rtol=_SCALE_RTOL)


# The example GPT at test size (``examples.lm`` config overrides): the model, then the training
# settings the example tests share.
TINY_LM_MODEL = [
    "model.d_model=32",
    "model.heads=2",
    "model.head_dim=16",
    "model.layers=2",
    "model.mlp_dim=64",
]
TINY_LM = [
    *TINY_LM_MODEL,
    "train.batch=8",
    "train.seq_len=32",
    "train.learning_rate=1e-2",
    "train.warmup_steps=2",
    "train.eval_batches=2",
    "train.amax_history_len=4",
    # No FP8-health steps (a second compiled program) unless a test asks for them.
    "train.fp8_stats_every=0",
]
