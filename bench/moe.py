"""An FP8 mixture-of-experts layer: grouped_dense's two lowerings against BF16 and Flax's FP8 ops.

``python -m bench.moe`` (``--quick``: fewer timing rounds) measures one training step (forward
and backward; the optimizer update is left out) of a Mixtral-style MoE layer: a float32 softmax
router with top-k, the tokens permuted to rows sorted by expert (argsort + gather), a gated
SiLU expert MLP as two grouped GEMMs (``wi [E, hidden, 2 * ffn]``, ``wo [E, ffn, hidden]``), and
the weighted un-permutation. Six variants of the same layer and parameters:

- ``te_flax fp8 ragged`` / ``te_flax fp8 capacity``: ``te_flax.dense.grouped_dense`` with
  DelayedScaling (one scale per expert) on its ragged and its capacity lowering (capacity
  factor 1.25: tokens past an expert's capacity are dropped);
- ``te_flax bf16 ragged`` / ``te_flax bf16 capacity``: the same without FP8;
- ``flax fp8 capacity``: the capacity layout with Flax's own FP8 op for batched GEMMs
  (``flax.linen.fp8_ops.Fp8Einsum``: one scale per tensor for all experts; Flax has no ragged
  FP8 GEMM), and ``flax bf16 capacity`` the same with ``jnp.einsum``.

For each: the GEMMs of the H100 program (FP8 cuBLASLt calls and others), its FLOPs and the bytes
it accesses (compiled deviceless, XLA's cost analysis plus the cuBLAS calls' operands, as
``bench.h100.cost``), at H100 size; and the CPU step time (median of interleaved rounds, FP8
emulated) at CPU size. Figures go to ``bench/RESULTS_moe.md``.
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
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

from bench import h100  # noqa: E402
from bench.timing import interleaved, paired_ratio, stats  # noqa: E402
from te_flax._ops.grouped import pack_rows, unpack_rows  # noqa: E402
from te_flax.dense import grouped_dense, grouped_quantizer_set  # noqa: E402
from te_flax.quantize import DelayedScaling, QuantizerFactory, noop_quantizer_set  # noqa: E402

RESULTS = Path(__file__).parent / "RESULTS_moe.md"
VARIANTS = (
    "te_flax fp8 ragged",
    "te_flax fp8 capacity",
    "te_flax bf16 ragged",
    "te_flax bf16 capacity",
    "flax fp8 capacity",
    "flax bf16 capacity",
)


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


def make_variant(variant: str, case: MoECase, key: jax.Array, abstract: bool = False):
    """``(step, params, state, x)``: ``step`` is one training step's gradients. ``abstract``:
    the arguments as shapes only (``jax.ShapeDtypeStruct``), for a compile at a size that
    this machine's memory need not hold."""
    library, precision, lowering = variant.split()
    fp8 = precision == "fp8"
    make = jax.eval_shape if abstract else (lambda f, *args: f(*args))
    params = make(partial(init_params, case), key)
    x = make(
        lambda k: jax.random.normal(k, (case.tokens, case.hidden), jnp.bfloat16),
        jax.random.fold_in(key, 1),
    )
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

    return jax.value_and_grad(loss, argnums=(0, 1)), params, state, x


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


def h100_figures(case: MoECase) -> dict[str, dict]:
    """GEMMs, FLOPs and bytes of each variant's training step compiled for the H100."""
    from te_flax._ops.kernels import pallas_kernels

    sharding = h100._sharding()

    def spec(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    def compiled(step: Callable, arguments: tuple):
        # The deviceless compile runs on a CPU host: "auto" traces as a GPU process would.
        with pallas_kernels("auto", assume_gpu=True):
            lowered = jax.jit(step).lower(*jax.tree.map(spec, arguments))
        return lowered.compile()

    figures = {}
    for variant in VARIANTS:
        step, params, state, x = make_variant(variant, case, jax.random.key(0), abstract=True)
        gradients = compiled(step, (params, state, x))
        text = gradients.as_text()
        instructions = h100.instruction_bytes(text, top=None)
        top = instructions[0]
        figures[variant] = {
            **h100.count_gemms(text),
            **h100.cost(gradients),
            "top": f"{top['instruction']} -> {top['result']} ({top['bytes'] / 1e6:.0f} MB)",
            "wgrad_pass": _weight_gradient_pass_bytes(instructions, case),
        }
        print(f"  H100 {variant}: {figures[variant]['bytes'] / 1e9:.2f} GB", file=sys.stderr)
    return figures


def cpu_times(case: MoECase, repeats: int) -> dict[str, list[float]]:
    runners = {}
    for variant in VARIANTS:
        step, params, state, x = make_variant(variant, case, jax.random.key(0))
        compiled = jax.jit(step).lower(params, state, x).compile()
        runners[variant] = lambda compiled=compiled, args=(params, state, x): compiled(*args)
    return interleaved(runners, repeats=repeats, warmup=1)


def _ratio_row(label: str, times: dict, numerator: str, denominator: str) -> str:
    ratio = paired_ratio(times[numerator], times[denominator])
    return f"| {label} | {ratio['median']:.3f} | [{ratio['min']:.3f}, {ratio['max']:.3f}] |"


def report(cpu_case: MoECase, h100_case: MoECase, repeats: int, command: str) -> str:
    started = time.time()
    load_start = os.getloadavg()[0]
    h100_rows = h100_figures(h100_case) if h100.available() is None else None
    times = cpu_times(cpu_case, repeats)
    load_end = os.getloadavg()[0]
    lines = [
        "# MoE layer benchmark: grouped_dense's lowerings, FP8 vs BF16, te_flax vs Flax FP8",
        "",
        f"Produced by `{command}` ({(time.time() - started) / 60:.1f} min, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). One training step (forward + "
        "backward, no optimizer) of a Mixtral-style MoE layer: float32 softmax router, top-k, "
        "rows sorted by expert (argsort + gather), gated SiLU experts as two grouped GEMMs, "
        "weighted un-permutation. See the docstring of `bench/moe.py` for the six variants; "
        "docs/moe.md says which lowering to use where.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.system()} {platform.release()}; load average {load_start:.1f} at the "
        f"start and {load_end:.1f} at the end (other processes shared the CPU). "
        f"jax {jax.__version__}. No GPU: the H100 figures come from XLA's deviceless compile "
        "(its real GPU compiler, FLOPs and bytes from its cost analysis plus the cuBLAS calls' "
        "operands), not from a run; GPU step times are not measured.",
        "",
    ]
    if h100_rows is None:
        lines += [f"H100 figures not measured: {h100.available()}.", ""]
    else:
        bf16 = h100_rows["te_flax bf16 capacity"]["bytes"]
        lines += [
            f"## H100 (deviceless): {h100_case.describe()}",
            "",
            "| variant | FP8 GEMMs | other GEMMs | GFLOP | GB accessed | / te_flax bf16 capacity "
            "| GB in weight-gradient passes | GB without them | largest instruction |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for variant, row in h100_rows.items():
            lines.append(
                f"| {variant} | {row['fp8_gemms']} | {row['other_gemms']} | "
                f"{row['flops'] / 1e9:.0f} | {row['bytes'] / 1e9:.2f} | {row['bytes'] / bf16:.3f} "
                f"| {row['wgrad_pass'] / 1e9:.2f} | {(row['bytes'] - row['wgrad_pass']) / 1e9:.2f} "
                f"| {row['top']} |"
            )
        fp8 = h100_rows["te_flax fp8 capacity"]["bytes"]
        flax_fp8 = h100_rows["flax fp8 capacity"]["bytes"]
        base = "te_flax bf16 capacity"

        def without(variant: str) -> float:
            return h100_rows[variant]["bytes"] - h100_rows[variant]["wgrad_pass"]

        ragged = h100_rows["te_flax fp8 ragged"]
        capacity = h100_rows["te_flax fp8 capacity"]
        lines += [
            "",
            "The other GEMMs of the FP8 variants are the router's (forward and backward, float32).",
            "",
            f"- Bytes, te_flax FP8 / BF16 (capacity): {fp8 / bf16:.3f}.",
            f"- Bytes, te_flax FP8 / Flax FP8 (capacity): {fp8 / flax_fp8:.3f}.",
            "- Weight-gradient passes: a batched cuBLASLt GEMM takes one scalar scale, so "
            "te_flax's per-expert scales of the weight gradients (float32, the kernels' dtype) "
            "are an elementwise pass over the gradients; Flax's FP8 einsum returns bfloat16 "
            "gradients and converts them in a pass of its own. Here nothing consumes the "
            "gradients; in training the optimizer update reads them and takes either pass into "
            "its own fusion, so the column without them is the step's share of a training step. "
            "Without them: te_flax FP8 / BF16 "
            f"{without('te_flax fp8 capacity') / without(base):.3f}, te_flax FP8 / Flax FP8 "
            f"{without('te_flax fp8 capacity') / without('flax fp8 capacity'):.3f}.",
            f"- Ragged / capacity (FP8): {ragged['bytes'] / capacity['bytes']:.2f}x the bytes, "
            f"{ragged['flops'] / capacity['flops']:.2f}x the FLOPs: XLA:GPU expands "
            "`ragged_dot` into GEMMs over every expert (each row meets all "
            f"{h100_case.experts} kernels, masked).",
            "",
        ]
    lines += [
        f"## CPU: {cpu_case.describe()}",
        "",
        f"Median of {repeats} interleaved rounds after one warm-up round; FP8 GEMMs are "
        "emulated on a CPU (float8 operands converted for float32 GEMMs), so FP8 costs more "
        "there, not less.",
        "",
        "| variant | step ms (median) | spread |",
        "| --- | --- | --- |",
    ]
    for variant in VARIANTS:
        s = stats(times[variant])
        lines.append(f"| {variant} | {s['median'] * 1e3:.1f} | {s['spread']:.2f} |")
    lines += [
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
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    command = "JAX_PLATFORMS=cpu python -m bench.moe" + (" --quick" if quick else "")
    text = report(
        QUICK_CPU_CASE if quick else CPU_CASE,
        QUICK_H100_CASE if quick else H100_CASE,
        repeats=3 if quick else 7,
        command=command,
    )
    print(text)
    if not quick:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
