"""TransformerLayer's FP8 lowering on XLA:GPU, checked with a deviceless compile for an H100.

One training step (``value_and_grad`` over the variables and the input, FP8 state merged with
``merge_fp8_state``) of a Linen ``TransformerLayer`` (ENCODER, causal self-attention, no
relative position biases, bf16 compute, float32 parameters, FP8 delayed scaling; hidden 256,
4 heads, MLP 512, batch 4, sequence 128) is compiled for the H100 of ``tests/gpu_target.py``
and its GEMMs are read from the optimized HLO. The layer has four FP8 GEMMs (the fused QKV
projection, the output projection and the MLP's two), each three times in a step (forward,
dgrad, wgrad): 12 ``__cublas$lt$matmul$f8`` calls. Every other GEMM belongs to the attention
core, which is not quantized:

* ``implementation="xla"``: the products ``Q.K^T`` and ``P.V`` and their four gradients, six
  bf16 cuBLAS GEMMs batched over batch x heads.
* ``implementation="cudnn"``: cuDNN's fused flash attention, one forward and one backward
  custom call (``__cudnn$fmha...``), and no other GEMM.
* ``implementation=None`` (automatic) picks cuDNN only when JAX's default backend is a GPU. A
  deviceless compile runs with the CPU as the default backend (``JAX_PLATFORMS=cpu``), so the
  automatic choice here is XLA's attention, as it is on a CPU; on a GPU it would be cuDNN's.

Each case prints (visible with ``pytest -s``) and puts in its assertion messages which attention
lowering it got and its GEMM counts.

The steps are traced with te_flax's Pallas kernels as a process with a GPU chooses them, and
the layer has an intermediate dropout of 0.1: on (``deterministic=False``) the MLP still runs
the fused ``layernorm_mlp`` op, and the step has the same FP8 GEMMs and the same Pallas kernels
as the deterministic one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

import te_flax.linen as te_nn
from te_flax._ops.kernels import pallas_kernels
from te_flax._tools.hlo import (
    FP8_GEMM,
    NON_FP8_GEMMS,
    Gemm,
    fused_attention_calls,
    gemms_left_to_fusions,
    kernel_names,
    parse_gemms,
)
from te_flax.quantize import DelayedScaling
from te_flax.training import merge_fp8_state
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

BATCH, SEQ, HIDDEN, HEADS, MLP = 4, 128, 256, 4, 512
HEAD_DIM, TOKENS = HIDDEN // HEADS, BATCH * SEQ
# The 12 FP8 GEMMs by (operand precision, result dims in either order): the forward ones with
# fast accumulation (DEFAULT), dgrad and wgrad in full precision (HIGHEST).
_PROJECTIONS = {  # name: (input features, output features)
    "qkv": (HIDDEN, 3 * HIDDEN),
    "out": (HIDDEN, HIDDEN),
    "mlp wi": (HIDDEN, MLP),
    "mlp wo": (MLP, HIDDEN),
}
EXPECTED_FP8_GEMMS = Counter(
    gemm
    for n_in, n_out in _PROJECTIONS.values()
    for gemm in (
        ("DEFAULT", tuple(sorted((TOKENS, n_out)))),  # forward [tokens, out]
        ("HIGHEST", tuple(sorted((TOKENS, n_in)))),  # dgrad [tokens, in]
        ("HIGHEST", tuple(sorted((n_in, n_out)))),  # wgrad [in, out]
    )
)
# XLA's attention: QK^T [b*h, q, k], PV [b*h, q, d], and dP, dV, dQ, dK.
XLA_ATTENTION_GEMMS = 6
IMPLEMENTATIONS = {"xla": "xla", "cudnn": "cudnn", "auto": None}
# The lowering each case must get (see the module docstring for "auto").
EXPECTED_LOWERING = {"xla": "xla", "cudnn": "cudnn", "auto": "xla"}


@dataclasses.dataclass(frozen=True)
class StepGemms:
    """The GEMMs of one compiled step, sorted by who does them."""

    fp8: list[Gemm]  # cuBLASLt FP8
    attention: list[Gemm]  # non-FP8 cuBLAS GEMMs batched over batch x heads, of q, k, d sizes
    other: list[Gemm]  # any other non-FP8 cuBLAS GEMM
    fused_attention: list[str]  # cuDNN flash attention custom calls
    loose_dots: int  # dots XLA left to a fusion (Triton, cuDNN GEMM fusions, plain dot)

    @property
    def lowering(self) -> str:
        if self.fused_attention:
            return "cudnn"
        return "xla" if self.attention else "none found"

    def report(self) -> str:
        fused = ", ".join(sorted(self.fused_attention)) or "none"
        return (
            f"attention lowered as {self.lowering}: {len(self.fp8)} FP8 GEMMs ({FP8_GEMM}), "
            f"{len(self.attention)} bf16 attention GEMMs "
            f"{sorted(g.dims for g in self.attention)}, cuDNN fused attention calls: {fused}, "
            f"{len(self.other)} other cuBLAS GEMMs {[(g.target, g.dims) for g in self.other]}, "
            f"{self.loose_dots} GEMMs left to fusions or plain dots"
        )


def _is_attention(gemm: Gemm) -> bool:
    batch, *matrix = gemm.dims
    return batch == BATCH * HEADS and set(matrix) <= {SEQ, HEAD_DIM}


def step_gemms(hlo_text: str) -> StepGemms:
    gemms = parse_gemms(hlo_text)
    plain = [g for g in gemms if g.target != FP8_GEMM]
    return StepGemms(
        fp8=[g for g in gemms if g.target == FP8_GEMM],
        attention=[g for g in plain if _is_attention(g)],
        other=[g for g in plain if not _is_attention(g)],
        fused_attention=fused_attention_calls(hlo_text),
        loose_dots=gemms_left_to_fusions(hlo_text),
    )


def _layer(implementation: str | None, **attributes: object) -> te_nn.TransformerLayer:
    return te_nn.TransformerLayer(
        **attributes,
        hidden_size=HIDDEN,
        mlp_hidden_size=MLP,
        num_attention_heads=HEADS,
        self_attn_mask_type="causal",
        enable_relative_embedding=False,
        dtype=jnp.bfloat16,
        recipe=DelayedScaling(),
        implementation=implementation,
    )


@functools.cache
def transformer_step_hlo(case: str, dropout: bool = False) -> str:
    """The optimized HLO of one training step of the layer on the H100, compiled deviceless,
    with the Pallas kernels a process with a GPU chooses.

    The layer has an intermediate dropout of 0.1 (the hidden and attention dropout off), on
    with ``deterministic=False`` when ``dropout`` is True.
    """
    sharding = h100_sharding()
    rates = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.1)
    layer = _layer(IMPLEMENTATIONS[case], **rates)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16, sharding=sharding)

    def loss(variables, x):
        rngs = {"dropout": jax.random.key(1)}
        out = layer.apply(merge_fp8_state(variables), x, deterministic=not dropout, rngs=rngs)
        # A loss whose gradient depends on the output, so that XLA cannot fold it to a constant.
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    init = lambda x: layer.init(jax.random.key(0), x, deterministic=True)  # noqa: E731
    abstract = nn.meta.unbox(jax.eval_shape(init, x))
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), abstract
    )
    with pallas_kernels("auto", assume_gpu=True):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x)
    return lowered.compile().as_text()


def _compiled_gemms(case: str) -> StepGemms:
    try:
        hlo_text = transformer_step_hlo(case)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        if case != "cudnn":
            raise
        message = f"cuDNN attention does not compile deviceless: {type(error).__name__}: {error}"
        print(f"\n[{case}] {message}")
        pytest.xfail(message)
    gemms = step_gemms(hlo_text)
    print(f"\n[implementation={IMPLEMENTATIONS[case]!r}] {gemms.report()}")
    return gemms


@pytest.mark.parametrize("case", list(IMPLEMENTATIONS))
def test_transformer_step_has_twelve_fp8_gemms_and_only_attention_besides(case):
    gemms = _compiled_gemms(case)
    report = f"implementation={IMPLEMENTATIONS[case]!r}: {gemms.report()}"
    assert gemms.lowering == EXPECTED_LOWERING[case], report
    # Every projection and MLP GEMM is an FP8 cuBLASLt GEMM, each of the three per GEMM once.
    found = Counter((g.precision[0], tuple(sorted(g.dims))) for g in gemms.fp8)
    assert found == EXPECTED_FP8_GEMMS, f"{report}; FP8 GEMMs {found}"
    assert not gemms.other and not gemms.loose_dots, report
    if gemms.lowering == "xla":
        assert len(gemms.attention) == XLA_ATTENTION_GEMMS, report
        assert all(g.target in NON_FP8_GEMMS for g in gemms.attention), report
        assert all(g.operand_types == ("bf16", "bf16") for g in gemms.attention), report
    else:
        # No GEMM outside the fused attention: its forward and its backward, one call each.
        assert not gemms.attention, report
        assert len(gemms.fused_attention) == 2, report
        assert sum("Backward" in target for target in gemms.fused_attention) == 1, report


@pytest.mark.triton_kernels
def test_intermediate_dropout_keeps_the_fused_mlp_kernels_and_fp8_gemms():
    """Training with the intermediate dropout on compiles to the same FP8 GEMMs and the same
    Pallas kernels as the deterministic step but the activation's quantization (the mask is
    applied between the activation and its quantization, in XLA's fusion): the MLP stays on
    the fused op."""
    with_dropout = transformer_step_hlo("xla", dropout=True)
    without = transformer_step_hlo("xla", dropout=False)
    counts = []
    for text in (with_dropout, without):
        gemms = step_gemms(text)
        fp8 = Counter((g.precision[0], tuple(sorted(g.dims))) for g in gemms.fp8)
        counts.append((fp8, kernel_names(text), len(gemms.attention), gemms.loose_dots))
    print(f"\n[dropout on / off] FP8 GEMMs, kernels: {counts[0][1]} / {counts[1][1]}")
    counts[1][1].remove("te_flax_activation_quantize")
    assert counts[0] == counts[1]
    assert counts[0][0] == EXPECTED_FP8_GEMMS
    assert "te_flax_activation_grad" in counts[0][1]
