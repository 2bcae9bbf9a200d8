"""FP8 attention's lowering on XLA:GPU, checked with a deviceless compile for an H100.

One training step (``value_and_grad`` over the FP8 state and q, k, v, the state max-merged)
of a Linen ``DotProductAttention`` under ``DelayedScaling(fp8_dpa=True)`` (bf16, causal, GQA,
batch 2, sequence 256, 4 query heads, 2 key/value heads, head_dim 64) is compiled for the
H100 of ``tests/gpu_target.py``. The attention's six GEMMs (``q.k``, ``p.v`` and their four
gradients) are all cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8``), batched over batch x key/value
heads: the forward ones e4m3 x e4m3 with fast accumulation, the backward ones an e5m2
gradient times an e4m3 operand in full precision; no other GEMM and no cuDNN fused
attention. (JAX's cuDNN FP8 fused attention has no public entry; te_flax does not call it.)
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

import te_flax.linen as te_nn
from te_flax._tools.hlo import FP8_GEMM, fused_attention_calls, gemms_left_to_fusions, parse_gemms
from te_flax.quantize import DelayedScaling, merge_by_max
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

BATCH, SEQ, HEADS, GROUPS, HEAD_DIM = 2, 256, 4, 2, 64


def _step_hlo() -> str:
    sharding = h100_sharding()
    module = te_nn.DotProductAttention(
        head_dim=HEAD_DIM, num_attention_heads=HEADS, num_gqa_groups=GROUPS,
        transpose_batch_sequence=False, recipe=DelayedScaling(fp8_dpa=True, amax_history_len=16),
    )  # fmt: skip
    query = jax.ShapeDtypeStruct((BATCH, SEQ, HEADS, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((BATCH, SEQ, GROUPS, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    abstract = jax.eval_shape(lambda q, k: module.init(jax.random.key(0), q, k, k), query, kv)
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), abstract
    )

    def loss(variables, q, k, v):
        out = module.apply(merge_by_max(variables), q, k, v)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    return step.lower(variables, query, kv, kv).compile().as_text()


def test_fp8_attention_step_is_six_fp8_gemms():
    hlo_text = _step_hlo()
    gemms = parse_gemms(hlo_text)
    report = [(g.target, g.operand_types, g.dims, g.precision[0]) for g in gemms]
    print(f"\nFP8 attention step GEMMs: {report}")
    assert all(g.target == FP8_GEMM for g in gemms), report
    assert not fused_attention_calls(hlo_text) and not gemms_left_to_fusions(hlo_text), report
    # Batched over batch x key/value heads; a key/value head's query heads share its rows.
    batch, rows = BATCH * GROUPS, (HEADS // GROUPS) * SEQ
    scores, context, key = (
        tuple(sorted(dims))
        for dims in ((batch, rows, SEQ), (batch, rows, HEAD_DIM), (batch, SEQ, HEAD_DIM))
    )
    e4m3, e5m2_e4m3 = ("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn")
    expected = Counter({
        (e4m3, "DEFAULT", scores): 1,  # q . k
        (e4m3, "DEFAULT", context): 1,  # p . v
        (e5m2_e4m3, "HIGHEST", scores): 1,  # d(p) = dO . v
        (e5m2_e4m3, "HIGHEST", context): 1,  # dq = d(scores) . k
        (e5m2_e4m3, "HIGHEST", key): 2,  # dk = d(scores) . q, dv = p . dO
    })  # fmt: skip
    found = Counter((g.operand_types, g.precision[0], tuple(sorted(g.dims))) for g in gemms)
    assert found == expected, report
