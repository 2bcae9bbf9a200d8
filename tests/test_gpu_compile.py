"""The FP8 lowering on XLA:GPU, checked with a deviceless compile for an H100 (no GPU needed).

XLA's real GPU compiler (from the ``jax[cuda12]`` plugin) compiles one training step
(``value_and_grad``) of an op for the target described in ``data/h100_sxm.gpu_target_config.txtpb``;
the tests then read the cuBLAS custom calls of the optimized HLO: how many FP8 GEMMs
(``__cublas$lt$matmul$f8``) and non-FP8 GEMMs there are, the operand precision of each (forward
DEFAULT for fast accumulation, backward HIGHEST), its epilogue (the forward bias fused as BIAS)
and the float8 types of its operands. Each distinct program is compiled once per module.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from te_flax._tools.hlo import (
    FP8_GEMM,
    NON_FP8_GEMMS,
    Gemm,
    custom_call_targets,
    entry_rows,
    gemms_left_to_fusions,
    parse_gemms,
)
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    noop_quantizer_set,
)
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

TOKENS, HIDDEN, FEATURES = 512, 1024, 2048
FLOAT8_TYPE = re.compile(r"\bf8e\d")

# The three GEMMs of a step, told apart by their output dims (in either order, in case XLA
# swaps the operands): forward [tokens, features], dgrad [tokens, hidden], wgrad [hidden, features].
ROLES = {
    frozenset({TOKENS, FEATURES}): "forward",
    frozenset({TOKENS, HIDDEN}): "dgrad",
    frozenset({HIDDEN, FEATURES}): "wgrad",
}

RECIPES = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
}
OPS = ("layernorm_dense", "dense")
# Block-scaled recipes, which the H100 has no GEMM for: XLA dequantizes their operands.
BLOCK_RECIPES = {
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
BLOCK_TYPES = {"mxfp8": ("f8e4m3fn", "f8e8m0fnu"), "nvfp4": ("f4e2m1fn", "f8e4m3fn")}


# ----------------------------------------------------------------------------- reading the HLO


def role(gemm: Gemm) -> str:
    # Without unit dims: block-scaled GEMMs carry a batch dim of 1.
    dims = frozenset(d for d in gemm.dims if d != 1)
    return ROLES.get(dims, f"unknown GEMM of shape {gemm.dims}")


def by_role(gemms: list[Gemm]) -> dict[str, Gemm]:
    roles = {role(gemm): gemm for gemm in gemms}
    assert len(gemms) == 3 and sorted(roles) == ["dgrad", "forward", "wgrad"], gemms
    return roles


# ----------------------------------------------------------------------------- compiling


def _quantizer_set(recipe: str, fp8_format: str):
    if recipe == "none":
        return noop_quantizer_set
    if recipe in BLOCK_RECIPES:
        return QuantizerFactory.create_set(fp8_recipe=BLOCK_RECIPES[recipe])
    return QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe](fp8_format=Format[fp8_format]))


def optimized_hlo(op: str, recipe: str, use_bias: bool, fp8_format: str = "HYBRID") -> str:
    """The optimized HLO of one training step of ``op`` on the H100, compiled without a GPU.

    ``recipe`` is "delayed", "current", "mxfp8", "nvfp4" or "none" (the noop quantizer set).
    """
    # One cache key per distinct program, however the caller spells the arguments.
    return _compile_step(op, recipe, bool(use_bias), fp8_format)


@functools.cache
def _compile_step(op: str, recipe: str, use_bias: bool, fp8_format: str) -> str:
    sharding = h100_sharding()

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = {"kernel": spec((HIDDEN, FEATURES), jnp.float32)}
    if op == "layernorm_dense":
        params["gamma"] = spec((HIDDEN,), jnp.float32)
        params["beta"] = spec((HIDDEN,), jnp.float32)
    if use_bias:
        params["bias"] = spec((FEATURES,), jnp.float32)
    x = spec((TOKENS, HIDDEN), jnp.bfloat16)
    quantizers = jax.tree.map(
        lambda leaf: spec(leaf.shape, leaf.dtype), _quantizer_set(recipe, fp8_format)
    )

    def loss(params, quantizer_set, x):
        bias = params.get("bias")
        if op == "layernorm_dense":
            out = layernorm_dense(
                x,
                params["kernel"],
                params["gamma"],
                params["beta"],
                bias,
                quantizer_set=quantizer_set,
            )
        else:
            out = dense(x, params["kernel"], bias, quantizer_set=quantizer_set)
        # A loss whose gradient depends on the output, so that XLA cannot fold it to a constant.
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return step.lower(params, quantizers, x).compile().as_text()


def gemms_of(*args, **kwargs) -> list[Gemm]:
    return parse_gemms(optimized_hlo(*args, **kwargs))


def assert_no_other_gemm(hlo_text: str, allowed: str) -> None:
    targets = set(custom_call_targets(hlo_text))
    others = {t for t in targets if t.startswith("__cublas$") and t != allowed}
    assert not others, f"GEMMs other than {allowed}: {sorted(others)}"
    assert not gemms_left_to_fusions(hlo_text), "a GEMM was left to a fusion or a dot"


fp8_cases = pytest.mark.parametrize(
    ("op", "recipe", "use_bias"),
    [(op, recipe, bias) for op in OPS for recipe in RECIPES for bias in (False, True)],
)


# ----------------------------------------------------------------------------- FP8 steps


@fp8_cases
def test_fp8_step_lowers_to_three_fp8_gemms_and_nothing_else(op, recipe, use_bias):
    hlo_text = optimized_hlo(op, recipe, use_bias)
    gemms = parse_gemms(hlo_text)
    assert [g.target for g in gemms] == [FP8_GEMM] * 3, gemms
    by_role(gemms)
    assert_no_other_gemm(hlo_text, allowed=FP8_GEMM)


@fp8_cases
def test_fp8_forward_uses_fast_accumulation_and_backward_split(op, recipe, use_bias):
    gemms = by_role(gemms_of(op, recipe, use_bias))
    assert gemms["forward"].precision == ("DEFAULT", "DEFAULT")
    assert gemms["dgrad"].precision == ("HIGHEST", "HIGHEST")
    assert gemms["wgrad"].precision == ("HIGHEST", "HIGHEST")


@fp8_cases
def test_fp8_forward_bias_is_fused_as_epilogue(op, recipe, use_bias):
    gemms = by_role(gemms_of(op, recipe, use_bias))
    assert gemms["forward"].epilogue == ("BIAS" if use_bias else "DEFAULT")
    assert gemms["dgrad"].epilogue == gemms["wgrad"].epilogue == "DEFAULT"


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("op", OPS)
def test_hybrid_gradient_gemms_take_e5m2_gradients(op, recipe):
    gemms = by_role(gemms_of(op, recipe, False, "HYBRID"))
    assert gemms["forward"].operand_types == ("f8e4m3fn", "f8e4m3fn")
    for role in ("dgrad", "wgrad"):
        assert sorted(gemms[role].operand_types) == ["f8e4m3fn", "f8e5m2"], gemms[role]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("op", OPS)
def test_e4m3_format_keeps_every_gemm_in_e4m3(op, recipe):
    hlo_text = optimized_hlo(op, recipe, False, "E4M3")
    gemms = by_role(parse_gemms(hlo_text))
    assert [g.target for g in gemms.values()] == [FP8_GEMM] * 3
    for gemm in gemms.values():
        assert gemm.operand_types == ("f8e4m3fn", "f8e4m3fn"), gemm
    assert "f8e5m2" not in hlo_text


# ----------------------------------------------------------------------------- without FP8


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_noop_step_has_three_plain_gemms_and_no_float8(op, use_bias):
    hlo_text = optimized_hlo(op, "none", use_bias)
    gemms = parse_gemms(hlo_text)
    assert len(gemms) == 3 and all(g.target in NON_FP8_GEMMS for g in gemms), gemms
    by_role(gemms)
    assert FP8_GEMM not in hlo_text
    assert not FLOAT8_TYPE.search(hlo_text), FLOAT8_TYPE.search(hlo_text)


# ----------------------------------------------------------------------------- layernorm_mlp

INTERMEDIATE = 4096


@functools.cache
def mlp_optimized_hlo(activation_type: tuple[str, ...], recipe: str) -> str:
    """The optimized HLO of one training step of ``layernorm_mlp`` with both biases."""
    sharding = h100_sharding()

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    n_act = len(activation_type)
    params = {
        "gamma": spec((HIDDEN,)),
        "beta": spec((HIDDEN,)),
        "kernels": [spec((HIDDEN, n_act, INTERMEDIATE)), spec((INTERMEDIATE, HIDDEN))],
        "biases": [spec((n_act, INTERMEDIATE)), spec((HIDDEN,))],
    }
    sets = [_quantizer_set(recipe, "HYBRID") for _ in range(2)]
    sets = jax.tree.map(lambda leaf: spec(leaf.shape, leaf.dtype), sets)

    def loss(params, quantizer_sets, x):
        out = layernorm_mlp(
            x,
            params["gamma"],
            params["beta"],
            params["kernels"],
            params["biases"],
            "layernorm",
            activation_type=activation_type,
            quantizer_sets=tuple(quantizer_sets),
        )
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return step.lower(params, sets, spec((TOKENS, HIDDEN), jnp.bfloat16)).compile().as_text()


mlp_cases = pytest.mark.parametrize(
    ("activation_type", "recipe"),
    [(act, recipe) for act in (("gelu",), ("silu", "linear")) for recipe in RECIPES],
    ids=lambda value: "-".join(value) if isinstance(value, tuple) else value,
)


@mlp_cases
def test_fp8_mlp_step_lowers_to_six_fp8_gemms_and_nothing_else(activation_type, recipe):
    hlo_text = mlp_optimized_hlo(activation_type, recipe)
    gemms = parse_gemms(hlo_text)
    assert [g.target for g in gemms] == [FP8_GEMM] * 6, gemms
    assert_no_other_gemm(hlo_text, allowed=FP8_GEMM)
    # Two forward GEMMs with fast accumulation, four backward ones in full precision.
    precisions = sorted(g.precision[0] for g in gemms)
    assert precisions == ["DEFAULT"] * 2 + ["HIGHEST"] * 4, gemms
    for gemm in gemms:
        expected = "f8e4m3fn" if gemm.precision[0] == "DEFAULT" else "f8e5m2"
        assert expected in gemm.operand_types, gemm


@pytest.mark.parametrize("activation_type", [("gelu",), ("silu", "linear")], ids="-".join)
def test_noop_mlp_step_has_six_plain_gemms_and_no_float8(activation_type):
    hlo_text = mlp_optimized_hlo(activation_type, "none")
    gemms = parse_gemms(hlo_text)
    assert len(gemms) == 6 and all(g.target in NON_FP8_GEMMS for g in gemms), gemms
    assert not FLOAT8_TYPE.search(hlo_text)


# ----------------------------------------------------------------------------- block scaling

PLAIN_GEMM = "__cublas$lt$matmul"


def _assert_dequantized_gemms(hlo_text: str, recipe: str, count: int) -> list[Gemm]:
    gemms = parse_gemms(hlo_text)
    assert [g.target for g in gemms] == [PLAIN_GEMM] * count, gemms
    assert_no_other_gemm(hlo_text, allowed=PLAIN_GEMM)
    # The step quantizes into the recipe's types; the GEMMs read their dequantized values.
    for element_type in BLOCK_TYPES[recipe]:
        assert re.search(rf"\b{element_type}\[", hlo_text), element_type
    return gemms


@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES))
@pytest.mark.parametrize("op", OPS)
def test_block_scaled_step_on_hopper_is_three_dequantized_gemms(op, recipe):
    gemms = by_role(_assert_dequantized_gemms(optimized_hlo(op, recipe, True), recipe, 3))
    # Dequantized to the output dtype: bf16 operands for the bf16 forward and dgrad, f32 for
    # the weight gradient of the f32 kernel.
    assert gemms["forward"].operand_types == gemms["dgrad"].operand_types == ("bf16", "bf16")
    assert gemms["wgrad"].operand_types == ("f32", "f32")


@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES))
def test_block_scaled_mlp_step_on_hopper_is_six_dequantized_gemms(recipe):
    _assert_dequantized_gemms(mlp_optimized_hlo(("silu", "linear"), recipe), recipe, 6)


# ------------------------------------------------------------------------- the XLA stages' bytes

MATRIX_RESULT = re.compile(r"\b(\w+)\[(\d+),(\d+)\]")


def test_xla_stages_quantize_a_kernel_in_one_pass():
    # quantize's convert(clamp(divide(x, scale))) form, its non-finite values turned into NaN
    # inside it, lets XLA read the float32 kernel once for both float8 layouts. A select on
    # is_finite(x) around the clamp made it write the kernel's float32 transpose and its
    # finiteness mask as well (bench/RESULTS_xla_stages.md: 1.64x the BF16 step's bytes
    # instead of 1.23x for two hidden-8192 layers).
    written = [
        (row["name"], element_type)
        for row in entry_rows(optimized_hlo("dense", "delayed", use_bias=False))
        if "GEMM" not in row["instruction"]
        for element_type, rows, cols in MATRIX_RESULT.findall(row["result"])
        if {int(rows), int(cols)} == {HIDDEN, FEATURES} and element_type in ("f32", "pred")
    ]
    assert not written, f"kernel-sized float32 or boolean arrays written: {written}"
