"""quantize_model against its peers on a stock Flax MLP: one training step compiled for an H100.

A Llama-70B-shaped SwiGLU MLP with its norm (4096 tokens, hidden 8192, intermediate 28672),
written with Flax's own layers (``bench.models.FlaxLayerNormMLP``), trained by one step in:

- BF16: the stock model as it is;
- ``te_flax.quantize_model``: the stock model, one call, DelayedScaling;
- Qwix's FP8 QT (``qwix.quantize_model`` with a ``QtProvider``, e4m3 forward, e5m2 backward),
  when qwix is installed (``pip install -e '.[bench-qwix]'``);
- the model rewritten with te_flax's ``LayerNormMLP`` (DelayedScaling).

Each step is compiled deviceless for the H100 (``bench.h100``): FP8 and other GEMMs, the bytes
XLA's cost analysis counts, and a modelled step time (a roofline per GEMM plus the non-GEMM
bytes at HBM bandwidth; a model, not a measurement). Writes bench/RESULTS_quantize_model.md.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
        python -m bench.quantize_model
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import h100
from bench.models import (
    ACTIVATION_DTYPE,
    AMAX_HISTORY_LEN,
    Candidate,
    Case,
    FlaxLayerNormMLP,
    _te_model,
    make_grad_step,
)
from te_flax._tools.hlo import FP8_GEMM, parse_gemms
from te_flax.quantize import DelayedScaling

CASE = Case("LayerNormMLP", 1, 4096, 8192, 28672, ("silu", "linear"))
# H100 SXM: dense FP8 and BF16 tensor-core peaks and HBM3 bandwidth (public datasheet figures).
PEAK_FLOPS = {"fp8": 1979e12, "bf16": 989e12}
HBM_BYTES_PER_S = 3.35e12
RESULTS = Path(__file__).parent / "RESULTS_quantize_model.md"


def _abstract_x() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((CASE.batch, CASE.seq, CASE.hidden), ACTIVATION_DTYPE)


def _candidate(impl: str, model, apply=None) -> Candidate:
    x = _abstract_x()
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    return Candidate(impl, "delayed", CASE, apply or model.apply, variables, x)


def candidates() -> dict[str, Candidate]:
    import te_flax

    stock = FlaxLayerNormMLP(CASE.features, CASE.activations, fp8=False)
    recipe = DelayedScaling(amax_history_len=AMAX_HISTORY_LEN)
    te_model = _te_model(CASE, "delayed")
    found = {
        "BF16 (stock model)": _candidate("bf16", stock),
        "te_flax.quantize_model": _candidate(
            "quantize_model", te_flax.quantize_model(stock, recipe, _abstract_x())
        ),
        "te_flax LayerNormMLP (rewritten)": _candidate(
            "te_flax", te_model, lambda v, x: te_model.apply(v, x)[0]
        ),
    }
    try:
        import qwix
    except ImportError:
        print("qwix is not installed: its row is left out", file=sys.stderr)
        return found
    rule = qwix.QtRule(
        module_path=".*",
        weight_qtype=jnp.float8_e4m3fn,
        act_qtype=jnp.float8_e4m3fn,
        bwd_qtype=jnp.float8_e5m2,
    )
    found["Qwix FP8 QT"] = _candidate("qwix", qwix.quantize_model(stock, qwix.QtProvider([rule])))
    return found


def modelled_ms(hlo_text: str, total_bytes: float) -> float:
    """A roofline model of the step: each GEMM at its peak or its bytes' HBM time, whichever is
    longer, plus every other byte at HBM bandwidth."""
    gemm_seconds, gemm_bytes = 0.0, 0.0
    for gemm in parse_gemms(hlo_text):
        peak = PEAK_FLOPS["fp8" if gemm.target == FP8_GEMM else "bf16"]
        gemm_seconds += max(gemm.flops / peak, gemm.bytes / HBM_BYTES_PER_S)
        gemm_bytes += gemm.bytes
    return 1e3 * (gemm_seconds + max(total_bytes - gemm_bytes, 0.0) / HBM_BYTES_PER_S)


def _compiled(candidate: Candidate):
    """One training step of ``candidate`` compiled for the H100 (te_flax's kernels as for a GPU)."""
    from te_flax._ops.kernels import pallas_kernels

    sharding = h100._sharding()

    def spec(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    with pallas_kernels("auto", assume_gpu=True), jax.numpy_dtype_promotion("standard"):
        step = jax.jit(make_grad_step(candidate))
        lowered = step.lower(jax.tree.map(spec, candidate.variables), spec(candidate.x))
    return lowered.compile()


def measure() -> list[dict]:
    rows = []
    for label, candidate in candidates().items():
        start = time.perf_counter()
        compiled = _compiled(candidate)
        text = compiled.as_text()
        cost = h100.cost(compiled)
        rows.append(
            {
                "label": label,
                **h100.count_gemms(text),
                "gb": cost["bytes"] / 1e9,
                "ms": modelled_ms(text, cost["bytes"]),
                "compile_s": time.perf_counter() - start,
            }
        )
        print(rows[-1], file=sys.stderr)
    return rows


def report(rows: list[dict], command: str) -> str:
    lines = [
        "# quantize_model against its peers (deviceless H100, one training step)",
        "",
        f"A stock Flax SwiGLU MLP with its norm, {CASE.tokens} tokens, hidden {CASE.hidden}, "
        f"intermediate {CASE.features}, bfloat16 activations; DelayedScaling for te_flax. "
        "Bytes: XLA's cost analysis of the optimized H100 program (GEMMs counted from the HLO). "
        "Step time: a roofline model (each GEMM at the H100's dense FP8 or BF16 peak or at HBM "
        "bandwidth, the rest of the bytes at 3.35 TB/s), not a measurement.",
        "",
        "| step | FP8 GEMMs | other GEMMs | HBM GB | modelled ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['label']} | {r['fp8_gemms']} | {r['other_gemms']} | {r['gb']:.1f} | {r['ms']:.1f} |"
        for r in rows
    ]
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main() -> None:
    reason = h100.available()
    if reason:
        sys.exit(f"bench.quantize_model needs the deviceless H100 compile: {reason}")
    rows = measure()
    command = (
        "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false "
        "python -m bench.quantize_model"
    )
    RESULTS.write_text(report(rows, command))
    print(RESULTS.read_text())


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
