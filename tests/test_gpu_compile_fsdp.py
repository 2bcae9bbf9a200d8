"""FSDP on XLA:GPU, checked with a deviceless compile for four H100s on one host (no GPU needed).

One FP8 training step of a Linen ``LayerNormMLP`` (bf16 activations, float32 parameters) is
compiled for a ``1x1x4`` H100 topology under the ``fsdp`` rule set: the kernels' ``embed`` axis
and the batch are split four ways over the ``fsdp`` mesh axis. Each device quantizes its own
kernel shard, so the all-gathers that assemble the kernels for the GEMMs move float8
(``f8e4m3fn``), a quarter of the float32 bytes; the kernel gradients come back reduce-scattered.
Without FP8 the same step gathers the kernels in bf16, which shows that the HLO reading below
sees the difference.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.sharding import load_axis_rules, make_mesh
from te_flax.training import apply_gradients, init_optimizer, merge_fp8_state
from tests.gpu_target import TARGET_CONFIG
from tests.test_gpu_compile import (
    _DEFINITION,
    FP8_GEMM,
    NON_FP8_GEMMS,
    assert_no_other_gemm,
    parse_gemms,
)

pytestmark = pytest.mark.gpu_compile

FSDP = 4
TOPOLOGY = f"1x1x{FSDP}"  # one slice, one host, four GPUs
BATCH, SEQ, HIDDEN, INTERMEDIATE = 8, 256, 1024, 4096
KERNEL_ELEMENTS = HIDDEN * INTERMEDIATE  # both kernels: [hidden, 1, intermediate], its transpose
ACTIVATION_AXES = ("batch", None, None)
RECIPES = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "none": None,
}


# ----------------------------------------------------------------------------- reading the HLO


@dataclasses.dataclass(frozen=True)
class Collective:
    """One all-gather or reduce-scatter of the optimized HLO (sync or async start)."""

    kind: str  # "all-gather" or "reduce-scatter"
    operands: tuple[tuple[str, tuple[int, ...]], ...]  # (element type, dims) of each input


_COLLECTIVE = re.compile(r"\s(all-gather|reduce-scatter)(?:-start)?\(([^)]*)\)")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")


def parse_collectives(hlo_text: str) -> list[Collective]:
    """The all-gathers and reduce-scatters of an optimized HLO module, with their input types.

    Combined collectives (one op moving several arrays) are one entry with several operands.
    """
    types = {}
    for line in hlo_text.splitlines():
        if match := _DEFINITION.match(line):
            name, element_type, dims = match.groups()
            types[name] = (element_type, tuple(int(d) for d in dims.split(",") if d))
    collectives = []
    for line in hlo_text.splitlines():
        if match := _COLLECTIVE.search(line):
            kind, operands = match.groups()
            names = _OPERAND_NAME.findall(operands)
            collectives.append(Collective(kind, tuple(types[name] for name in names)))
    return collectives


def moved_arrays(collectives: list[Collective], kind: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array that a collective of ``kind`` takes as input, one entry per operand."""
    return [operand for c in collectives if c.kind == kind for operand in c.operands]


def matrices(arrays):
    """The arrays of rank 2 or more (kernels and activations, not norm scales or scalars)."""
    return [(t, dims) for t, dims in arrays if len(dims) >= 2]


def kernel_sized(arrays, shards: int = 1):
    """The arrays among ``arrays`` as large as a kernel split into ``shards`` parts."""
    return [(t, dims) for t, dims in arrays if math.prod(dims) * shards == KERNEL_ELEMENTS]


# ----------------------------------------------------------------------------- compiling


def _model(recipe: str) -> te_nn.LayerNormMLP:
    make_recipe = RECIPES[recipe]
    return te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE,
        activations=("gelu",),
        recipe=None if make_recipe is None else make_recipe(),
        dtype=jnp.bfloat16,
        layernorm_input_axes=ACTIVATION_AXES,
        dot_1_input_axes=ACTIVATION_AXES,
        dot_2_input_axes=ACTIVATION_AXES,
    )


def _unboxed(tree):
    is_box = lambda leaf: isinstance(leaf, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda leaf: leaf.value if is_box(leaf) else leaf, tree, is_leaf=is_box)


@functools.cache
def fsdp_step_hlo(recipe: str) -> str:
    """The optimized HLO of one FSDP training step (loss, grads, SGD, FP8 update) on 4 H100s."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology=TOPOLOGY
    )
    mesh = make_mesh({"fsdp": FSDP}, devices=topology.devices)
    rules = load_axis_rules("fsdp")
    model = _model(recipe)
    tx = optax.sgd(1e-2)
    x_shape = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x_shape)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        variables = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            _unboxed(boxed),
            shardings,
        )
        assert variables["params"]["wi_kernel"].sharding.spec == PartitionSpec("fsdp", None, None)
        assert variables["params"]["wo_kernel"].sharding.spec == PartitionSpec(None, "fsdp")
        x_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(ACTIVATION_AXES, rules))
        x = jax.ShapeDtypeStruct(x_shape.shape, x_shape.dtype, sharding=x_sharding)

        def step(variables, x):
            def loss_fn(variables):
                out, _ = model.apply(merge_fp8_state(variables), x)
                # A loss whose gradient depends on the output, so that no GEMM folds away.
                return jnp.mean(jnp.square(out.astype(jnp.float32)))

            loss, grads = jax.value_and_grad(loss_fn)(variables)
            new_variables, _ = apply_gradients(tx, variables, grads, init_optimizer(tx, variables))
            return new_variables, loss

        out_shardings = (jax.tree.map(lambda leaf: leaf.sharding, variables), None)
        lowered = jax.jit(step, out_shardings=out_shardings).lower(variables, x)
        return lowered.compile().as_text()


fp8_recipes = pytest.mark.parametrize("recipe", ["delayed", "current"])


# ----------------------------------------------------------------------------- FP8 under FSDP


@fp8_recipes
def test_fsdp_fp8_step_keeps_six_fp8_gemms(recipe):
    hlo_text = fsdp_step_hlo(recipe)
    gemms = parse_gemms(hlo_text)
    assert [g.target for g in gemms] == [FP8_GEMM] * 6, gemms
    assert_no_other_gemm(hlo_text, allowed=FP8_GEMM)


@fp8_recipes
def test_fsdp_kernels_are_all_gathered_in_float8(recipe):
    gathered = matrices(moved_arrays(parse_collectives(fsdp_step_hlo(recipe)), "all-gather"))
    # Only kernel shards are gathered (the batch-split activations never are), and every one
    # of them in e4m3: never the float32 parameter or a bf16 copy of it.
    assert gathered, "no kernel all-gather at all: the kernels were not sharded"
    assert kernel_sized(gathered, shards=FSDP) == gathered, gathered
    assert {t for t, _ in gathered} == {"f8e4m3fn"}, gathered
    # Both kernels at least (the backward's dgrad GEMMs may gather them again).
    assert len(gathered) >= 2, gathered


@fp8_recipes
def test_fsdp_kernel_gradients_are_reduce_scattered_in_float32(recipe):
    scattered = matrices(moved_arrays(parse_collectives(fsdp_step_hlo(recipe)), "reduce-scatter"))
    # The wgrad GEMMs contract the split batch: the full-size partial sums of both kernels'
    # gradients are summed and split again, each device keeping its shard, in float32.
    assert kernel_sized(scattered) == scattered, scattered
    assert sorted(t for t, _ in scattered) == ["f32", "f32"], scattered


# ----------------------------------------------------------------------------- without FP8


def test_without_fp8_the_same_step_gathers_bf16_kernels():
    hlo_text = fsdp_step_hlo("none")
    gemms = parse_gemms(hlo_text)
    assert len(gemms) == 6 and all(g.target in NON_FP8_GEMMS for g in gemms), gemms
    gathered = matrices(moved_arrays(parse_collectives(hlo_text), "all-gather"))
    assert gathered and kernel_sized(gathered, shards=FSDP) == gathered, gathered
    assert {t for t, _ in gathered} == {"bf16"}, gathered
