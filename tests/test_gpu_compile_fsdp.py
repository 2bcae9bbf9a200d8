"""FSDP and sequence parallelism on XLA:GPU, checked with a deviceless compile for four H100s on
one host (no GPU needed).

One FP8 training step of a Linen ``LayerNormMLP`` (bf16 activations, float32 parameters) is
compiled for a ``1x1x4`` H100 topology under the ``fsdp`` rule set: the kernels' ``embed`` axis
and the batch are split four ways over the ``fsdp`` mesh axis. Each device quantizes its own
kernel shard, so the all-gathers that assemble the kernels for the GEMMs move float8
(``f8e4m3fn``), a quarter of the float32 bytes; the kernel gradients come back reduce-scattered.
Without FP8 the same step gathers the kernels in bf16, which shows that the HLO reading below
sees the difference.

Under the ``tp_sp`` rule set (tensor 4) the norm input is split along the sequence: the norm
output is quantized on its sequence shard and gathered in ``f8e4m3fn`` for GEMM 1, the output
gradient gathered in ``f8e5m2`` for GEMM 2's backward, and GEMM 2's output and the norm-input
gradient are reduce-scattered back onto the sequence. On both layouts every reduction of a
matrix is a reduce-scatter: no all-reduce of a full-size value is left for each device to
slice its part from.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

import te_flax.linen as te_nn
from te_flax._tools.hlo import FP8_GEMM, NON_FP8_GEMMS, Collective, parse_collectives, parse_gemms
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.sharding import load_axis_rules, make_mesh, with_logical_constraint
from te_flax.training import apply_gradients, init_optimizer, merge_fp8_state
from tests.gpu_target import TARGET_CONFIG
from tests.test_gpu_compile import assert_no_other_gemm

pytestmark = pytest.mark.gpu_compile

FSDP = 4
TOPOLOGY = f"1x1x{FSDP}"  # one slice, one host, four GPUs
BATCH, SEQ, HIDDEN, INTERMEDIATE = 8, 256, 1024, 4096
KERNEL_ELEMENTS = HIDDEN * INTERMEDIATE  # both kernels: [hidden, 1, intermediate], its transpose
ACTIVATION_AXES = ("batch", None, None)
MESH_SHAPES = {"fsdp": {"fsdp": FSDP}, "tp_sp": {"tensor": FSDP}}
# The activations' logical axes: the norm input (and residual), GEMM 1's and GEMM 2's inputs.
LAYOUT_AXES = {
    "fsdp": (ACTIVATION_AXES,) * 3,
    "tp_sp": (
        ("batch", "length", "act_embed"),
        ("batch", None, "act_embed"),
        ("batch", None, "act_mlp"),
    ),
}
ACTIVATION_ELEMENTS = BATCH * SEQ * HIDDEN
RECIPES = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "none": None,
}


# ----------------------------------------------------------------------------- reading the HLO


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


def _model(recipe: str, norm_axes, gemm_1_axes, gemm_2_axes) -> te_nn.LayerNormMLP:
    make_recipe = RECIPES[recipe]
    return te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE,
        activations=("gelu",),
        recipe=None if make_recipe is None else make_recipe(),
        dtype=jnp.bfloat16,
        layernorm_input_axes=norm_axes,
        dot_1_input_axes=gemm_1_axes,
        dot_2_input_axes=gemm_2_axes,
    )


def _unboxed(tree):
    is_box = lambda leaf: isinstance(leaf, nn.Partitioned)  # noqa: E731
    return jax.tree.map(lambda leaf: leaf.value if is_box(leaf) else leaf, tree, is_leaf=is_box)


def fsdp_step_hlo(recipe: str) -> str:
    """The optimized HLO of one FSDP training step (loss, grads, SGD, FP8 update) on 4 H100s."""
    return sharded_step_hlo("fsdp", recipe)


@functools.cache
def sharded_step_hlo(layout: str, recipe: str) -> str:
    """The optimized HLO of one training step on 4 H100s under the ``fsdp`` or ``tp_sp`` rules."""
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology=TOPOLOGY
    )
    mesh = make_mesh(MESH_SHAPES[layout], devices=topology.devices)
    rules = load_axis_rules(layout)
    norm_axes, gemm_1_axes, gemm_2_axes = LAYOUT_AXES[layout]
    model = _model(recipe, norm_axes, gemm_1_axes, gemm_2_axes)
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
        if layout == "fsdp":
            wi_spec, wo_spec = PartitionSpec("fsdp", None, None), PartitionSpec(None, "fsdp")
        else:
            wi_spec, wo_spec = PartitionSpec(None, None, "tensor"), PartitionSpec("tensor", None)
        assert variables["params"]["wi_kernel"].sharding.spec == wi_spec
        assert variables["params"]["wo_kernel"].sharding.spec == wo_spec
        x_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(norm_axes, rules))
        x = jax.ShapeDtypeStruct(x_shape.shape, x_shape.dtype, sharding=x_sharding)

        def step(variables, x):
            def loss_fn(variables):
                out, _ = model.apply(merge_fp8_state(variables), x)
                # The output is the residual stream, laid out as the norm input.
                out = with_logical_constraint(out, norm_axes)
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


def test_fsdp_fp8_step_reduces_no_matrix_with_an_all_reduce():
    collectives = parse_collectives(fsdp_step_hlo("delayed"))
    # Only the amaxes and the loss are all-reduced: every gradient (vectors too, as their
    # parameters are split) is reduce-scattered.
    reduced = moved_arrays(collectives, "all-reduce")
    assert all(len(dims) <= 1 and math.prod(dims) < 16 for _, dims in reduced), reduced
    assert {c.kind for c in collectives} <= {"all-gather", "reduce-scatter", "all-reduce"}


# ----------------------------------------------------------------------------- sequence parallel


def _table(collectives: list[Collective]) -> str:
    return "\n".join(f"{c.kind:20} {c.operands}" for c in collectives)


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("current", marks=pytest.mark.slow)])
def test_tp_sp_gathers_the_norm_output_and_the_output_gradient_in_float8(recipe):
    hlo_text = sharded_step_hlo("tp_sp", recipe)
    gemms = parse_gemms(hlo_text)
    assert [g.target for g in gemms] == [FP8_GEMM] * 6, gemms
    collectives = parse_collectives(hlo_text)
    table = _table(collectives)
    gathered = matrices(moved_arrays(collectives, "all-gather"))
    # Each device's sequence shard, quantized there: e4m3 for GEMM 1's input, e5m2 for GEMM 2's
    # output gradient. Nothing else is gathered (the kernels are split over tensor, not
    # gathered).
    shard = (BATCH, SEQ // FSDP, HIDDEN)
    assert sorted(gathered) == [("f8e4m3fn", shard), ("f8e5m2", shard)], table
    # GEMM 2's output and the norm-input gradient go back onto the sequence shards as
    # reduce-scatters of the full-size bf16 partial sums.
    scattered = matrices(moved_arrays(collectives, "reduce-scatter"))
    assert scattered == [("bf16", (BATCH, SEQ, HIDDEN))] * 2, table
    # All-reduces: the amaxes, the loss and the gradients of the replicated norm scale and shift
    # (summed over the sequence shards), never an activation-sized value.
    reduced = moved_arrays(collectives, "all-reduce")
    assert all(len(dims) <= 1 and math.prod(dims) <= 2 * HIDDEN + 1 for _, dims in reduced), table
    assert {c.kind for c in collectives} <= {"all-gather", "reduce-scatter", "all-reduce"}, table


def test_tp_sp_without_fp8_gathers_bf16():
    collectives = parse_collectives(sharded_step_hlo("tp_sp", "none"))
    gathered = matrices(moved_arrays(collectives, "all-gather"))
    assert gathered and {t for t, _ in gathered} == {"bf16"}, _table(collectives)
