"""Gradient accumulation with and without quantizing the kernels once per step.

``python -m bench.accumulation`` prints one row per number of microbatches k and setting of
``te_flax.accumulate.accumulate_gradients(..., quantize_once=...)``: the gradient part of one
FP8 (delayed scaling) training step of a bf16 ``LayerNormMLP`` (the optimizer update, the same
either way, is left out):

- kernel quantizations per step, counted in the optimized HLO: each instruction that writes a
  float8 copy of a kernel counts once, or k times inside the microbatch loop; on XLA:CPU and in
  a deviceless H100 compile (``--xla_gpu_enable_triton_gemm=false``, as ``bench/__main__.py``
  sets it);
- the CPU step time (median of interleaved rounds; a small layer, as FP8 GEMMs are emulated
  on CPUs);
- the bytes the H100 program accesses per step: each instruction of the entry computation and
  of the loop body reads its operands once and writes its result once (the accounting of
  ``bench.h100.instruction_bytes``), the body's bytes counted k times. (XLA's cost analysis
  counts a while loop's body once, whatever its trip count.)

``python -m bench.accumulation --transformer [--hidden 8192]``: the same bytes per step for
two TransformerLayers (RMSNorm, SwiGLU MLP of 4 x hidden, cuDNN attention, bf16 parameters,
microbatches of 8 x 512 tokens) on one deviceless H100, FP8 (delayed scaling, the kernels
quantized once per step) against BF16, for each k. An FP8 step quantizes every weight from
bf16 into two float8 layouts; with few tokens per step that costs more than its GEMMs save,
and accumulating microbatches spreads it over more tokens.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench import h100  # noqa: E402
from bench.timing import interleaved, stats  # noqa: E402
from te_flax.accumulate import accumulate_gradients  # noqa: E402
from te_flax.quantize import DelayedScaling  # noqa: E402
from te_flax.training import merge_fp8_state  # noqa: E402

__all__ = ["kernel_quantizations", "main", "step_bytes"]

# (tokens per microbatch as batch x sequence, hidden, intermediate): the CPU case is small
# enough to time on a few cores; the H100 case is a transformer MLP's size.
CPU_SIZES = ((2, 32), 256, 1024)
H100_SIZES = ((2, 128), 1024, 4096)
MICROBATCHES = (1, 2, 4, 8)

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%([^\s,}]+)")
_CALLS = re.compile(r"calls=%([^\s,}]+)")
_FLOAT8_CONVERT = re.compile(r"= (?:f8e4m3fn|f8e5m2)\[([0-9,]*)\]\S* convert\(")


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if match := _COMPUTATION.match(line):
            current = computations.setdefault(match[1], [])
            if line.startswith("ENTRY"):
                entry = match[1]
        elif current is not None and line.strip() and line.strip() != "}":
            current.append(line)
    return computations, entry


def _elements(dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d)


def kernel_quantizations(hlo_text: str, kernel_elements: int, microbatches: int) -> int:
    """How many times per step the program writes a float8 copy of a kernel.

    An instruction of the entry computation or of a while loop's body (the microbatch loop,
    run ``microbatches`` times) counts when it converts an array of ``kernel_elements`` to
    float8, itself or inside its fusion. A fusion that writes the float8 kernel in two layouts
    (the GEMM's and its transpose) counts once: it reads the kernel once.
    """
    computations, entry = _computations(hlo_text)

    def quantizes(lines: list[str], depth: int = 0) -> bool:
        for line in lines:
            match = _FLOAT8_CONVERT.search(line)
            if match and _elements(match[1]) == kernel_elements:
                return True
            called = _CALLS.search(line)
            if called and depth < 4 and quantizes(computations.get(called[1], []), depth + 1):
                return True
        return False

    total = 0
    for name, repeats in _runs(computations, entry, microbatches):
        for line in computations.get(name, []):
            if " while(" in line:
                continue
            if quantizes([line]):
                total += repeats
    return total


def _runs(
    computations: dict[str, list[str]], entry: str, microbatches: int
) -> list[tuple[str, int]]:
    """Each computation that runs per step and how often: the entry once, every while loop's
    body once per microbatch."""
    bodies = {
        body
        for lines in computations.values()
        for line in lines
        for body in _WHILE_BODY.findall(line)
    }
    return [(entry, 1)] + [(body, microbatches) for body in sorted(bodies)]


def step_bytes(hlo_text: str, microbatches: int) -> float:
    """Bytes read and written per step: the entry computation once, the loop body k times."""
    computations, entry = _computations(hlo_text)
    return sum(
        repeats * sum(row["bytes"] for row in h100.computation_rows(computations.get(name, [])))
        for name, repeats in _runs(computations, entry, microbatches)
    )


def _model(intermediate: int) -> te_nn.LayerNormMLP:
    return te_nn.LayerNormMLP(
        intermediate_dim=intermediate,
        activations=("gelu",),
        recipe=DelayedScaling(),
        dtype=jnp.bfloat16,
    )


def _grad_step(model: te_nn.LayerNormMLP, quantize_once: bool):
    """The gradient part of a training step: loss, mean gradients and merged FP8 state."""

    def loss_fn(variables, x):
        out, _ = model.apply(merge_fp8_state(variables), x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return partial(accumulate_gradients, loss_fn, quantize_once=quantize_once)


def _problem(sizes, microbatches: int):
    (batch, seq), hidden, intermediate = sizes
    model = _model(intermediate)
    x_shape = (microbatches, batch, seq, hidden)
    variables = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros(x_shape[1:], jnp.bfloat16))
    )
    return model, variables, x_shape


def _h100_row(microbatches: int, quantize_once: bool) -> tuple[int, float]:
    _, hidden, intermediate = H100_SIZES
    model, variables, x_shape = _problem(H100_SIZES, microbatches)
    abstract = partial(jax.ShapeDtypeStruct, sharding=_h100_sharding())
    variables = jax.tree.map(lambda v: abstract(v.shape, v.dtype), variables)
    x = abstract(x_shape, jnp.bfloat16)
    compiled = jax.jit(_grad_step(model, quantize_once)).lower(variables, x).compile()
    hlo_text = compiled.as_text()
    count = kernel_quantizations(hlo_text, hidden * intermediate, microbatches)
    return count, step_bytes(hlo_text, microbatches)


def _h100_sharding() -> jax.sharding.NamedSharding:
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=h100.TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _cpu_rows(microbatches: int, repeats: int) -> dict[bool, tuple[int, float]]:
    _, hidden, intermediate = CPU_SIZES
    model, _, x_shape = _problem(CPU_SIZES, microbatches)
    variables = model.init(jax.random.key(0), jnp.zeros(x_shape[1:], jnp.bfloat16))
    x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32).astype(jnp.bfloat16)
    runners, counts = {}, {}
    for quantize_once in (False, True):
        compiled = jax.jit(_grad_step(model, quantize_once)).lower(variables, x).compile()
        counts[quantize_once] = kernel_quantizations(
            compiled.as_text(), hidden * intermediate, microbatches
        )
        runners[quantize_once] = partial(compiled, variables, x)
    times = interleaved(runners, repeats=repeats, warmup=2)
    return {q: (counts[q], stats(times[q])["median"]) for q in (False, True)}


def transformer_step_bytes(hidden: int, microbatches: int, fp8: bool) -> float:
    """Bytes per step of ``accumulate_gradients`` over two TransformerLayers (module docstring)."""
    import flax.linen as nn

    from bench.te_peer import Shape, peer_layer
    from te_flax._ops.kernels import pallas_kernels

    recipe = DelayedScaling() if fp8 else None
    batch, seq = 8, 512
    shape = Shape(batch * seq, seq, hidden, 4 * hidden, hidden // 128)

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = peer_layer(te_nn, "TransformerLayer", shape, recipe)(x, deterministic=True)
            return x

    model = Two()
    abstract = partial(jax.ShapeDtypeStruct, sharding=_h100_sharding())
    with pallas_kernels("auto", assume_gpu=True):  # as on a GPU
        one = jax.ShapeDtypeStruct((batch, seq, hidden), jnp.bfloat16)
        variables = jax.eval_shape(lambda x: nn.meta.unbox(model.init(jax.random.key(0), x)), one)
        variables = jax.tree.map(lambda v: abstract(v.shape, v.dtype), variables)

        def loss_fn(variables, x):
            out = model.apply(merge_fp8_state(variables), x)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        x = abstract((microbatches, batch, seq, hidden), jnp.bfloat16)
        lowered = jax.jit(partial(accumulate_gradients, loss_fn)).lower(variables, x)
        return step_bytes(lowered.compile().as_text(), microbatches)


def transformer_main(hidden: int) -> None:
    """Prints FP8 against BF16 bytes per step for each number of microbatches."""
    print(f"Two TransformerLayers, hidden {hidden}, microbatches of 8 x 512 tokens, one H100.")
    print("| k | BF16 GB/step | FP8 GB/step | FP8 / BF16 |")
    print("|---|---|---|---|")
    for microbatches in (1, 2, 4):
        bf16 = transformer_step_bytes(hidden, microbatches, fp8=False)
        fp8 = transformer_step_bytes(hidden, microbatches, fp8=True)
        print(f"| {microbatches} | {bf16 / 1e9:.2f} | {fp8 / 1e9:.2f} | {fp8 / bf16:.2f} |")


def main(repeats: int = 15) -> None:
    """Prints the table (see the module docstring)."""
    print(
        f"LayerNormMLP, bf16, DelayedScaling. CPU: tokens/microbatch "
        f"{CPU_SIZES[0][0]}x{CPU_SIZES[0][1]}, hidden {CPU_SIZES[1]}, intermediate "
        f"{CPU_SIZES[2]}. H100 (deviceless): tokens/microbatch {H100_SIZES[0][0]}x"
        f"{H100_SIZES[0][1]}, hidden {H100_SIZES[1]}, intermediate {H100_SIZES[2]}."
    )
    header = (
        "| k | quantize_once | kernel quantizations/step CPU | H100 | CPU step ms "
        "| H100 bytes/step |"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    for microbatches in MICROBATCHES:
        cpu = _cpu_rows(microbatches, repeats)
        for quantize_once in (False, True):
            h100_count, h100_bytes = _h100_row(microbatches, quantize_once)
            count, seconds = cpu[quantize_once]
            print(
                f"| {microbatches} | {quantize_once} | {count} | {h100_count} | "
                f"{seconds * 1e3:.2f} | {h100_bytes / 1e6:.1f} MB |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transformer", action="store_true", help="two TransformerLayers")
    parser.add_argument("--hidden", type=int, default=8192, help="with --transformer")
    args = parser.parse_args()
    if args.transformer:
        transformer_main(args.hidden)
    else:
        main()
