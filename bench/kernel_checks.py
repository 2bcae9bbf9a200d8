"""What the first-use check of the kernels costs a first step, deviceless for an H100.

On a GPU, the first trace of each kernel configuration in a process runs it once on a small
problem beside its XLA stage (``te_flax/_ops/kernels/first_use.py``). That adds to the first
step, and only to it: two small programs compiled and run per configuration. Without a GPU
the runs cannot be timed, so this compiles what a GPU process would, deviceless for the H100
of ``tests/data``: it traces a few training steps with every kernel on
(``pallas_kernels("1")``) and the check on (``kernel_checks("1")``), takes each probe the
trace asks for instead of running it, and times the H100 compile of its kernel and of its XLA
stage; the run time is a MODEL (operand and result bytes at 3.35 TB/s and 5 us per program,
both far above what a GPU takes for problems of a few hundred KB). Beside it, the step's own
trace and H100 compile with the kernels, which the first step pays anyway::

    JAX_PLATFORMS=cpu python -m bench.kernel_checks   # writes bench/RESULTS_kernel_checks.md
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from te_flax._ops.kernels import first_use, pallas_kernels  # noqa: E402
from te_flax.dense import grouped_dense, grouped_quantizer_set  # noqa: E402
from te_flax.quantize import DelayedScaling, Float8BlockScaling, QuantizerFactory  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS_kernel_checks.md")
TARGET_CONFIG = Path(__file__).parents[1] / "tests" / "data" / "h100_sxm.gpu_target_config.txtpb"
HBM_BYTES_PER_S, LAUNCH_S = 3.35e12, 5e-6


def _h100_sharding() -> jax.sharding.NamedSharding:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _specs(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _probe_cost(probe: first_use.Probe, sharding) -> dict:
    """The H100 compile time of a probe's kernel and XLA stage, and its modelled run time."""
    operands = probe.operands()
    specs = _specs(operands, sharding)
    start = time.perf_counter()
    kernel = jax.jit(partial(probe.kernel, interpret=False)).lower(*specs).compile()
    xla = jax.jit(probe.xla).lower(*specs).compile()
    compile_s = time.perf_counter() - start
    results = jax.eval_shape(probe.xla, *operands)
    moved = sum(np.asarray(a).nbytes for a in jax.tree.leaves(operands))
    moved += sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(results))
    del kernel, xla
    # Both programs read the operands and write the results once, plus a copy each way.
    run_s = 2 * (moved / HBM_BYTES_PER_S + LAUNCH_S) + 2 * moved / 25e9
    return {"compile_s": compile_s, "run_s": run_s, "bytes": moved}


def _layer_step(module, x):
    variables = nn.unbox(jax.eval_shape(lambda x: module.init(jax.random.key(0), x), x))

    def loss(variables, x):
        y = module.apply(variables, x)
        return jnp.mean(jnp.square((y[0] if isinstance(y, tuple) else y).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (variables, x)


def _moe_step(tokens: int, hidden: int, ffn: int, experts: int):
    state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=DelayedScaling()), experts)
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((experts, hidden, ffn), jnp.float32)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)

    def loss(x, kernel, sizes):
        out = grouped_dense(x, kernel, sizes, quantizer_set=state)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (x, kernel, sizes)


STEPS = {
    "LayerNormMLP, SwiGLU, hidden 4096, ffn 14336, 4096 tokens, delayed": lambda: _layer_step(
        te_nn.LayerNormMLP(
            intermediate_dim=14336,
            activations=("silu", "linear"),
            layernorm_type="rmsnorm",
            recipe=DelayedScaling(),
            dtype=jnp.bfloat16,
        ),
        jax.ShapeDtypeStruct((2, 2048, 4096), jnp.bfloat16),
    ),
    "DenseGeneral 4096 -> 4096, 4096 tokens, blockwise FP8": lambda: _layer_step(
        te_nn.DenseGeneral(features=4096, recipe=Float8BlockScaling(), dtype=jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 2048, 4096), jnp.bfloat16),
    ),
    "grouped_dense, 8 experts, hidden 4096, ffn 14336, 16384 rows, delayed": lambda: _moe_step(
        16384, 4096, 14336, 8
    ),
}


def measure(name: str, sharding) -> dict:
    """One step: its configurations' probe costs, and the step's own trace and H100 compile."""
    step, args = STEPS[name]()
    probes: list[first_use.Probe] = []

    def record(probe: first_use.Probe, interpret: bool) -> None:
        probes.append(probe)

    first_use.forget()
    recording = mock.patch.object(first_use, "_disagreement", record)
    with recording, pallas_kernels("1"), first_use.kernel_checks("1"):
        jax.jit(step).lower(*args)  # traced on this host: records the probes
    kernels = [name for name, _ in first_use.checked()]  # in the order they were checked
    first_use.forget()
    costs = [
        {"configuration": f"{kernel}: {probe.configuration}", **_probe_cost(probe, sharding)}
        for kernel, probe in zip(kernels, probes, strict=True)
    ]
    start = time.perf_counter()
    with pallas_kernels("auto", assume_gpu=True):
        step.lower(*_specs(args, sharding)).compile()
    return {"name": name, "probes": costs, "step_s": time.perf_counter() - start}


def main() -> None:
    sharding = _h100_sharding()
    lines = [
        "# The first-use check of the kernels: its cost to a first step (deviceless H100)",
        "",
        "Command: `JAX_PLATFORMS=cpu python -m bench.kernel_checks` (jax "
        f"{jax.__version__}; `bench/kernel_checks.py` says what it measures). Compile times on "
        "a shared 2-core host; run times a MODEL, not a GPU measurement.",
        "",
        "| step | configurations checked | probe compiles (s) | probe runs (ms, model) "
        "| probe bytes (MB) | the step's own trace + compile (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    details = []
    for name in STEPS:
        result = measure(name, sharding)
        probes = result["probes"]
        compile_s = sum(p["compile_s"] for p in probes)
        run_ms = 1e3 * sum(p["run_s"] for p in probes)
        moved = sum(p["bytes"] for p in probes) / 1e6
        lines.append(
            f"| {name} | {len(probes)} | {compile_s:.2f} | {run_ms:.3f} | {moved:.2f} "
            f"| {result['step_s']:.1f} |"
        )
        print(lines[-1], flush=True)
        details += [f"- {name}:"] + [
            f"  - {p['configuration']}: compile {p['compile_s']:.2f} s, {p['bytes'] / 1e6:.2f} MB"
            for p in probes
        ]
    RESULTS.write_text("\n".join([*lines, "", "Each configuration:", "", *details, ""]))


if __name__ == "__main__":
    main()
