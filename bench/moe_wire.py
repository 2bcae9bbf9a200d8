"""The bytes of MoEBlock's expert-parallel all-to-alls: FP8 on the dispatch wire against BF16.

One training step of a ``MoEBlock`` (gradients of the parameters and of the input, bfloat16
activations, float32 parameters) under the ``ep`` rules on 8 devices (``data`` = the expert
axis of 2, 4 or 8 ways, ``fsdp`` the rest) is compiled twice per shape: without FP8 (the BF16
program) and with delayed scaling (the FP8 program, ``fp8_dispatch=True``, the default). Its
all-to-alls are read from the compiled HLO (``te_flax._tools.hlo.parse_collectives``) and
summed per part, by the named scope each was traced in: the dispatch (the token rows and their
expert ids; under FP8 the float8 rows and their blocks' amaxes), the dispatch's gradient (the
backward's transpose of it), the combine and the combine's gradient. Bytes are the operand
bytes of one device's all-to-all.

Compiled for XLA:CPU (8 CPU devices) and, where the ``gpu-compile`` extra is installed, for 8
H100s without a GPU (deviceless, the target of ``tests/gpu_target.py``). XLA:CPU widens a
16-bit float collective to float32 (and a float8 one to float16, which is why the wire moves
the float8 bits as uint8), so its BF16 program moves 4 bytes per element; the H100 program
keeps 2. Bytes of the compiled programs, no timing.

Run ``python -m bench.moe_wire``; it writes ``bench/RESULTS_moe_wire.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_gpu_enable_triton_gemm=false",
    ]
).strip()

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_flax.linen as te_nn
from te_flax._tools.hlo import parse_collectives
from te_flax.quantize import DelayedScaling
from te_flax.sharding import load_axis_rules, make_mesh

DEVICES = 8
TARGET = Path(__file__).parents[1] / "tests" / "data" / "h100_sxm.gpu_target_config.txtpb"
PARTS = ("dispatch", "dispatch gradient", "combine", "combine gradient")


@dataclasses.dataclass(frozen=True)
class WireCase:
    """A MoE block and its batch."""

    name: str
    experts: int
    topk: int
    hidden: int
    ffn: int
    batch: int
    seq: int

    def layer(self, fp8: bool) -> te_nn.MoEBlock:
        return te_nn.MoEBlock(
            num_experts=self.experts,
            num_experts_per_tok=self.topk,
            intermediate_dim=self.ffn,
            dtype=jnp.bfloat16,
            recipe=DelayedScaling() if fp8 else None,
        )


CASES = (
    WireCase("small block", experts=8, topk=2, hidden=256, ffn=512, batch=16, seq=32),
    WireCase("DeepSeek-V3-like", experts=64, topk=8, hidden=7168, ffn=2048, batch=8, seq=128),
)


def wire_bytes(hlo_text: str) -> dict[str, float]:
    """One device's all-to-all operand bytes per part (``PARTS``) of a compiled MoE step."""
    totals = dict.fromkeys(PARTS, 0.0)
    for collective in parse_collectives(hlo_text):
        if collective.kind != "all-to-all":
            continue
        scope = next(s for s in ("dispatch", "combine") if f"/{s}/" in collective.op_name)
        backward = "transpose(" in collective.op_name
        totals[f"{scope} gradient" if backward else scope] += collective.bytes
    return totals


def step_hlo(case: WireCase, fp8: bool, ways: int, devices: Sequence[Any] | None = None) -> str:
    """The optimized HLO of one training step of ``case`` with ``ways``-way experts."""
    layer = case.layer(fp8)
    mesh = make_mesh({"data": ways, "fsdp": DEVICES // ways}, devices=devices)
    rules = load_axis_rules("ep")
    x_shape = jax.ShapeDtypeStruct((case.batch, case.seq, case.hidden), jnp.bfloat16)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda x: layer.init(jax.random.key(0), x), x_shape)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        is_box = lambda leaf: isinstance(leaf, nn.Partitioned)  # noqa: E731
        unboxed = jax.tree.map(lambda b: b.value if is_box(b) else b, boxed, is_leaf=is_box)
        variables = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            unboxed,
            shardings,
        )
        batch = nn.logical_to_mesh_sharding(jax.sharding.PartitionSpec("batch"), mesh, rules)
        x = jax.ShapeDtypeStruct(x_shape.shape, x_shape.dtype, sharding=batch)

        def loss(variables: Any, x: jax.Array) -> jax.Array:
            out, aux_loss = layer.apply(variables, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32))) + aux_loss

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return step.lower(variables, x).compile().as_text()


def h100_devices() -> Sequence[Any] | None:
    """Eight deviceless H100s, or None without the ``gpu-compile`` extra."""
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            platform="cuda", target_config=TARGET.read_text(), topology=f"1x1x{DEVICES}"
        )
    except Exception:  # no CUDA plugin: the H100 rows are left out
        return None
    return list(topology.devices)


def _kb(value: float) -> str:
    return f"{value / 1e3:,.1f}"


def main() -> None:
    targets: dict[str, Sequence[Any] | None] = {"CPU": None}
    if (gpus := h100_devices()) is not None:
        targets["H100 (deviceless)"] = gpus
    lines = [
        "# FP8 on the expert-parallel wire: the all-to-all bytes of a MoEBlock step",
        "",
        f"Command: `python -m bench.moe_wire` (jax {jax.__version__}). One training step "
        "(parameter and input gradients, bfloat16 activations) under the `ep` rules on 8 devices; "
        "kB of one device's all-to-all operands per part, read from the compiled HLO. BF16: no "
        "recipe; FP8: `DelayedScaling()` with `fp8_dispatch=True` (the default). XLA:CPU "
        "widens bfloat16 collectives to float32, so its BF16 dispatch is 4 bytes per element; "
        "the H100 program (deviceless compile) keeps 2. Compiled programs, not timings.",
        "",
        "| target | block | EP | dispatch BF16 | dispatch FP8 | FP8 / BF16 | dispatch gradient "
        "BF16 / FP8 | combine BF16 / FP8 | combine gradient BF16 / FP8 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for target, devices in targets.items():
        for case in CASES:
            for ways in (2, 4, 8):
                bf16 = wire_bytes(step_hlo(case, False, ways, devices))
                fp8 = wire_bytes(step_hlo(case, True, ways, devices))
                pairs = [f"{_kb(bf16[p])} / {_kb(fp8[p])}" for p in PARTS[1:]]
                ratio = fp8["dispatch"] / bf16["dispatch"]
                lines.append(
                    f"| {target} | {case.name} | {ways} | {_kb(bf16['dispatch'])} | "
                    f"{_kb(fp8['dispatch'])} | {ratio:.3f} | {' | '.join(pairs)} |"
                )
                print(lines[-1], flush=True)
    lines += ["", "Blocks (experts, top-k, hidden, FFN per expert, batch x sequence):", ""]
    lines += [
        f"- {c.name}: {c.experts}, {c.topk}, {c.hidden}, {c.ffn}, {c.batch} x {c.seq}"
        for c in CASES
    ]
    text = "\n".join(lines) + "\n"
    Path(__file__).with_name("RESULTS_moe_wire.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
