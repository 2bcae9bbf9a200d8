"""The Pallas kernels in programs partitioned over eight H100s, checked with a deviceless compile.

One FP8 (delayed scaling) training step of a Linen ``LayerNormMLP`` (SwiGLU-shaped gated
activation, bf16 activations, float32 parameters) is compiled for a ``1x1x8`` H100 topology
under the shipped rule sets. Under ``"auto"`` the partitioned program keeps the kernels of the
one-GPU program (each runs on every device's block), and its collectives are those of the same
program with the XLA stages (``"0"``): the same gathers of the same float8 and float32 blocks,
the same reductions of every tensor; only the scalar amaxes' all-reduces may be grouped
otherwise.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from jax.experimental import topologies
from jax.sharding import NamedSharding

import te_flax.linen as te_nn
from te_flax._ops.kernels import pallas_kernels
from te_flax.quantize import DelayedScaling
from te_flax.sharding import load_axis_rules, make_mesh, with_logical_constraint
from tests.gpu_target import TARGET_CONFIG
from tests.test_gpu_compile_fsdp import _unboxed
from tests.test_kernels_sharded import tensor_collectives

pytestmark = [pytest.mark.gpu_compile, pytest.mark.triton_kernels]

DEVICES = 8
BATCH, SEQ, HIDDEN, INTERMEDIATE = 8, 64, 256, 512
MESH_SHAPES = {
    "dp": {"data": 8},
    "fsdp": {"fsdp": 8},
    "tp": {"tensor": 8},
    "tp_sp": {"tensor": 8},
    "dp_fsdp_tp": {"data": 2, "fsdp": 2, "tensor": 2},
}
TRITON = '"__gpu$xla.gpu.triton"'
_KERNEL_NAME = re.compile(r"(te_flax_\w+)")


@functools.cache
def step_hlo(rule_set: str, switch: str, devices: int = DEVICES) -> str:
    """The optimized HLO of one training step (loss and gradients) on ``devices`` H100s."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology=f"1x1x{devices}"
    )
    mesh = make_mesh(MESH_SHAPES[rule_set] if devices > 1 else {}, devices=topology.devices)
    rules = load_axis_rules(rule_set)
    norm_axes = ("batch", "length" if rule_set == "tp_sp" else None, None)
    model = te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE,
        activations=("silu", "linear"),
        recipe=DelayedScaling(),
        dtype=jnp.bfloat16,
        layernorm_input_axes=norm_axes,
        dot_1_input_axes=("batch", None, None),
        dot_2_input_axes=("batch", None, "act_mlp"),
    )
    x_shape = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16)
    # A CPU host: "auto" chooses the kernels as a process with GPUs does.
    with (
        jax.set_mesh(mesh),
        nn.logical_axis_rules(rules),
        pallas_kernels(switch, assume_gpu=True),
    ):
        boxed = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x_shape)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        variables = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            _unboxed(boxed),
            shardings,
        )
        x_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(norm_axes, rules))
        x = jax.ShapeDtypeStruct(x_shape.shape, x_shape.dtype, sharding=x_sharding)

        def loss(variables, x):
            out, _ = model.apply(variables, x)
            out = with_logical_constraint(out, norm_axes)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        step = jax.jit(jax.value_and_grad(loss))
        return step.lower(variables, x).compile().as_text()


def kernel_names(hlo_text: str) -> list[str]:
    return sorted(
        _KERNEL_NAME.search(line).group(1) for line in hlo_text.splitlines() if TRITON in line
    )


# dp_fsdp_tp has the dp, fsdp and tp rule sets' axes in one program (2 x 2 x 2); dp.yaml and
# tp.yaml alone pass the same check (left out for the suite's time).
@pytest.mark.parametrize("rule_set", ["fsdp", "tp_sp", "dp_fsdp_tp"])
def test_partitioned_step_keeps_the_kernels_and_the_collectives(rule_set):
    one_gpu = kernel_names(step_hlo("dp", "auto", devices=1))
    assert one_gpu, "no kernel on one GPU: the switch did not choose them"
    kernels, xla_stages = step_hlo(rule_set, "auto"), step_hlo(rule_set, "0")
    assert kernel_names(kernels) == one_gpu
    assert not kernel_names(xla_stages)
    (tensors, small), (xla_tensors, xla_small) = (
        tensor_collectives(kernels),
        tensor_collectives(xla_stages),
    )
    gathers = [c for c in tensors if c[0] == "all-gather"]
    assert gathers == [c for c in xla_tensors if c[0] == "all-gather"], (tensors, xla_tensors)
    # Every reduction of a tensor the XLA stages' program has, in the same element type; none
    # added (a norm-scale gradient may be reduce-scattered where XLA all-reduces it).
    reductions = Counter((t, d) for k, t, d in tensors if k != "all-gather")
    xla_reductions = Counter((t, d) for k, t, d in xla_tensors if k != "all-gather")
    vectors = lambda counter: {key for key in counter if "," not in key[1]}  # noqa: E731
    assert not (reductions - xla_reductions).keys() - vectors(reductions), (tensors, xla_tensors)
    assert {t for t, _ in reductions} <= {t for t, _ in xla_reductions}
    assert small <= xla_small | {"f32"}


def test_tensor_parallel_dgrad_scale_needs_no_pass_after_its_all_reduce():
    """Under tp the first GEMM's dgrad contracts the sharded intermediate axis: its partial
    sums are all-reduced, and XLA folds the FP8 GEMM's scale into its alpha only when the
    multiply follows the GEMM directly. The norm backward kernel takes the scale instead, so
    the all-reduced gradient goes to the kernel as it is, with no pass of its own."""
    entry = step_hlo("tp", "auto")
    entry = entry[entry.index("\nENTRY") :]
    instruction = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = (\S+) ([\w\-]+)\(([^)]*)\)")
    rows = [m.groups() for line in entry.splitlines() if (m := instruction.match(line))]
    reduced = {
        name
        for name, result, opcode, _ in rows
        if opcode == "all-reduce-done" and result.startswith(f"bf16[{BATCH},{SEQ},{HIDDEN}]")
    }
    assert reduced, "no all-reduce of the norm-output gradient: not the tp program"
    users = [
        (opcode, result)
        for _, result, opcode, operands in rows
        if reduced & {operand.strip() for operand in operands.split(",")}
    ]
    assert users and all(opcode == "bitcast" for opcode, _ in users), users
