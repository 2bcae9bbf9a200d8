"""The Pallas kernels in a deviceless H100 compile: Triton custom calls, FP8 GEMMs unchanged.

One training step (``value_and_grad``) of ``layernorm_dense`` and ``layernorm_mlp`` under
per-tensor FP8, compiled for the H100 of ``data/h100_sxm.gpu_target_config.txtpb``. The
lowering platform is CUDA, so ``"auto"`` (traced as in a process with a GPU, since this host
has none) chooses its kernels (the norm backward, the quantize of each GEMM kernel and the
MLP's activation backward with its quantization), and ``"1"`` every kernel (also the
norm-quantize). The kernels
(``__gpu$xla.gpu.triton`` custom calls) replace XLA fusions; the GEMMs stay 3 (6 for the MLP)
FP8 cuBLASLt calls and no other GEMM appears.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from te_flax._ops.kernels import pallas_kernels
from te_flax._tools.hlo import FP8_GEMM, kernel_names
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, QuantizerFactory
from tests.gpu_target import h100_sharding

pytestmark = [pytest.mark.gpu_compile, pytest.mark.triton_kernels]

TOKENS, HIDDEN, FEATURES = 512, 1024, 2048
TRITON = '"__gpu$xla.gpu.triton"'
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}
# The kernels by their pallas_call name, as they appear in the custom calls' metadata.
NORM_QUANTIZE = "te_flax_norm_quantize"
NORM_BACKWARD = "te_flax_norm_backward"
QUANTIZE = "te_flax_quantize"
ACTIVATION_GRAD = "te_flax_activation_grad"
ACTIVATION_QUANTIZE = "te_flax_activation_quantize"
_F8_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (\(?f8e4m3fn\[[0-9,]*\][^=]*?) (\S+)\(")


@functools.cache
def optimized_hlo(op: str, recipe: str, switch: str) -> str:
    sharding = h100_sharding()

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = {"gamma": spec((HIDDEN,)), "beta": spec((HIDDEN,))}
    if op == "layernorm_dense":
        params["kernel"] = spec((HIDDEN, FEATURES))
        n_sets = 1
    else:
        params["kernels"] = [spec((HIDDEN, 1, FEATURES)), spec((FEATURES, HIDDEN))]
        n_sets = 2
    quantizers = jax.tree.map(
        lambda leaf: spec(leaf.shape, leaf.dtype),
        QuantizerFactory.create_set(n_sets, fp8_recipe=RECIPES[recipe]()),
    )
    x = spec((TOKENS, HIDDEN), jnp.bfloat16)

    def loss(params, quantizers, x):
        if op == "layernorm_dense":
            out = layernorm_dense(
                x, params["kernel"], params["gamma"], params["beta"], quantizer_set=quantizers
            )
        else:
            out = layernorm_mlp(
                x,
                params["gamma"],
                params["beta"],
                params["kernels"],
                [None, None],
                "layernorm",
                quantizer_sets=quantizers,
            )
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    # A CPU host: "auto" chooses the kernels as a process with a GPU does.
    with pallas_kernels(switch, assume_gpu=True):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return step.lower(params, quantizers, x).compile().as_text()


def triton_calls(hlo_text: str) -> list[str]:
    return [line for line in hlo_text.splitlines() if TRITON in line]


def float8_kernel_writers(hlo_text: str) -> list[str]:
    """The opcodes of the entry instructions that write float8 data with as many elements as
    a GEMM kernel (a bitcast or tuple element only renames data)."""
    writers = []
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    for line in entry.splitlines():
        match = _F8_DEFINITION.match(line)
        if match is None or match.group(2) in ("bitcast", "get-tuple-element"):
            continue
        sizes = re.findall(r"f8e4m3fn\[([0-9,]*)\]", match.group(1))
        if any(math.prod(int(d) for d in dims.split(",")) == HIDDEN * FEATURES for dims in sizes):
            writers.append(match.group(2))
    return writers


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("current", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("op", "n_gemms"), [("layernorm_dense", 3), ("layernorm_mlp", 6)])
def test_kernels_replace_fusions_and_keep_fp8_gemms(op, n_gemms, recipe):
    off, auto, every = (optimized_hlo(op, recipe, switch) for switch in ("0", "auto", "1"))
    assert not triton_calls(off)
    # Current scaling needs the amax before it quantizes: two passes of each quantize kernel.
    passes = 1 if recipe == "delayed" else 2
    n_kernels = n_gemms // 3
    chosen = [NORM_BACKWARD] + [QUANTIZE] * (n_kernels * passes)
    if op == "layernorm_mlp":  # the activation and its backward, each with its quantization
        chosen += [ACTIVATION_QUANTIZE, ACTIVATION_GRAD] * passes
    assert kernel_names(auto) == sorted(chosen)
    assert kernel_names(every) == sorted(chosen + [NORM_QUANTIZE] * passes)
    # The GEMM kernels' float8 data in both layouts comes from the quantize kernels alone: no
    # XLA fusion quantizes or transposes it.
    assert "fusion" in float8_kernel_writers(off)
    assert set(float8_kernel_writers(auto)) == {"custom-call"}
    for text in (off, auto, every):
        assert text.count(f'"{FP8_GEMM}"') == n_gemms
        assert not re.search(r'custom_call_target="__cublas\$(gemm|lt\$matmul)"', text)
        assert not re.search(r"\sdot\(", text)
    # The kernels' work leaves XLA: fewer fusions.
    assert every.count(" fusion(") < auto.count(" fusion(") < off.count(" fusion(")
