"""Blockwise FP8 in a deviceless H100 compile: the Pallas GEMM kernel lowers (through Triton on
jax 0.10, Mosaic GPU from jax 0.11 on), and a training step of ``dense`` under
``Float8BlockScaling`` runs its three GEMMs as that kernel under ``"auto"``, or as XLA's exact
form (batched FP8 GEMMs over K's chunks) under ``"0"``."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from te_flax._ops.kernels import pallas_kernels
from te_flax.dense import dense
from te_flax.quantize import Float8BlockScaling, QuantizerFactory
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

TOKENS, HIDDEN, FEATURES = 256, 512, 384
KERNEL_CALLS = ('"__gpu$xla.gpu.triton"', '"mosaic_gpu_v2"')  # Pallas Triton, Mosaic GPU
KERNEL = "te_flax_blockwise_gemm"


@functools.cache
def step_hlo(switch: str) -> str:
    sharding = h100_sharding()
    x = jax.ShapeDtypeStruct((TOKENS, HIDDEN), jnp.bfloat16, sharding=sharding)
    kernel = jax.ShapeDtypeStruct((HIDDEN, FEATURES), jnp.float32, sharding=sharding)
    quantizers = QuantizerFactory.create_set(fp8_recipe=Float8BlockScaling())

    def loss(x, kernel):
        out = dense(x, kernel, None, quantizer_set=quantizers)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    with pallas_kernels(switch, assume_gpu=True):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return step.lower(x, kernel).compile().as_text()


def test_kernel_lowers_for_every_gemm_of_a_step():
    auto = step_hlo("auto")
    calls = [line for line in auto.splitlines() if any(call in line for call in KERNEL_CALLS)]
    assert len([line for line in calls if KERNEL in line]) == 3  # fprop, dgrad, wgrad
    # No GEMM is left to XLA: the float8 products are the kernel's.
    assert not re.search(r'custom_call_target="__cublas\$(gemm|lt\$matmul)', auto)


def test_exact_path_runs_batched_fp8_gemms():
    exact = step_hlo("0")
    assert KERNEL not in exact
    # One batched FP8 GEMM over K's 128-wide chunks per GEMM of the step.
    assert exact.count('"__cublas$lt$matmul$f8"') == 3
