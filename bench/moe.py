"""An FP8 mixture-of-experts layer: grouped_dense's lowerings against BF16 and Flax's FP8 ops.

``python -m bench.moe`` (``--quick``: smaller cases, fewer timing rounds, nothing written)
measures one training step (forward and backward, the gradients of the parameters, the FP8
state and the layer's input as inside a network; the optimizer update is left out) of a
Mixtral-style MoE layer: a float32 softmax router with top-k, the tokens permuted to rows sorted
by expert (argsort + gather), a gated SiLU expert MLP as two grouped GEMMs (``wi [E, hidden,
2 * ffn]``, ``wo [E, ffn, hidden]``), and the weighted un-permutation. Six variants of the same
layer and parameters:

- ``te_flax fp8 ragged`` / ``te_flax fp8 capacity``: ``te_flax.dense.grouped_dense`` with
  DelayedScaling (one scale per expert) on its ragged and its capacity lowering (capacity
  factor 1.25: tokens past an expert's capacity are dropped);
- ``te_flax bf16 ragged`` / ``te_flax bf16 capacity``: the same without FP8;
- ``flax fp8 capacity``: the capacity layout with Flax's own FP8 op for batched GEMMs
  (``flax.linen.fp8_ops.Fp8Einsum``: one scale per tensor for all experts; Flax has no ragged
  FP8 GEMM), and ``flax bf16 capacity`` the same with ``jnp.einsum``.

On a GPU the ragged lowering, and the capacity lowering with per-tensor FP8, run te_flax's
grouped GEMM kernels (Pallas Mosaic GPU) by default, and with the kernels switched off XLA's
``ragged_dot`` (ragged) or batched cuBLASLt GEMMs (capacity; BF16 capacity keeps them by
default): the H100 figures show both, as ``... kernel`` (``pallas_kernels("auto")``) and
``... xla`` (``pallas_kernels("0")``, every te_flax kernel off). They add ``te_flax MoEBlock fp8``:
``te_flax.linen.MoEBlock``'s default (dropless, so the ragged lowering, with its kernels) under
DelayedScaling. On a CPU the kernels do not run: the CPU table has one row per lowering.

For each: the GEMMs of the H100 program (FP8 cuBLASLt calls, te_flax's grouped GEMM kernels
and others), its FLOPs and the bytes it accesses (compiled deviceless, XLA's cost analysis plus
the custom calls' operands, as ``bench.h100.cost``), a modelled step time from them
(``modelled_ms``), at H100 size; and the CPU step time (median of interleaved rounds, FP8
emulated) at CPU size. ``bench/moe_deepseek.py`` adds the same for a DeepSeek-V3-like layer
(256 small experts, top-8) and its expert-parallel all-to-all bytes. Figures go to
``bench/RESULTS_moe.md``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import dataclasses  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

from bench import h100  # noqa: E402
from bench.timing import interleaved, paired_ratio, stats  # noqa: E402
from te_flax._ops.grouped import RaggedOnGpuWarning, pack_rows, unpack_rows  # noqa: E402
from te_flax._tools.hlo import parse_gemms  # noqa: E402
from te_flax.dense import grouped_dense, grouped_quantizer_set  # noqa: E402
from te_flax.linen import MoEBlock  # noqa: E402
from te_flax.quantize import DelayedScaling, QuantizerFactory, noop_quantizer_set  # noqa: E402
from te_flax.training import merge_fp8_state  # noqa: E402

RESULTS = Path(__file__).parent / "RESULTS_moe.md"
VARIANTS = (
    "te_flax fp8 ragged",
    "te_flax fp8 capacity",
    "te_flax bf16 ragged",
    "te_flax bf16 capacity",
    "flax fp8 capacity",
    "flax bf16 capacity",
)
MOE_BLOCK = "te_flax MoEBlock fp8"
# The H100 rows: each a layer variant and te_flax's kernel switch while it is traced.
H100_VARIANTS = {
    "te_flax fp8 ragged kernel": ("te_flax fp8 ragged", "auto"),
    "te_flax fp8 ragged xla": ("te_flax fp8 ragged", "0"),
    "te_flax fp8 capacity kernel": ("te_flax fp8 capacity", "auto"),
    "te_flax fp8 capacity xla": ("te_flax fp8 capacity", "0"),
    "te_flax bf16 ragged kernel": ("te_flax bf16 ragged", "auto"),
    "te_flax bf16 ragged xla": ("te_flax bf16 ragged", "0"),
    "te_flax bf16 capacity": ("te_flax bf16 capacity", "auto"),
    "flax fp8 capacity": ("flax fp8 capacity", "auto"),
    "flax bf16 capacity": ("flax bf16 capacity", "auto"),
    MOE_BLOCK: (MOE_BLOCK, "auto"),
}
BASELINE = "te_flax bf16 capacity"

# H100 SXM: dense tensor-core peaks and HBM3 bandwidth (NVIDIA's datasheet), as bench/te_peer.py.
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}
HBM_BYTES_PER_S = 3.35e12
# The share of a peak each kind of work reaches in the model ("derated"), or all of it ("peak").
DERATES = {
    "peak": {
        "cublas bf16": 1.0,
        "cublas fp8": 1.0,
        "kernel bf16": 1.0,
        "kernel fp8": 1.0,
        "hbm": 1.0,
    },
    "derated": {
        "cublas bf16": 0.70,
        "cublas fp8": 0.65,
        "kernel bf16": 0.68,
        "kernel fp8": 0.55,
        "hbm": 0.90,
    },
}


@dataclasses.dataclass(frozen=True)
class MoECase:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    capacity_factor: float = 1.25

    @property
    def capacity(self) -> int:
        """Rows per expert of the capacity lowering: the even share times the factor."""
        return math.ceil(self.tokens * self.topk / self.experts * self.capacity_factor)

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens, hidden {self.hidden}, ffn {self.ffn} (gated SiLU), "
            f"{self.experts} experts, top-{self.topk}, capacity {self.capacity} "
            f"(factor {self.capacity_factor})"
        )


CPU_CASE = MoECase("CPU", tokens=512, hidden=1024, ffn=1024, experts=8, topk=2)
H100_CASE = MoECase("H100", tokens=8192, hidden=4096, ffn=14336, experts=8, topk=2)
QUICK_CPU_CASE = MoECase("CPU", tokens=128, hidden=256, ffn=256, experts=8, topk=2)
QUICK_H100_CASE = MoECase("H100", tokens=1024, hidden=1024, ffn=2048, experts=8, topk=2)


# ----------------------------------------------------------------------------- the layer


def init_params(case: MoECase, key: jax.Array) -> dict:
    keys = jax.random.split(key, 3)
    e, h, f = case.experts, case.hidden, case.ffn
    return {
        "gate": jax.random.normal(keys[0], (h, e), jnp.float32) * h**-0.5,
        "wi": jax.random.normal(keys[1], (e, h, 2 * f), jnp.float32) * h**-0.5,
        "wo": jax.random.normal(keys[2], (e, f, h), jnp.float32) * f**-0.5,
    }


def route(x: jax.Array, gate: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Softmax scores in float32, the top-k experts of each token and their renormalized
    weights: ``[tokens, k]`` each."""
    logits = jnp.dot(x.astype(jnp.float32), gate)  # [T, E]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), topk)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def dispatch(x: jax.Array, experts: jax.Array, n_experts: int):
    """The tokens' copies as rows sorted by expert, the rows per expert, and the sort order."""
    flat = experts.reshape(-1)  # [T * k]
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x, order // experts.shape[1], axis=0)  # [T * k, H]
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E]
    return rows, sizes, order


def combine(rows: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Un-permutes the rows and sums each token's k copies with its routing weights."""
    tokens, topk = weights.shape
    unsorted = jnp.zeros_like(rows).at[order].set(rows)  # [T * k, H]
    copies = unsorted.reshape(tokens, topk, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", copies, weights).astype(rows.dtype)


def _gated(h: jax.Array, ffn: int) -> jax.Array:
    return jax.nn.silu(h[..., :ffn]) * h[..., ffn:]


def te_flax_moe(params, states, x, case: MoECase, lowering: str) -> jax.Array:
    weights, experts = route(x, params["gate"], case.topk)
    rows, sizes, order = dispatch(x, experts, case.experts)
    capacity = case.capacity if lowering == "capacity" else None
    gemm = dict(lowering=lowering, capacity=capacity)
    h = grouped_dense(rows, params["wi"], sizes, quantizer_set=states["wi"], **gemm)
    y = grouped_dense(_gated(h, case.ffn), params["wo"], sizes, quantizer_set=states["wo"], **gemm)
    return combine(y, order, weights)


class FlaxExperts(nn.Module):
    """The experts' two GEMMs on the capacity layout ``[E, C, hidden]``, with Flax's FP8
    einsum (one delayed scale per tensor) or ``jnp.einsum``."""

    ffn: int
    fp8: bool

    @nn.compact
    def __call__(self, packed, wi, wo):
        def einsum(name: str) -> Callable:
            return fp8_ops.Fp8Einsum(name=name) if self.fp8 else jnp.einsum

        # Fp8Einsum runs in the kernel's dtype: the kernels are cast to the activations'.
        h = einsum("wi")("ech,ehf->ecf", packed, wi.astype(packed.dtype))
        return einsum("wo")("ecf,efh->ech", _gated(h, self.ffn), wo.astype(packed.dtype))


def flax_moe(params, state, x, case: MoECase, fp8: bool) -> jax.Array:
    weights, experts = route(x, params["gate"], case.topk)
    rows, sizes, order = dispatch(x, experts, case.experts)
    packed = pack_rows(rows, sizes, case.capacity)  # [E, C, H]
    variables = {"_overwrite_with_gradient": state} if state else {}
    y = FlaxExperts(case.ffn, fp8).apply(variables, packed, params["wi"], params["wo"])
    return combine(unpack_rows(y, sizes, rows.shape[0]), order, weights)


def _merged_loss(loss: Callable, variables, x):
    """``loss`` with the FP8 state max-merged, as ``te_flax.training.value_and_grad`` calls it."""
    return loss(merge_fp8_state(variables), x)


def _moe_block(case: MoECase, key: jax.Array, x, make: Callable):
    """``te_flax.linen.MoEBlock`` with its defaults (dropless: the ragged lowering) under
    DelayedScaling, as ``make_variant``: its variables are ``params``, ``state`` is empty."""
    layer = MoEBlock(
        num_experts=case.experts,
        num_experts_per_tok=case.topk,
        intermediate_dim=case.ffn,
        recipe=DelayedScaling(),
    )
    variables = make(layer.init, key, x)

    def loss(variables, x):
        return jnp.mean(jnp.square(layer.apply(variables, x)[0].astype(jnp.float32)))

    def step(variables, state, x):
        del state
        merged = partial(_merged_loss, loss)
        return jax.value_and_grad(merged, argnums=(0, 1))(variables, x)

    return step, variables, {}, x


def make_variant(variant: str, case: MoECase, key: jax.Array, abstract: bool = False):
    """``(step, params, state, x)``: ``step`` is one training step's gradients. ``abstract``:
    the arguments as shapes only (``jax.ShapeDtypeStruct``), for a compile at a size that
    this machine's memory need not hold."""
    make = jax.eval_shape if abstract else (lambda f, *args: f(*args))
    x = make(
        lambda k: jax.random.normal(k, (case.tokens, case.hidden), jnp.bfloat16),
        jax.random.fold_in(key, 1),
    )
    if variant == MOE_BLOCK:
        return _moe_block(case, key, x, make)
    library, precision, lowering = variant.split()
    fp8 = precision == "fp8"
    params = make(partial(init_params, case), key)
    if library == "te_flax":
        recipe_set = QuantizerFactory.create_set(fp8_recipe=DelayedScaling())
        one = grouped_quantizer_set(recipe_set, case.experts) if fp8 else noop_quantizer_set
        state = {"wi": one, "wo": one}

        def forward(params, state, x):
            return te_flax_moe(params, state, x, case, lowering)
    else:
        packed = jax.ShapeDtypeStruct((case.experts, case.capacity, case.hidden), jnp.bfloat16)
        packed = packed if abstract else jnp.zeros(packed.shape, packed.dtype)
        module = FlaxExperts(case.ffn, fp8)
        state = make(module.init, key, packed, params["wi"], params["wo"]).get(
            "_overwrite_with_gradient", {}
        )

        def forward(params, state, x):
            return flax_moe(params, state, x, case, fp8)

    def loss(params, state, x):
        return jnp.mean(jnp.square(forward(params, state, x).astype(jnp.float32)))

    # The input's gradient too, as for a layer inside a network.
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), params, state, x


# ----------------------------------------------------------------------------- measurements


def _weight_gradient_pass_bytes(instructions: list[dict], case: MoECase) -> float:
    """Bytes of the elementwise passes that write the float32 expert-kernel gradients after
    their GEMM: te_flax's per-expert scales (a batched cuBLASLt GEMM takes one scalar scale),
    Flax's bfloat16-to-float32 conversion. An optimizer update, which reads the gradients,
    would take either into its own fusion."""
    e, h, f = case.experts, case.hidden, case.ffn
    kernels = {f"f32[{e},{h},{2 * f}]", f"f32[{e},{f},{h}]"}
    return float(
        sum(
            row["bytes"]
            for row in instructions
            if row["pass"] == "backward"
            and row["instruction"].startswith("fusion")
            and row["result"] in kernels
        )
    )


def modelled_ms(row: dict, derate: dict[str, float]) -> tuple[float, float]:
    """A model of the step's H100 time in ms, not a measurement, and its share in the GEMM and
    grouped kernel calls: each cuBLAS GEMM and each grouped
    GEMM kernel takes its FLOPs at its peak times its derate, or its bytes at the derated HBM
    bandwidth where that is longer (``max(flops time, bytes time)`` per call); every other byte
    the step accesses moves at the derated HBM bandwidth. cuBLAS GEMMs with float8 operands run
    at the FP8 peak, all others (the float32 router's too) at the BF16 peak; a grouped kernel
    with float8 operands at the FP8 one. GEMMs left to fusions count by their bytes only."""
    hbm = HBM_BYTES_PER_S * derate["hbm"]
    seconds, call_bytes = 0.0, 0.0
    for source, calls in (("cublas", row["gemm_calls"]), ("kernel", row["kernel_gemm_calls"])):
        for flops, nbytes, fp8 in calls:
            kind = "fp8" if fp8 else "bf16"
            seconds += max(flops / (PEAK_FLOPS[kind] * derate[f"{source} {kind}"]), nbytes / hbm)
            call_bytes += nbytes
    return 1e3 * (seconds + max(row["bytes"] - call_bytes, 0.0) / hbm), 1e3 * seconds


def h100_figures(
    case: MoECase, variants: dict[str, tuple[str, str]] = H100_VARIANTS
) -> dict[str, dict]:
    """GEMMs, FLOPs, bytes and modelled time of each of ``variants``' training step compiled
    for the H100 (row name -> layer variant and kernel switch)."""
    from te_flax._ops.kernels import pallas_kernels

    sharding = h100._sharding()

    def spec(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    def compiled(step: Callable, arguments: tuple, kernels: str):
        # The deviceless compile runs on a CPU host: "auto" traces as a GPU process would. With
        # the kernels off, grouped_dense warns that XLA's ragged_dot runs: that row's purpose.
        with pallas_kernels(kernels, assume_gpu=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", RaggedOnGpuWarning)
            lowered = jax.jit(step).lower(*jax.tree.map(spec, arguments))
        return lowered.compile()

    figures = {}
    for name, (variant, kernels) in variants.items():
        step, params, state, x = make_variant(variant, case, jax.random.key(0), abstract=True)
        gradients = compiled(step, (params, state, x), kernels)
        text = gradients.as_text()
        instructions = h100.instruction_bytes(text, top=None)
        top = instructions[0]
        grouped = h100.grouped_kernel_gemms(text)
        row = {
            **h100.count_gemms(text),
            **h100.cost(gradients),
            "top": f"{top['instruction']} -> {top['result']} ({top['bytes'] / 1e6:.0f} MB)",
            "wgrad_pass": _weight_gradient_pass_bytes(instructions, case),
            "gemm_calls": [(g.flops, g.bytes, g.fp8) for g in parse_gemms(text)],
            "kernel_gemm_calls": [(g["flops"], g["bytes"], g["fp8"]) for g in grouped],
            "kernel_types": sorted({" x ".join(g["operand_types"]) for g in grouped}),
        }
        modelled = {label: modelled_ms(row, derate) for label, derate in DERATES.items()}
        row["ms"] = {label: step for label, (step, _) in modelled.items()}
        row["calls_ms"] = {label: calls for label, (_, calls) in modelled.items()}
        figures[name] = row
        print(
            f"  H100 {name}: {row['bytes'] / 1e9:.2f} GB, {row['ms']['derated']:.2f} ms (model)",
            file=sys.stderr,
        )
    return figures


def cpu_times(
    case: MoECase, repeats: int, variants: tuple[str, ...] = VARIANTS
) -> dict[str, list[float]]:
    runners = {}
    for variant in variants:
        step, params, state, x = make_variant(variant, case, jax.random.key(0))
        compiled = jax.jit(step).lower(params, state, x).compile()
        runners[variant] = lambda compiled=compiled, args=(params, state, x): compiled(*args)
    return interleaved(runners, repeats=repeats, warmup=1)


def _ratio_row(label: str, times: dict, numerator: str, denominator: str) -> str:
    ratio = paired_ratio(times[numerator], times[denominator])
    return f"| {label} | {ratio['median']:.3f} | [{ratio['min']:.3f}, {ratio['max']:.3f}] |"


def _speedup(rows: dict, variant: str, label: str) -> float:
    return rows[BASELINE]["ms"][label] / rows[variant]["ms"][label]


def _h100_tables(rows: dict[str, dict]) -> list[str]:
    """The traffic table and the modelled-time table of the H100 rows."""
    bf16 = rows[BASELINE]["bytes"]
    lines = [
        "| variant | FP8 cuBLAS GEMMs | other GEMMs | grouped GEMM kernels | cuBLAS GFLOP | "
        f"kernel GFLOP | GFLOP | GB accessed | / {BASELINE} | GB in weight-gradient "
        "passes | GB without them | largest instruction |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, row in rows.items():
        kernels = row["grouped_kernels"]
        types = f" ({', '.join(row['kernel_types'])})" if kernels else ""
        lines.append(
            f"| {variant} | {row['fp8_gemms']} | {row['other_gemms']} | {kernels}{types} | "
            f"{row['gemm_flops'] / 1e9:.0f} | {row['grouped_kernel_flops'] / 1e9:.0f} | "
            f"{row['flops'] / 1e9:.0f} | {row['bytes'] / 1e9:.2f} | {row['bytes'] / bf16:.3f} "
            f"| {row['wgrad_pass'] / 1e9:.2f} | {(row['bytes'] - row['wgrad_pass']) / 1e9:.2f} "
            f"| {row['top']} |"
        )
    lines += [
        "",
        "Modelled step time (a model from the compiled program's FLOPs and bytes, not a "
        "measurement; `modelled_ms` in `bench/moe.py`): each cuBLAS GEMM and each grouped GEMM "
        "kernel call takes max(its FLOPs / (peak x derate), its bytes / (HBM x derate)); every "
        "other byte of the step moves at HBM x derate. H100 SXM peaks: BF16 989 TFLOP/s, FP8 "
        "1979 TFLOP/s, HBM 3.35 TB/s. Derates: cuBLAS BF16 0.70, cuBLAS FP8 0.65, grouped "
        'kernels BF16 0.68 / FP8 0.55, HBM 0.90; "peak": all 1.0. Non-FP8 cuBLAS GEMMs (the '
        f"float32 router's too) at the BF16 peak. Speed-up: {BASELINE}'s time / the "
        "row's.",
        "",
        "| variant | GEMM + kernel calls ms (derated) | other bytes ms (derated) | step ms (peak) "
        "| step ms (derated) | speed-up (peak) | speed-up (derated) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, row in rows.items():
        calls = row["calls_ms"]["derated"]
        lines.append(
            f"| {variant} | {calls:.2f} | {row['ms']['derated'] - calls:.2f} | "
            f"{row['ms']['peak']:.2f} | {row['ms']['derated']:.2f} | "
            f"{_speedup(rows, variant, 'peak'):.2f} | {_speedup(rows, variant, 'derated'):.2f} |"
        )
    return lines


def _h100_notes(rows: dict[str, dict], case: MoECase) -> list[str]:
    """The comparison the kernels are for, and the traffic ratios."""
    fp8, bf16 = "te_flax fp8 ragged kernel", "te_flax bf16 ragged kernel"
    lines = [
        "",
        "The grouped GEMM kernels against BF16 (modelled step time, ms; speed-up against "
        f"{BASELINE}):",
        "",
        f"| model | {fp8} | {bf16} | {BASELINE} | FP8 kernel / BF16 kernel speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label in DERATES:
        ms = [rows[v]["ms"][label] for v in (fp8, bf16, BASELINE)]
        lines.append(
            f"| {label} | {ms[0]:.2f} ({ms[2] / ms[0]:.2f}x) | {ms[1]:.2f} ({ms[2] / ms[1]:.2f}x) "
            f"| {ms[2]:.2f} (1.00x) | {ms[1] / ms[0]:.2f}x |"
        )
    block = rows[MOE_BLOCK]
    lines += [
        "",
        f"{MOE_BLOCK} runs the same grouped GEMMs with its kernel stored `[E, hidden, 2, ffn]` "
        "(this layer's: `[E, hidden, 2 * ffn]`) and, from jax 0.11 on, its activation's "
        "gradient quantized by the kernel that computes it (this layer's: by XLA, written in "
        f"bfloat16 and read back): {block['bytes'] / 1e9:.2f} GB against "
        f"{rows[fp8]['bytes'] / 1e9:.2f} GB; largest instructions: {block['top']} against "
        f"{rows[fp8]['top']}. {MOE_BLOCK} / {bf16} speed-up (derated model): "
        f"{rows[bf16]['ms']['derated'] / block['ms']['derated']:.2f}x.",
    ]
    capacity = rows["te_flax fp8 capacity xla"]

    def without(variant: str) -> float:
        return rows[variant]["bytes"] - rows[variant]["wgrad_pass"]

    ragged_xla, ragged_kernel = rows["te_flax fp8 ragged xla"], rows[fp8]
    routed = case.tokens * case.topk
    return [
        *lines,
        "",
        "The other GEMMs of the FP8 variants are the router's (forward and backward, float32). "
        "The capacity lowering multiplies every expert's capacity, "
        f"{case.experts} x {case.capacity} = {case.experts * case.capacity} rows (dropped "
        f"tokens' rows are zeros), the ragged one the {routed} routed rows.",
        "",
        "- Bytes, te_flax FP8 / BF16 (capacity): "
        f"{capacity['bytes'] / rows[BASELINE]['bytes']:.3f}.",
        "- Bytes, te_flax FP8 / Flax FP8 (capacity): "
        f"{capacity['bytes'] / rows['flax fp8 capacity']['bytes']:.3f}.",
        "- Weight-gradient passes: a batched cuBLASLt GEMM takes one scalar scale, so "
        "te_flax's per-expert scales of the weight gradients (float32, the kernels' dtype) "
        "are an elementwise pass over the gradients; Flax's FP8 einsum returns bfloat16 "
        "gradients and converts them in a pass of its own; the grouped GEMM kernel applies "
        "each expert's scale before it writes (no pass). Here nothing consumes the "
        "gradients; in training the optimizer update reads them and takes either pass into "
        "its own fusion, so the column without them is the step's share of a training step. "
        "Without them: te_flax FP8 / BF16 (capacity) "
        f"{without('te_flax fp8 capacity xla') / without(BASELINE):.3f}, te_flax FP8 / Flax "
        f"FP8 {without('te_flax fp8 capacity xla') / without('flax fp8 capacity'):.3f}.",
        "- Ragged / capacity (FP8), XLA's lowering: "
        f"{ragged_xla['bytes'] / capacity['bytes']:.2f}x "
        f"the bytes, {ragged_xla['flops'] / capacity['flops']:.2f}x the FLOPs: XLA:GPU expands "
        f"`ragged_dot` into GEMMs over every expert (each row meets all {case.experts} kernels, "
        f"masked). With the kernels: {ragged_kernel['bytes'] / capacity['bytes']:.2f}x the "
        f"bytes, {ragged_kernel['flops'] / capacity['flops']:.2f}x the FLOPs.",
        "",
    ]


def _cpu_lines(case: MoECase, times: dict[str, list[float]], repeats: int) -> list[str]:
    lines = [
        f"## CPU: {case.describe()}",
        "",
        f"Median of {repeats} interleaved rounds after one warm-up round; FP8 GEMMs are "
        "emulated on a CPU (float8 operands converted for float32 GEMMs), so FP8 costs more "
        "there, not less. te_flax's grouped GEMM kernels do not run on a CPU: the ragged rows "
        "are XLA's `ragged_dot`.",
        "",
        "| variant | step ms (median) | spread |",
        "| --- | --- | --- |",
    ]
    for variant in VARIANTS:
        s = stats(times[variant])
        lines.append(f"| {variant} | {s['median'] * 1e3:.1f} | {s['spread']:.2f} |")
    return [
        *lines,
        "",
        "| ratio (per round) | median | [min, max] |",
        "| --- | --- | --- |",
        _ratio_row("te_flax FP8 / BF16 (capacity)", times, VARIANTS[1], VARIANTS[3]),
        _ratio_row("te_flax FP8 / BF16 (ragged)", times, VARIANTS[0], VARIANTS[2]),
        _ratio_row("te_flax FP8 / Flax FP8 (capacity)", times, VARIANTS[1], VARIANTS[4]),
        _ratio_row("te_flax BF16 / Flax BF16 (capacity)", times, VARIANTS[3], VARIANTS[5]),
        _ratio_row("ragged / capacity (te_flax FP8)", times, VARIANTS[0], VARIANTS[1]),
        _ratio_row("ragged / capacity (te_flax BF16)", times, VARIANTS[2], VARIANTS[3]),
        "",
    ]


def report(
    cpu_case: MoECase, h100_case: MoECase, repeats: int, command: str, quick: bool = False
) -> str:
    from bench.moe_deepseek import deepseek_lines

    started = time.time()
    load_start = os.getloadavg()[0]
    h100_rows = h100_figures(h100_case) if h100.available() is None else None
    times = cpu_times(cpu_case, repeats)
    deepseek = deepseek_lines(quick, repeats)
    load_end = os.getloadavg()[0]
    lines = [
        "# MoE layer benchmark: grouped_dense's lowerings, FP8 vs BF16, te_flax vs Flax FP8",
        "",
        f"Produced by `{command}` ({(time.time() - started) / 60:.1f} min, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). One training step (forward + "
        "backward with the input's gradient, no optimizer) of a Mixtral-style MoE layer: "
        "float32 softmax router, top-k, rows sorted by expert (argsort + gather), gated SiLU "
        "experts as two grouped GEMMs, "
        "weighted un-permutation. See the docstring of `bench/moe.py` for the variants; "
        "docs/moe.md says which lowering to use where.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}; load average {load_start:.1f} at the "
        f"start and {load_end:.1f} at the end (other processes shared the CPU). "
        f"jax {jax.__version__}. No GPU: the H100 figures come from XLA's deviceless compile "
        "(its real GPU compiler, FLOPs and bytes from its cost analysis plus the custom calls' "
        "operands: cuBLAS GEMMs, te_flax's Pallas kernels), not from a run; GPU step times are "
        "modelled, not measured.",
        "",
    ]
    if h100_rows is None:
        lines += [f"H100 figures not measured: {h100.available()}.", ""]
    else:
        lines += [
            f"## H100 (deviceless): {h100_case.describe()}",
            "",
            "`kernel`: te_flax's grouped GEMM kernels (Pallas Mosaic GPU, one `mosaic_gpu_v2` "
            "custom call per GEMM; the default on a GPU for the ragged lowering and FP8's "
            "capacity lowering); `xla`: every te_flax kernel off (`TE_FLAX_PALLAS=0`): XLA's "
            "`ragged_dot` or batched cuBLASLt GEMMs; `te_flax bf16 capacity`: batched cuBLAS "
            "GEMMs, its default. `grouped GEMM kernels`: their calls and operand "
            "types; `kernel GFLOP`: their GEMM FLOPs from the operand shapes (wgrad over the "
            "group-aligned, zero-padded rows), apart from the cuBLAS GEMMs'.",
            "",
            *_h100_tables(h100_rows),
            *_h100_notes(h100_rows, h100_case),
        ]
    return "\n".join(lines + _cpu_lines(cpu_case, times, repeats) + deepseek)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    command = "JAX_PLATFORMS=cpu python -m bench.moe" + (" --quick" if quick else "")
    text = report(
        QUICK_CPU_CASE if quick else CPU_CASE,
        QUICK_H100_CASE if quick else H100_CASE,
        repeats=3 if quick else 7,
        command=command,
        quick=quick,
    )
    print(text)
    if not quick:
        RESULTS.write_text(text + _kept_sections())


def _kept_sections() -> str:
    """What ``bench/gpu_moe.py`` wrote into the results (its sections, one per JAX, from its
    first marker on), kept when this bench writes the file anew."""
    old = RESULTS.read_text() if RESULTS.exists() else ""
    start = old.find("<!-- bench.gpu_moe ")
    return "" if start < 0 else "\n" + old[start:]


if __name__ == "__main__":
    main(sys.argv[1:])
