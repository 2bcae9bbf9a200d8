"""Model-level figures: a TransformerLayer training step compiled deviceless for an H100.

``JAX_PLATFORMS=cpu python -m bench.model`` compiles one training step (``value_and_grad`` of a
Linen ``TransformerLayer``, bf16 compute, float32 parameters, causal self-attention) with XLA's
real GPU compiler for the H100 SXM target of the test suite, in FP8 (delayed scaling, te_flax's
Pallas kernels as a GPU process chooses them) and in BF16, at hidden 4096 and 8192, and writes
``bench/RESULTS_model.md``: the FP8 GEMMs among all GEMMs, the attention lowering, the bytes the
program moves and a **modelled** step time.

The model, not a measurement: each instruction of the compiled program costs
``max(FLOPs / peak, bytes / bandwidth)`` with H100 SXM's public peaks (989 TFLOP/s dense BF16,
1979 TFLOP/s dense FP8, 3.35 TB/s HBM3), the GEMMs' FLOPs from their shapes, every other
instruction's bytes as XLA's cost analysis counts a fusion's (operands read once, result written
once); the sum is the modelled step time. It ignores launch overheads, overlap and the GEMMs'
real efficiency, so it says where the time would go, not what a GPU measures.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import argparse  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench.h100 import _sharding, available  # noqa: E402
from te_flax._hlo import (  # noqa: E402
    FP8_GEMM,
    entry_rows,
    fused_attention_calls,
    gemms_left_to_fusions,
    kernel_names,
    parse_gemms,
)
from te_flax._kernels import pallas_kernels  # noqa: E402
from te_flax.quantize import DelayedScaling  # noqa: E402
from te_flax.training import merge_fp8_state  # noqa: E402

# H100 SXM public peaks (dense, no sparsity).
PEAK_BF16 = 989e12  # FLOP/s
PEAK_FP8 = 1979e12  # FLOP/s
BANDWIDTH = 3.35e12  # bytes/s
OUT = Path(__file__).parent / "RESULTS_model.md"
HIDDEN_SIZES = (4096, 8192)
BATCH, SEQ = 2, 2048  # 4096 tokens per step


def _layer(hidden: int, fp8: bool, implementation: str | None) -> te_nn.TransformerLayer:
    return te_nn.TransformerLayer(
        hidden_size=hidden,
        mlp_hidden_size=4 * hidden,
        num_attention_heads=hidden // 128,
        self_attn_mask_type="causal",
        enable_relative_embedding=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        dtype=jnp.bfloat16,
        recipe=DelayedScaling() if fp8 else None,
        implementation=implementation,
    )


def compile_step(hidden: int, fp8: bool, implementation: str | None = "xla") -> tuple[str, float]:
    """The optimized H100 HLO of one training step, and its trace + compile seconds."""
    sharding = _sharding()
    layer = _layer(hidden, fp8, implementation)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, hidden), jnp.bfloat16, sharding=sharding)

    def loss(variables, x):
        out = layer.apply(merge_fp8_state(variables), x, deterministic=True)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    init = lambda x: layer.init(jax.random.key(0), x, deterministic=True)  # noqa: E731
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        nn.meta.unbox(jax.eval_shape(init, x)),
    )
    start = time.perf_counter()
    # The deviceless compile runs on a CPU host: "auto" traces as a GPU process would.
    with pallas_kernels("auto", assume_gpu=True):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x)
    hlo_text = lowered.compile().as_text()
    return hlo_text, time.perf_counter() - start


def attention_flops(hidden: int, backward: bool) -> float:
    """FLOPs of cuDNN's causal flash attention in this step: ``Q.K^T`` and ``P.V`` forward (2
    GEMMs); the backward recomputes the scores and adds dV, dP, dQ, dK (5 GEMMs); each
    ``2 * batch * seq^2 * hidden``, halved by the causal mask."""
    gemms = 5 if backward else 2
    return gemms * 2 * BATCH * SEQ * SEQ * hidden * 0.5


def modelled(hlo_text: str, hidden: int) -> dict:
    """GEMM counts, bytes and the modelled time of one compiled step (see the module doc)."""
    gemms = {gemm.name: gemm for gemm in parse_gemms(hlo_text)}
    rows = entry_rows(hlo_text)
    by_kind: dict[str, float] = defaultdict(float)
    total = 0.0
    for row in rows:
        gemm = gemms.get(row["name"])
        flops = gemm.flops if gemm else 0
        if row["instruction"].startswith("GEMM __cudnn$fmha"):
            flops = attention_flops(hidden, "Backward" in row["instruction"])
        peak = PEAK_FP8 if gemm and gemm.target == FP8_GEMM else PEAK_BF16
        seconds = max(flops / peak, row["bytes"] / BANDWIDTH)
        total += seconds
        kind = row["instruction"] if gemm is None else ("FP8 GEMM" if gemm.fp8 else "BF16 GEMM")
        kind = kind.replace("GEMM __cudnn$", "cuDNN ")
        by_kind[kind.split(" kLoop")[0].split(" kInput")[0]] += seconds
    return {
        "fp8_gemms": sum(g.fp8 for g in gemms.values()),
        "gemms": len(gemms) + gemms_left_to_fusions(hlo_text),
        "attention_calls": len(fused_attention_calls(hlo_text)),
        "kernels": len(kernel_names(hlo_text)),
        "bytes": sum(row["bytes"] for row in rows),
        "gemm_flops": sum(g.flops for g in gemms.values()),
        "seconds": total,
        "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="*", default=list(HIDDEN_SIZES))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--attention", choices=("cudnn", "xla"), default="cudnn", help="the attention lowering"
    )
    args = parser.parse_args()
    reason = available()
    if reason:
        raise SystemExit(f"the deviceless H100 compile cannot run: {reason}")
    lines = [
        "# Model level: a TransformerLayer training step, deviceless H100",
        "",
        f"One training step of a Linen `TransformerLayer` (batch {BATCH} x sequence {SEQ}, MLP "
        "4 x hidden, 128-wide heads, causal, bf16 compute, float32 parameters, "
        f"{args.attention} attention), compiled for the H100 SXM target with XLA's GPU compiler "
        "on a CPU host. FP8: delayed scaling, te_flax's Pallas kernels as chosen on a GPU. "
        "Command: `JAX_PLATFORMS=cpu python -m bench.model"
        + ("`." if args.attention == "cudnn" else " --attention xla`."),
        "",
        "**Modelled step time: a model, not a measurement** (per compiled instruction "
        "max(FLOPs / peak, bytes / bandwidth), H100 SXM peaks 989 TFLOP/s BF16, 1979 TFLOP/s "
        "FP8, 3.35 TB/s; see `bench/model.py`).",
        "",
        "| hidden | recipe | FP8 GEMMs / all GEMMs | Pallas kernels | HBM bytes (GiB) | "
        "bytes FP8 / BF16 | modelled step (ms, model) | modelled FP8 / BF16 speed-up (model) | "
        "compile (s) | top modelled ops (ms, model) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for hidden in args.hidden:
        results = {}
        for fp8 in (False, True):
            hlo_text, seconds = compile_step(hidden, fp8, args.attention)
            results[fp8] = {**modelled(hlo_text, hidden), "compile": seconds}
            print(hidden, "fp8" if fp8 else "bf16", results[fp8], flush=True)
        for fp8 in (False, True):
            r = results[fp8]
            top = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in list(r["by_kind"].items())[:3])
            ratio = r["bytes"] / results[False]["bytes"]
            speedup = results[False]["seconds"] / r["seconds"]
            calls = r["attention_calls"]
            attention = f" + {calls} cuDNN attention" if calls else ""
            lines.append(
                f"| {hidden} | {'FP8 delayed' if fp8 else 'BF16'} | {r['fp8_gemms']} / "
                f"{r['gemms']}{attention} | {r['kernels']} | {r['bytes'] / 2**30:.2f} | "
                f"{ratio:.3f} | "
                f"{1e3 * r['seconds']:.2f} | {speedup:.2f} | {r['compile']:.0f} | {top} |"
            )
    lines += [
        "",
        "The GEMMs that are not FP8 in the FP8 step are the attention core's, which te_flax "
        "does not quantize: with cuDNN attention its fused forward and backward calls (their "
        "FLOPs modelled from the shapes, causal), with XLA attention `Q.K^T`, `P.V` and their "
        "gradients as bf16 cuBLAS GEMMs.",
        "",
        "Not measured here yet: the Flax-FP8 version of the same model, the example GPT's "
        "scanned 12-layer step and its compile time scan vs unrolled.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
