"""grouped_dense's two lowerings on XLA:GPU, checked with a deviceless compile for an H100.

One training step (``value_and_grad``) of ``grouped_dense`` compiles for the H100 target of
``tests/gpu_target.py``. The capacity lowering must give three batched FP8 cuBLASLt GEMMs
(forward, dgrad, wgrad; one batch entry per group) and nothing else. The ragged lowering also
gives three FP8 GEMMs, but XLA:GPU rewrites ``ragged_dot`` into dense GEMMs over every group
(each row meets all G kernels, masked): G times the forward's FLOPs, which docs/moe.md reports.
"""

from __future__ import annotations

import functools
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from te_flax._base.jax_compat import mixed_fp8_wgmma
from te_flax._ops.grouped import RaggedOnGpuWarning
from te_flax._ops.kernels import pallas_kernels
from te_flax._ops.kernels.grouped_gemm import Accumulation, Tiles, group_gemm, rows_gemm
from te_flax._tools.hlo import value_types
from te_flax.dense import grouped_dense, grouped_quantizer_set
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    QuantizerFactory,
    noop_quantizer_set,
)
from tests.gpu_target import h100_sharding
from tests.test_gpu_compile import FP8_GEMM, NON_FP8_GEMMS, parse_gemms

pytestmark = pytest.mark.gpu_compile

ROWS, HIDDEN, FEATURES, GROUPS, CAPACITY = 512, 1024, 2048, 4, 256
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


@functools.cache
def _compiled(recipe: str, lowering: str, kernels: str = "0") -> str:
    """The optimized H100 program of one training step; ``kernels``: the switch's mode, with a
    GPU assumed (``"auto"`` takes te_flax's grouped GEMM kernels on the ragged lowering)."""
    sharding = h100_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    state = noop_quantizer_set
    if recipe != "bf16":
        recipe_set = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe]())
        state = grouped_quantizer_set(recipe_set, GROUPS)
    state = jax.tree.map(lambda leaf: spec(leaf.shape, leaf.dtype), state)
    capacity = CAPACITY if lowering == "capacity" else None

    def loss(kernel, bias, state, x, sizes):
        out = grouped_dense(
            x, kernel, sizes, bias=bias, quantizer_set=state, lowering=lowering, capacity=capacity
        )
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    with pallas_kernels(kernels, assume_gpu=True), warnings.catch_warnings():
        # Without the kernels the ragged lowering says that XLA expands it (checked below).
        warnings.simplefilter("ignore", RaggedOnGpuWarning)
        lowered = step.lower(
            spec((GROUPS, HIDDEN, FEATURES), jnp.float32),
            spec((GROUPS, FEATURES), jnp.float32),
            state,
            spec((ROWS, HIDDEN), jnp.bfloat16),
            spec((GROUPS,), jnp.int32),
        )
    return lowered.compile().as_text()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_capacity_lowering_is_three_batched_fp8_gemms(recipe):
    hlo = _compiled(recipe, "capacity")
    gemms = parse_gemms(hlo)
    assert [gemm.target for gemm in gemms] == [FP8_GEMM] * 3, gemms
    assert not any(target in hlo for target in (f'"{t}"' for t in NON_FP8_GEMMS))
    assert not re.search(r"\sdot\(", hlo), "a dot was left to a fusion, not to cuBLAS"
    # One batch entry per group: [G, capacity, N] forward, [G, capacity, K] dgrad,
    # [G, K, N] wgrad.
    assert sorted(gemm.dims for gemm in gemms) == sorted(
        [
            (GROUPS, CAPACITY, FEATURES),
            (GROUPS, CAPACITY, HIDDEN),
            (GROUPS, HIDDEN, FEATURES),
        ]
    )
    for gemm in gemms:
        assert all(t.startswith("f8e") for t in gemm.operand_types), gemm
    forward = next(g for g in gemms if g.dims == (GROUPS, CAPACITY, FEATURES))
    assert forward.operand_types == ("f8e4m3fn", "f8e4m3fn")
    assert forward.precision == ("DEFAULT", "DEFAULT")  # fast accumulation
    backward = [g for g in gemms if g is not forward]
    assert all(g.precision == ("HIGHEST", "HIGHEST") for g in backward)
    assert all("f8e5m2" in g.operand_types for g in backward)


def test_ragged_lowering_multiplies_every_row_with_every_group():
    """The XLA lowering, as it runs where the kernels cannot (``TE_FLAX_PALLAS=0``)."""
    hlo = _compiled("delayed", "ragged")
    gemms = parse_gemms(hlo)
    assert [gemm.target for gemm in gemms] == [FP8_GEMM] * 3, gemms
    # XLA:GPU expands ragged_dot: the forward contracts [rows, G * hidden] (x masked per group)
    # with the kernel as [G * hidden, features], and wgrad is a [G, hidden, features] batched
    # GEMM over all rows. The ragged lowering costs G times the FLOPs of the grouped GEMM.
    assert re.search(rf"f8e4m3fn\[{ROWS},{GROUPS * HIDDEN}\]", hlo)
    assert (ROWS, FEATURES) in [gemm.dims for gemm in gemms]
    assert (GROUPS, HIDDEN, FEATURES) in [gemm.dims for gemm in gemms]


def _kernel_calls(hlo: str) -> list[tuple[str, str]]:
    """(result type, operand types) of each Mosaic GPU custom call of the entry computation."""
    entry = hlo[hlo.index("ENTRY") :]
    calls = re.findall(
        r"= (\S+) custom-call\(.*?custom_call_target=\"mosaic_gpu_v2\", "
        r"operand_layout_constraints=\{([^}]*)\}",
        entry,
    )
    return [(result, constraints) for result, constraints in calls]


def _kernel_operand_types(hlo: str) -> list[set[str]]:
    """The element types of the two matrix operands of each Mosaic GPU call of the entry
    computation (after its two tables)."""
    types = value_types(hlo)
    entry = hlo[hlo.index("ENTRY") :]
    calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"mosaic_gpu_v2\"", entry)
    operands = [re.findall(r"%([^\s,]+)", call)[2:4] for call in calls]
    return [{types[name][0] for name in pair} for pair in operands]


@pytest.mark.parametrize("lowering", ["ragged", "capacity"])
@pytest.mark.parametrize("recipe", ["delayed", "current", "bf16"])
def test_both_lowerings_run_the_grouped_kernels(recipe, lowering):
    """On a GPU both lowerings take te_flax's grouped GEMM kernels (the capacity lowering its
    packed rows, CAPACITY per expert, with per-tensor FP8): three kernel calls and no cuBLAS
    GEMM. Where Mosaic GPU has no mixed float8 ``wgmma`` (jax 0.10) the gradient GEMMs take
    their e4m3 and e5m2 operands as bfloat16 (``kernel_dtypes``): kernels all the same."""
    if recipe == "bf16" and lowering == "capacity":
        pytest.skip("BF16's capacity lowering keeps batched cuBLAS GEMMs (test below)")
    if recipe != "bf16" and lowering == "capacity" and not mixed_fp8_wgmma():
        pytest.skip("without mixed float8 wgmma (jax 0.10) FP8 capacity keeps cuBLASLt GEMMs")
    hlo = _compiled(recipe, lowering, kernels="auto")
    assert parse_gemms(hlo) == [], "a grouped GEMM was left to cuBLAS"
    calls = _kernel_calls(hlo)
    results = sorted(result.split("{")[0] for result, _ in calls)
    rows = ROWS if lowering == "ragged" else GROUPS * CAPACITY
    expected = [f"bf16[{rows},{FEATURES}]", f"bf16[{rows},{HIDDEN}]"]
    assert results == sorted([*expected, f"f32[{GROUPS},{HIDDEN},{FEATURES}]"]), calls
    float8 = {"f8e4m3fn", "f8e5m2"}
    operand_types = _kernel_operand_types(hlo)
    assert len(operand_types) == 3, operand_types
    for types in operand_types:
        assert types <= (float8 if recipe != "bf16" else set()) | {"bf16"}, operand_types
    if recipe != "bf16":  # the forward in float8; the gradient GEMMs too with mixed wgmma
        float8_calls = sum(types <= float8 for types in operand_types)
        assert float8_calls == (3 if mixed_fp8_wgmma() else 1), operand_types
    # The per-group scales are applied in the kernels: no pass writes the float32 weight
    # gradient after its GEMM (the entry's output is the kernel's result).
    wgrad = f"f32[{GROUPS},{HIDDEN},{FEATURES}]"
    entry = hlo[hlo.index("ENTRY") :]
    producers = re.findall(rf"= {re.escape(wgrad)}\S* (\S+)\(", entry)
    assert sorted(producers) == ["custom-call", "parameter"], producers  # the kernel, its input


def test_ragged_lowering_without_the_kernels_says_so():
    expanded = pytest.warns(RaggedOnGpuWarning, match="expands over every group")
    with expanded, pallas_kernels("0", assume_gpu=True):
        jax.eval_shape(
            lambda x, k: grouped_dense(x, k, jnp.array([ROWS, 0, 0, 0], jnp.int32)),
            jax.ShapeDtypeStruct((ROWS, HIDDEN), jnp.bfloat16),
            jax.ShapeDtypeStruct((GROUPS, HIDDEN, FEATURES), jnp.float32),
        )


def test_bf16_capacity_lowering_keeps_batched_cublas_gemms():
    hlo = _compiled("bf16", "capacity", kernels="auto")
    assert _kernel_calls(hlo) == []
    assert len(parse_gemms(hlo)) == 3


@functools.cache
def _kernel_program(gemm: str, split: bool) -> str:
    """One grouped GEMM kernel (e4m3 operands, the default tiles) lowered for the H100: its
    Mosaic GPU call, with or without split accumulation."""
    sharding = h100_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    e4m3, accumulation = jnp.float8_e4m3fn, Accumulation(split=split)
    if gemm == "rows_gemm":
        step = jax.jit(partial(rows_gemm, out_dtype=jnp.bfloat16, tiles=Tiles(),
                               accumulation=accumulation))  # fmt: skip
        operands = (spec((ROWS, HIDDEN), e4m3), spec((GROUPS, FEATURES, HIDDEN), e4m3))
        tables = (spec((GROUPS,), jnp.int32), spec((GROUPS,), jnp.float32))
    else:
        step = jax.jit(partial(group_gemm, out_dtype=jnp.float32, tiles=Tiles(),
                               accumulation=accumulation))  # fmt: skip
        operands = (spec((HIDDEN, ROWS), e4m3), spec((FEATURES, ROWS), e4m3))
        tables = (spec((GROUPS + 1,), jnp.int32), spec((GROUPS,), jnp.float32))
    return step.lower(*operands, *tables).compile().as_text()


@pytest.mark.parametrize("gemm", ["rows_gemm", "group_gemm"])
def test_split_accumulation_lowers_for_the_h100(gemm):
    """The kernels that promote their float8 partial sums every 128 elements compile for the
    H100 on every JAX of the range (e4m3 operands: jax 0.10's Mosaic GPU takes them), and are
    another program than the kernels that leave the sum to the tensor cores."""
    split, whole = _kernel_program(gemm, True), _kernel_program(gemm, False)
    for hlo in (split, whole):
        assert f"te_flax_{gemm}" in hlo and "mosaic_gpu_v2" in hlo
    kernel = re.compile(r'custom_call_target="mosaic_gpu_v2".*')
    assert kernel.findall(split) != kernel.findall(whole)


def test_rows_off_the_tile_and_a_float8_contraction_of_192_run_the_kernels():
    """200 rows (not a multiple of 64) and hidden 192 (a float8 contraction of 64-byte steps):
    three grouped kernel calls for the H100, no GEMM left to cuBLAS or to ragged_dot's
    expansion over every expert (e4m3 throughout: every JAX of the range takes it)."""
    sharding = h100_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    recipe = DelayedScaling(fp8_format=Format.E4M3)
    state = grouped_quantizer_set(QuantizerFactory.create_set(fp8_recipe=recipe), GROUPS)
    state = jax.tree.map(lambda leaf: spec(leaf.shape, leaf.dtype), state)
    rows, hidden, features = 200, 192, 256

    def loss(kernel, state, x, sizes):
        out = grouped_dense(x, kernel, sizes, quantizer_set=state)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with pallas_kernels("auto", assume_gpu=True), warnings.catch_warnings():
        warnings.simplefilter("error", RaggedOnGpuWarning)
        lowered = step.lower(
            spec((GROUPS, hidden, features), jnp.float32),
            state,
            spec((rows, hidden), jnp.bfloat16),
            spec((GROUPS,), jnp.int32),
        )
    hlo = lowered.compile().as_text()
    assert parse_gemms(hlo) == [], "a grouped GEMM was left to cuBLAS"
    results = sorted(result.split("{")[0] for result, _ in _kernel_calls(hlo))
    expected = [f"bf16[{rows},{features}]", f"bf16[{rows},{hidden}]"]
    assert results == sorted([*expected, f"f32[{GROUPS},{hidden},{features}]"]), results


def _entry_users(hlo: str, value_type: str) -> list[str]:
    """The instructions of the entry computation that read its parameter of ``value_type``
    (e.g. ``f32[4,1024,2048]``): each one's result types."""
    entry = hlo[hlo.index("ENTRY") :]
    (name,) = re.findall(rf"(%\S+) = {re.escape(value_type)}\{{[^}}]*\}} parameter\(", entry)
    users = []
    for line in entry.splitlines():
        defined = re.match(r"\s*(?:ROOT\s+)?(%\S+) = (.*?) (\S+)\(", line)
        if defined and defined.group(1) != name and re.search(re.escape(name) + r"[,)]", line):
            users.append(defined.group(2))
    return users


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_reads_the_kernel_and_the_rows_once(recipe):
    """On the kernels with FP8 the float32 kernel and the input rows are each read by one pass,
    which quantizes them and reduces their amax together (the kernel's transposed layout is
    copied from its float8 data): no pass of its own for an amax, where XLA would otherwise
    read the float32 kernel twice (its two layouts, then its amax) and the rows twice."""
    if recipe == "current":
        pytest.skip("current scaling needs the amax before it quantizes: two passes")
    hlo = _compiled(recipe, "ragged", kernels="auto")
    for value_type, quantized in [
        (f"f32[{GROUPS},{HIDDEN},{FEATURES}]", f"f8e4m3fn[{GROUPS},{HIDDEN},{FEATURES}]"),
        (f"bf16[{ROWS},{HIDDEN}]", f"f8e4m3fn[{ROWS},{HIDDEN}]"),
    ]:
        users = _entry_users(hlo, value_type)
        # The float8 data and the amax from one pass; no pass for the amax alone.
        assert any(quantized in user and "f32[" in user for user in users), users
        if mixed_fp8_wgmma():  # jax 0.10's wgrad reads the rows again, for a bfloat16 copy
            assert len(users) == 1, users


def _moe_block_program(fused: bool, monkeypatch) -> str:
    """The H100 program of a dropless MoEBlock's FP8 training step (2048 tokens, top-2: 4096
    routed rows; F = 1024), the kernels under "auto"; ``fused``: the activation inside the first
    expert GEMM's op, else apart."""
    import te_flax.dense
    from te_flax.linen import MoEBlock

    if not fused:
        monkeypatch.setattr(te_flax.dense, "fuses", lambda *args: False)
    layer = MoEBlock(
        num_experts=GROUPS, num_experts_per_tok=2, intermediate_dim=1024, recipe=DelayedScaling()
    )
    sharding = h100_sharding()
    x = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=sharding)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), variables
    )

    def loss(variables, x):
        out, aux = layer.apply(variables, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32))) + aux

    with pallas_kernels("auto", assume_gpu=True):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x)
    return lowered.compile().as_text()


@pytest.mark.skipif(not mixed_fp8_wgmma(), reason="Mosaic GPU's element-wise kernels: jax 0.11")
def test_moe_blocks_activation_gradient_is_quantized_in_one_pass(monkeypatch):
    """MoEBlock's FP8 backward on a GPU quantizes the experts' activation gradient in the
    kernel that computes it (``te_flax_activation_grad_rows``): the step moves the gradient's
    bfloat16 write and read less than with the activation apart, where XLA writes it
    (``bf16[4096,2,1024]``) and reads it back to quantize it."""
    from bench.h100 import instruction_bytes

    def entry_results(hlo: str) -> list[str]:
        return re.findall(r"(%\S+) = bf16\[4096,2,1024\]", hlo[hlo.index("ENTRY") :])

    def step_bytes(hlo: str) -> int:
        return sum(row["bytes"] for row in instruction_bytes(hlo, top=None))

    fused = _moe_block_program(True, monkeypatch)
    apart = _moe_block_program(False, monkeypatch)
    assert "te_flax_activation_grad_rows" in fused and "te_flax_activation_grad_rows" not in apart
    assert entry_results(fused) == [] and len(entry_results(apart)) == 1
    round_trip = 2 * 4096 * 2048 * 2  # written and read in bfloat16
    assert step_bytes(apart) - step_bytes(fused) >= 0.99 * round_trip
