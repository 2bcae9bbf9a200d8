"""Scale granularity of an FP8 MoE layer: one scale per expert against one shared by all experts.

``python -m bench.moe_scales`` quantizes the three GEMMs of one expert layer (forward, dgrad,
wgrad; x and the kernels e4m3, the output gradient e5m2) with current scaling two ways: each
expert's rows and kernel with their own amax, or x and the gradient with one amax over all rows
(kernels per expert in both). The experts' inputs differ in magnitude as routed tokens do (a few
experts see tokens far larger or smaller than the rest). It prints each GEMM's relative error
against float32, for the expert with the smallest inputs and over all experts, and writes
``bench/RESULTS_moe_scales.md``.

Bytes do not decide between the two: te_flax's grouped GEMM kernels apply the per-group scale
product to the float32 accumulator before writing it, so per-expert scales add no pass in any
GEMM (``te_flax/_ops/kernels/grouped_gemm.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax import lax

from te_flax.quantize import scaling

RESULTS = Path(__file__).with_name("RESULTS_moe_scales.md")
ROWS_PER_EXPERT, HIDDEN, FEATURES = 256, 512, 512
EXPERTS = 8
# Expert 0's input magnitude against the others' (1; one expert at 10): how far apart the
# experts' inputs may be before one shared scale costs the small one precision.
SMALL = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5)


def _quantized(x: jax.Array, amax: jax.Array, dtype) -> jax.Array:
    """``x`` through float8 with the scale of ``amax`` (broadcast against x), back in float32."""
    scale_inv = scaling.compute_scale_inv(amax, dtype, 0.0, jnp.ones_like(amax))
    return scaling.quantize(x, dtype, scale_inv).astype(jnp.float32) * scale_inv


def _per_expert_amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)), keepdims=True)


def _gemms(x, kernel, grad):
    """Forward, dgrad and wgrad of every expert: ``[E, R, N]``, ``[E, R, K]``, ``[E, K, N]``."""
    return (
        jnp.einsum("erk,ekn->ern", x, kernel, precision=lax.Precision.HIGHEST),
        jnp.einsum("ern,ekn->erk", grad, kernel, precision=lax.Precision.HIGHEST),
        jnp.einsum("erk,ern->ekn", x, grad, precision=lax.Precision.HIGHEST),
    )


def _errors(granularity: str, x, kernel, grad) -> dict[str, tuple[float, float]]:
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    shared = granularity == "shared"
    x_amax = jnp.max(jnp.abs(x)) if shared else _per_expert_amax(x)
    g_amax = jnp.max(jnp.abs(grad)) if shared else _per_expert_amax(grad)
    quantized = (
        _quantized(x, x_amax, e4m3),
        _quantized(kernel, _per_expert_amax(kernel), e4m3),
        _quantized(grad, g_amax, e5m2),
    )
    errors = {}
    for name, exact, approx in zip(
        ("forward", "dgrad", "wgrad"), _gemms(x, kernel, grad), _gemms(*quantized), strict=True
    ):
        per_expert = jnp.linalg.norm((approx - exact).reshape(EXPERTS, -1), axis=1)
        per_expert = per_expert / jnp.linalg.norm(exact.reshape(EXPERTS, -1), axis=1)
        errors[name] = (float(per_expert[0]), float(jnp.max(per_expert)))
    return errors


def _case(small: float):
    keys = jax.random.split(jax.random.key(0), 3)
    magnitude = jnp.array([small] + [1.0] * (EXPERTS - 2) + [10.0])[:, None, None]
    x = jax.random.normal(keys[0], (EXPERTS, ROWS_PER_EXPERT, HIDDEN)) * magnitude
    kernel = jax.random.normal(keys[1], (EXPERTS, HIDDEN, FEATURES)) * HIDDEN**-0.5
    # The output gradient follows the output's magnitude: the hardest case for a shared
    # gradient scale.
    grad = jax.random.normal(keys[2], (EXPERTS, ROWS_PER_EXPERT, FEATURES)) * magnitude
    return x, kernel, grad


def main() -> None:
    lines = [
        "# FP8 MoE scale granularity: per expert against shared across experts",
        "",
        "Produced by `JAX_PLATFORMS=cpu python -m bench.moe_scales` (see its docstring). "
        f"{EXPERTS} experts of {ROWS_PER_EXPERT} rows, hidden {HIDDEN}, {FEATURES} features; "
        "expert 0's inputs (and output gradients) `small` times the others' (1; the last "
        "expert's 10); current scaling, e4m3 x and kernels, e5m2 output gradients, kernels "
        "scaled per expert in both rows. Relative error (Frobenius) of each GEMM's result "
        "against float32 for expert 0; the other experts' errors are those of the first row.",
        "",
        "| small | forward, per expert | forward, shared | dgrad, per expert | dgrad, shared "
        "| wgrad, per expert | wgrad, shared |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for small in SMALL:
        case = _case(small)
        own, shared = _errors("per expert", *case), _errors("shared", *case)
        cells = [f"{own[g][0]:.4f} | {shared[g][0]:.4f}" for g in ("forward", "dgrad", "wgrad")]
        lines.append(f"| {small:g} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if "--no-write" not in sys.argv:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
