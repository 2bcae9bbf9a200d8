"""The example GPT's scanned, rematerialized FP8 training step on XLA:GPU (deviceless H100).

``bench.model.compile_gpt_step`` compiles the example's ``train_step`` (te_flax's
``value_and_grad``, AdamW through ``apply_gradients``) for the H100 of ``tests/gpu_target.py``
with its blocks under ``nn.scan`` and each under ``nn.remat``, written with te_flax's layers or
with Flax's own FP8 ops (``bench.flax_model.FlaxBlock``). ``bench.model.modelled`` counts the
GEMMs the step executes: a scanned body's once per layer.

Per layer a step runs 15 FP8 GEMMs: the four projections forward (QKV, output, MLP in, MLP
out), three of them again in the backward loop's recomputation (the MLP's output projection is
not recomputed: its result only feeds the residual sum), and dgrad and wgrad of each (8). The
three other GEMMs are the tied byte embedding's output projection (forward, dgrad, wgrad),
which the example keeps in higher precision. cuDNN's fused attention runs three times per
layer: forward, recomputed forward, backward.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from bench.model import compile_gpt_step, modelled
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

HIDDEN = 256  # two 128-wide heads, MLP 1024


@functools.cache
def _step(impl: str, layers: int, remat: str) -> str:
    """The step's optimized HLO, compiled once per process: both tests read te_flax's
    two-layer rematerialized step."""
    hlo_text, _ = compile_gpt_step(HIDDEN, True, impl, layers=layers, remat=remat, batch=2, seq=128)
    return hlo_text


@pytest.mark.parametrize(("impl", "layers"), [("te_flax", 2), ("flax", 3)])
def test_scanned_remat_step_runs_every_projection_gemm_in_fp8(impl, layers):
    h100_sharding()  # asserts the deviceless compile's XLA flags
    # Flax's own nn.LayerNorm promotes bf16 with float32 implicitly (refused by the suite's
    # strict promotion); te_flax's layers run under it.
    promotion = "standard" if impl == "flax" else "strict"
    with jax.numpy_dtype_promotion(promotion):
        hlo_text = _step(impl, layers, "on")
    figures = modelled(hlo_text, HIDDEN)
    counts = {k: figures[k] for k in ("fp8_gemms", "gemms", "attention_calls")}
    assert counts == {
        "fp8_gemms": 15 * layers,
        "gemms": 15 * layers + 3,
        "attention_calls": 3 * layers,
    }, counts
    # te_flax's Pallas kernels run at every JAX of the range: Triton's before jax 0.11, Mosaic
    # GPU's from jax 0.11 on.
    kernels = impl == "te_flax"
    assert (figures["kernels"] > 0) == kernels, figures["kernels"]


_SLICE_COPY = re.compile(
    r"^\s*%\S+ = f32\[([\d,]+)\]\S* fusion\(.*calls=%fused_dynamic_slice\b", re.M
)
_STACK_TRANSPOSE = re.compile(
    r"^\s*%\S+ = f32\[[\d,]+\]\S* fusion\(%\S*params\S*\).*transpose", re.M
)


@pytest.mark.parametrize("remat", ["on", "off"])
def test_scanned_kernels_are_quantized_without_copying_their_slices(remat):
    # A scanned layer's kernel is a dynamic-slice of its stacked parameter: a Pallas kernel
    # would take a copy of it (8 bytes per element) and a transposing cast would have XLA
    # transpose the whole float32 stack before the loop. The ops quantize it in the XLA stage,
    # which reads the slice in place, its float8 data pinned to row-major.
    h100_sharding()
    hlo_text = _step("te_flax", 2, remat)
    copies = [shape for shape in _SLICE_COPY.findall(hlo_text) if _elements(shape) >= HIDDEN**2]
    assert copies == [], copies
    assert _STACK_TRANSPOSE.findall(hlo_text) == []
    assert modelled(hlo_text, HIDDEN)["fp8_gemms"] == (15 if remat == "on" else 12) * 2


def _elements(shape: str) -> int:
    return math.prod(int(d) for d in shape.split(","))
