"""A catalogue of wrong calls across the public API, and the errors they get.

Each case is one wrong call, the exception type it must raise, a pattern that the message must
match to name the offending argument, and one it must match to say the fix. Every error raises
while the call is traced (shapes, dtypes and static arguments), before any compilation.
``docs/bad_inputs.md`` lists the same cases; ``test_every_case_is_documented`` keeps the two in
step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import te_flax
import te_flax.activation
import te_flax.attention
import te_flax.collective
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from examples.lm.config import ConfigError, load_config
from te_flax import convert, sharding, training
from te_flax import quantize as q
from te_flax.accumulate import combine_gradients
from te_flax.attention import dot_product_attention
from te_flax.dense import dense, grouped_dense
from te_flax.layernorm import layernorm
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.router import fused_topk_with_score_function

F32 = jnp.float32
DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
KEY = jax.random.key(0)

X = jnp.ones((2, 4, 32), F32)  # [batch, seq, hidden]
SCALAR = jnp.ones((), F32)  # no features axis
KERNEL = jnp.ones((32, 16), F32)  # [hidden, features]
GAMMA, BETA = jnp.ones((32,), F32), jnp.zeros((32,), F32)
QKV = jnp.ones((2, 4, 4, 8), F32)  # [batch, seq, heads, head_dim]
MLP_KERNELS = [jnp.ones((32, 1, 64), F32), jnp.ones((64, 32), F32)]
TX = optax.sgd(0.1)
TRANSFORMER = dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4)


ROWS_X = jnp.ones((8, 32), F32)  # [rows, hidden], rows sorted by group
GROUPED_KERNEL = jnp.ones((3, 32, 16), F32)  # [groups, hidden, features]


def _moe_on_ep_mesh(**attributes):
    with sharding.use_sharding("ep", {"data": 4, "fsdp": 2}):
        return te_nn.MoEBlock(**attributes).init(KEY, jnp.ones((8, 4, 32), F32))


def _sizes(*sizes: int) -> jax.Array:
    return jnp.array(sizes, jnp.int32)


def _mlp(**kwargs):
    kernels = kwargs.pop("kernels", MLP_KERNELS)
    return layernorm_mlp(X, GAMMA, BETA, kernels, [None, None], "layernorm", **kwargs)


def _linen_init(module: nn.Module, *inputs) -> None:
    module.init(KEY, *inputs)


def _context_parallel_apply(qkv, recipe=None, **call):
    """DotProductAttention across a context axis of 2 devices (sequence not load balanced)."""
    attention = te_nn.DotProductAttention(
        head_dim=8, num_attention_heads=4, context_parallel_axis="context", recipe=recipe
    )
    with sharding.use_sharding("cp", {"data": 4, "context": 2}):
        return attention.apply({}, qkv, qkv, qkv, **call)


def _rngs() -> nnx.Rngs:
    return nnx.Rngs(0)


def _linen_apply_other_features() -> None:
    module = te_nn.DenseGeneral(features=8)
    variables = module.init(KEY, X)
    module.apply(variables, jnp.ones((2, 4, 16), F32))


def _linen_fp8_apply_of_bf16_init() -> None:
    module = te_nn.DenseGeneral(features=8)
    variables = module.init(KEY, X)  # outside autocast: no FP8 state
    with te_flax.autocast(enabled=True):
        module.apply(variables, X)


def _abstract_nnx_transformer() -> te_nnx.TransformerLayer:
    # Shapes only: the input check runs before any parameter is read.
    return nnx.eval_shape(lambda: te_nnx.TransformerLayer(**TRANSFORMER, rngs=_rngs()))


def _nnx_train_step(optimizer_of: Callable[[nnx.Module], object]) -> None:
    model = te_nnx.DenseGeneral(32, 8, rngs=_rngs())
    te_nnx.train_step(model, optimizer_of(model), lambda m: jnp.sum(m(X)))


def _resource_rules(resource) -> None:
    with jax.set_mesh(sharding.make_mesh({"fsdp": 2, "tensor": 4})):
        sharding.mesh_resource_rules(resource)


def _constraint_under(rule_set, mesh_shape, axes) -> None:
    with jax.set_mesh(sharding.make_mesh(mesh_shape)), nn.logical_axis_rules(rule_set):
        jax.jit(lambda a: sharding.with_logical_constraint(a, axes)).lower(X)


def _rules_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


def _linen_bf16_apply_of_fp8_variables() -> None:
    module = te_nn.DenseGeneral(features=8, recipe=q.DelayedScaling())
    variables = module.init(KEY, X)
    te_nn.DenseGeneral(features=8).apply(variables, X)  # BF16 evaluation, FP8 state passed


def _apply_gradients_with_optax_state() -> None:
    variables = {"params": {"kernel": KERNEL}}
    training.apply_gradients(TX, variables, variables, TX.init(variables["params"]))


def case(id: str, call: Callable[..., object], error: type, names: str, fix: str):
    return pytest.param(call, error, names, fix, id=id)


# fmt: off
CASES = [
    # ------------------------------------------------------------------ functional ops
    case("dense-kernel-features", lambda: dense(X, jnp.ones((64, 16), F32)), ValueError,
         r"kernel has \(64,\) input features but x has \(32,\)",
         r"check the kernel's leading axes"),
    case("dense-integer-x", lambda: dense(X.astype(jnp.int32), KERNEL), TypeError,
         r"^x must be a floating-point array", r"x\.astype\(jnp\.bfloat16\)"),
    case("dense-float8-x", lambda: dense(X.astype(jnp.float8_e4m3fn), KERNEL), TypeError,
         r"^x has dtype float8_e4m3fn", r"let a quantizer_set do the float8 conversion"),
    case("dense-bias-shape", lambda: dense(X, KERNEL, bias=jnp.ones(8, F32)), ValueError,
         r"^bias has shape \(8,\)", r"must be \(16,\)"),
    case("dense-rank1-kernel", lambda: dense(X, jnp.ones((32,), F32)), ValueError,
         r"kernel of shape \(32,\) has no output axes", r"must be \[K\.\.\., features\.\.\.\]"),
    case("dense-contracting-leading", lambda: dense(X, KERNEL, contracting_dims=((0,), (0,))),
         ValueError, r"contracting_dims=\(\(0,\), \(0,\)\)", r"e\.g\. contracting_dims=\(\(2,\)"),
    case("dense-input-axes-length", lambda: dense(X, KERNEL, input_axes=("batch", "embed")),
         ValueError, r"input_axes=\('batch', 'embed'\) names 2", r"one logical name .* per dim"),
    case("dense-input-axes-string", lambda: dense(X, KERNEL, input_axes="batch"), TypeError,
         r"^input_axes must be a tuple", r"e\.g\. input_axes=\('batch', 'embed'\)"),
    case("dense-recipe-as-quantizer-set",
         lambda: dense(X, KERNEL, quantizer_set=q.DelayedScaling()), TypeError,
         r"^quantizer_set must be a te_flax\.quantize\.QuantizerSet",
         r"QuantizerFactory\.create_set\(fp8_recipe=\.\.\.\)"),
    case("dense-mxfp8-block",
         lambda: dense(jnp.ones((32, 48), F32), jnp.ones((48, 32), F32),
                       quantizer_set=q.QuantizerFactory.create_set(
                           fp8_recipe=q.MXFP8BlockScaling())),
         ValueError, r"MXFP8BlockScaling .* blocks of 32 .* axes \(48,\)",
         r"pad them to a multiple of 32 or use a per-tensor recipe"),
    case("dense-nvfp4-block",
         lambda: dense(jnp.ones((32, 24), F32), jnp.ones((24, 32), F32),
                       quantizer_set=q.QuantizerFactory.create_set(
                           fp8_recipe=q.NVFP4BlockScaling(disable_stochastic_rounding=True))),
         ValueError, r"NVFP4BlockScaling .* blocks of 16 .* axes \(24,\)",
         r"pad them to a multiple of 16"),
    case("dense-blockwise-tiles",
         lambda: dense(jnp.ones((128, 128), F32), jnp.ones((128, 96), F32),
                       quantizer_set=q.QuantizerFactory.create_set(
                           fp8_recipe=q.Float8BlockScaling())),
         ValueError, r"Float8BlockScaling quantizes this tensor in 128x128 tiles .* \(96,\)",
         r"pad the features to a multiple of 128 or use 1x128 blocks"),
    case("grouped-dense-sizes-exceed-rows",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(4, 4, 4)), ValueError,
         r"^group_sizes sum to 12 but x has only 8 rows", r"must fit in x"),
    case("grouped-dense-negative-size",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(-1, 4, 4)), ValueError,
         r"^group_sizes must be >= 0", r"counts the rows of x"),
    case("grouped-dense-float-sizes",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, jnp.array([2.0, 3.0, 3.0])), TypeError,
         r"^group_sizes must be an integer array", r"jnp\.bincount"),
    case("grouped-dense-group-count",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(4, 4)), ValueError,
         r"group_sizes has shape \(2,\) but the kernel holds 3 groups", r"one size per group"),
    case("grouped-dense-x-rank", lambda: grouped_dense(X, GROUPED_KERNEL, _sizes(2, 2, 2)),
         ValueError, r"grouped_dense takes x as \[M, K\]", r"flatten the tokens of x"),
    case("grouped-dense-kernel-features",
         lambda: grouped_dense(ROWS_X, jnp.ones((3, 64, 16), F32), _sizes(2, 2, 2)), ValueError,
         r"^kernel has 64 input features", r"K = x\.shape\[1\]"),
    case("grouped-dense-bias-shape",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(2, 2, 2), bias=jnp.ones(16, F32)),
         ValueError, r"^bias has shape \(16,\)", r"one bias per group"),
    case("grouped-dense-contracting-dims",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(2, 2, 2),
                               contracting_dims=((0,), (1,))),
         ValueError, r"supports only contracting_dims=\(\(1,\), \(1,\)\)", r"as TransformerEngine"),
    case("grouped-dense-ungrouped-state",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(2, 2, 2),
                               quantizer_set=q.QuantizerFactory.create_set(
                                   fp8_recipe=q.DelayedScaling())),
         ValueError, r"^quantizer_set\.x holds delayed-scaling state of shape \(1,\)",
         r"grouped_quantizer_set\(quantizer_set, n_groups=3\)"),
    case("grouped-dense-state-groups",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(2, 2, 2),
                               quantizer_set=q.QuantizerFactory.create_set(
                                   fp8_recipe=q.DelayedScaling(), n_groups=2)),
         ValueError, r"^quantizer_set\.x holds delayed-scaling state of shape \(2, 1\)",
         r"create_set\(\.\.\., n_groups=3\)"),
    case("grouped-dense-lowering",
         lambda: grouped_dense(ROWS_X, GROUPED_KERNEL, _sizes(2, 2, 2), lowering="padded"),
         ValueError, r"^lowering must be one of", r"'ragged', 'capacity'"),
    case("router-topk-exceeds-experts",
         lambda: fused_topk_with_score_function(jnp.ones((4, 8), F32), 9), ValueError,
         r"^topk must be an int from 1 to the number of experts \(8\), got 9",
         r"lower topk or add experts"),
    case("moe-topk-exceeds-experts",
         lambda: te_nn.MoEBlock(num_experts=4, num_experts_per_tok=5).init(KEY, X), ValueError,
         r"^num_experts_per_tok \(5\) is larger than num_experts \(4\)",
         r"lower num_experts_per_tok or add experts"),
    case("moe-expert-bias-softmax",
         lambda: te_nn.MoEBlock(use_expert_routing_bias=True).init(KEY, X), ValueError,
         r"^use_expert_routing_bias needs score_function='sigmoid' or 'sqrtsoftplus'",
         r"got 'softmax'"),
    case("moe-experts-not-dividing-ep-axis", lambda: _moe_on_ep_mesh(num_experts=6), ValueError,
         r"^num_experts \(6\) must be divisible by the expert-parallel mesh axis 'data' of "
         r"size 4", r"choose a multiple of 4 experts"),
    case("dense-collective-gemm",
         lambda: dense(X, KERNEL, collective_op_set=te_flax.collective.CollectiveOpSet.create(
             te_flax.collective.CollectiveOp.ALL_GATHER)),
         ValueError, r"collective_op_set=.*ALL_GATHER.* collective GEMM",
         r"pass noop_collective_op_set .* logical axis rules"),
    case("dense-collective-op-type",
         lambda: dense(X, KERNEL, collective_op_set="all_gather"), TypeError,
         r"collective_op_set must be a CollectiveOpSet, got 'all_gather'",
         r"pass te_flax\.collective\.noop_collective_op_set"),
    case("activation-act-axis",
         lambda: te_flax.activation.activation(X, ("silu", "linear")), ValueError,
         r"x has shape \(2, 4, 32\), but activation_type=\('silu', 'linear'\)",
         r"needs x of shape \[\.\.\., 2, H\]"),
    case("layernorm-gamma-shape", lambda: layernorm(X, jnp.ones(16, F32), BETA), ValueError,
         r"^gamma has shape \(16,\)", r"must be \(32,\)"),
    case("layernorm-norm-type", lambda: layernorm(X, GAMMA, BETA, norm_type="batchnorm"),
         ValueError, r"^norm_type must be .* got 'batchnorm'", r'"layernorm" or "rmsnorm"'),
    case("layernorm-rmsnorm-beta", lambda: layernorm(X, GAMMA, BETA, norm_type="rmsnorm"),
         ValueError, r"^beta must be None for rmsnorm", r'drop it or use norm_type="layernorm"'),
    case("layernorm-epsilon", lambda: layernorm(X, GAMMA, BETA, epsilon=-1.0), ValueError,
         r"^epsilon must be", r"a positive finite number"),
    case("layernorm-scalar-x", lambda: layernorm(SCALAR, GAMMA, BETA), ValueError,
         r"^x has shape \(\) but needs at least one axis: its last axis holds the features",
         r"x\.reshape\(1, -1\) for one example"),
    case("dense-scalar-x", lambda: dense(SCALAR, KERNEL), ValueError,
         r"^x has shape \(\) but needs at least one axis", r"x\.reshape\(1, -1\)"),
    case("layernorm-dense-scalar-x", lambda: layernorm_dense(SCALAR, KERNEL, GAMMA, BETA),
         ValueError, r"^x has shape \(\) but needs at least one axis", r"x\.reshape\(1, -1\)"),
    case("layernorm-mlp-scalar-x",
         lambda: layernorm_mlp(SCALAR, GAMMA, BETA, MLP_KERNELS, [None, None], "layernorm"),
         ValueError, r"^x has shape \(\) but needs at least one axis", r"x\.reshape\(1, -1\)"),
    case("layernorm-dense-kernel-shape",
         lambda: layernorm_dense(X, jnp.ones((16, 8), F32), GAMMA, BETA), ValueError,
         r"^kernel has shape \(16, 8\)", r"hidden = x\.shape\[-1\] = 32"),
    case("layernorm-dense-integer-gamma",
         lambda: layernorm_dense(X, KERNEL, GAMMA.astype(jnp.int32), BETA), TypeError,
         r"^gamma must be a floating-point array", r"gamma\.astype\(jnp\.bfloat16\)"),
    case("layernorm-mlp-activation", lambda: _mlp(activation_type=("swish",)), ValueError,
         r"unknown activation 'swish' in activation_type", r"known: gelu, .*silu"),
    case("layernorm-mlp-gated-kernel", lambda: _mlp(activation_type=("silu", "linear")),
         ValueError, r"^kernels\[0\] has shape \(32, 1, 64\)",
         r"n_act is len\(activation_type\)"),
    case("layernorm-mlp-kernel-2-shape",
         lambda: _mlp(kernels=[MLP_KERNELS[0], jnp.ones((32, 32), F32)]), ValueError,
         r"^kernels\[1\] has shape \(32, 32\)", r"must be \(64, 32\)"),
    case("layernorm-mlp-one-quantizer-set",
         lambda: _mlp(quantizer_sets=(q.noop_quantizer_set,)), TypeError,
         r"^quantizer_sets must be a pair", r"QuantizerFactory\.create_set\(2, fp8_recipe"),
    case("layernorm-mlp-activation-string", lambda: _mlp(activation_type="gelu"), TypeError,
         r"^activation_type must be a tuple", r"e\.g\. \('gelu',\)"),
    case("layernorm-mlp-activation-params",
         lambda: _mlp(activation_type=("gelu",), activation_params={"limit": 1.0}), ValueError,
         r"^activation_params=\{'limit': 1\.0\} given, but activation_type=\('gelu',\)",
         r"only the clamped SwiGLU \('clamped_silu', 'clamped_linear'\) does"),
    case("layernorm-mlp-dropout-without-key", lambda: _mlp(intermediate_dropout_rate=0.1),
         ValueError, r"^intermediate_dropout_rate=0\.1 needs intermediate_dropout_rng",
         r"pass a jax\.random\.key"),
    case("layernorm-mlp-lora-shape",
         lambda: _mlp(low_rank_adaptation_kernels=[jnp.ones((32, 1, 4), F32)] * 4), ValueError,
         r"low_rank_adaptation_kernels\[1\] has shape \(32, 1, 4\)", r"TransformerEngine's LoRA"),
    case("attention-rank-3", lambda: dot_product_attention(X, X, X), ValueError,
         r"^query must be \[batch, seq, heads, head_dim\]", r"split the hidden axis"),
    case("attention-integer-query",
         lambda: dot_product_attention(*(QKV.astype(jnp.int32),) * 3), TypeError,
         r"^query must be a floating-point array", r"query\.astype\(jnp\.bfloat16\)"),
    case("attention-mask-type",
         lambda: dot_product_attention(QKV, QKV, QKV, attn_mask_type="triangle"), ValueError,
         r"^attn_mask_type must be one of", r"'padding', 'causal'"),
    case("attention-gqa-heads",
         lambda: dot_product_attention(jnp.ones((2, 4, 6, 8), F32), QKV, QKV), ValueError,
         r"query has 6 heads, key/value 4",
         r"query heads must be a multiple of the key/value heads"),
    case("attention-mask-shape",
         lambda: dot_product_attention(QKV, QKV, QKV, jnp.ones((2, 1, 3, 4), bool),
                                       attn_mask_type="padding"),
         ValueError, r"^mask has shape \(2, 1, 3, 4\)", r"\[batch, 1, q_len, kv_len\]"),
    case("attention-float-mask",
         lambda: dot_product_attention(QKV, QKV, QKV, jnp.ones((2, 1, 4, 4), F32),
                                       attn_mask_type="padding"),
         TypeError, r"^mask must be boolean or integer", r"True / nonzero = masked out"),
    case("attention-missing-mask",
         lambda: dot_product_attention(QKV, QKV, QKV, attn_mask_type="padding"), ValueError,
         r"attn_mask_type='padding' needs a mask", r"pass one, or use 'causal'"),
    case("attention-bias-shape",
         lambda: dot_product_attention(QKV, QKV, QKV, None, jnp.ones((3, 3), F32),
                                       attn_mask_type="no_mask"),
         ValueError, r"^bias has shape \(3, 3\)", r"\[batch, heads, q_len, kv_len\]"),
    case("attention-dropout-rate",
         lambda: dot_product_attention(QKV, QKV, QKV, dropout_rate=1.5, dropout_rng=KEY),
         ValueError, r"^dropout_rate must be a probability", r"use 0\.0 for no dropout"),
    case("attention-implementation",
         lambda: dot_product_attention(QKV, QKV, QKV, implementation="flash"), ValueError,
         r"^implementation must be one of", r"None, 'xla', 'cudnn'"),
    case("attention-softmax-type",
         lambda: dot_product_attention(QKV, QKV, QKV, softmax_type="sink"), ValueError,
         r"^softmax_type must be one of", r"'off_by_one', 'learnable'"),
    case("attention-learnable-without-offset",
         lambda: dot_product_attention(QKV, QKV, QKV, softmax_type="learnable"), ValueError,
         r"softmax_type='learnable' needs softmax_offset", r"the attention modules create it"),
    case("attention-score-mod-graph",
         lambda: dot_product_attention(QKV, QKV, QKV, score_mod=lambda graph, score, t: score),
         TypeError, r"^score_mod must take two arguments",
         r"graph\.mul\(score, t\['s'\]\) becomes score \* t\['s'\]"),
    # ------------------------------------------------------------------ Linen modules
    case("linen-dense-features-zero", lambda: _linen_init(te_nn.DenseGeneral(features=0), X),
         ValueError, r"^features must be", r"a positive int or a tuple of them"),
    case("linen-dense-axis", lambda: _linen_init(te_nn.DenseGeneral(features=8, axis=0), X),
         ValueError, r"^axis=0 must name the input's trailing axes", r"e\.g\. axis=-1"),
    case("linen-dense-scalar-input", lambda: _linen_init(te_nn.DenseGeneral(features=8), SCALAR),
         ValueError, r"^DenseGeneral's input has shape \(\) but needs at least one axis",
         r"\[batch\.\.\., features\]; add the missing axes, e\.g\. x\.reshape\(1, -1\)"),
    case("linen-dense-two-axes-rank-1",
         lambda: _linen_init(te_nn.DenseGeneral(features=8, axis=(-2, -1)), jnp.ones(32, F32)),
         ValueError, r"^DenseGeneral's input has shape \(32,\) but needs at least 2 axes",
         r"its last 2 hold the features.*e\.g\. x\[None\]"),
    case("linen-dense-other-input", _linen_apply_other_features, ValueError,
         r"parameter 'kernel' has shape \(32, 8\)", r"initialise it again with an input of"),
    case("linen-dense-integer-input",
         lambda: _linen_init(te_nn.DenseGeneral(features=8), X.astype(jnp.int32)), TypeError,
         r"^DenseGeneral's input must be a floating-point array", r"x\.astype\(jnp\.bfloat16\)"),
    case("linen-dense-dtype-string",
         lambda: _linen_init(te_nn.DenseGeneral(features=8, dtype="bfloat17"), X), TypeError,
         r"^dtype='bfloat17' is not a dtype", r"such as jnp\.bfloat16"),
    case("linen-dense-integer-param-dtype",
         lambda: _linen_init(te_nn.DenseGeneral(features=8, param_dtype=jnp.int32), X),
         TypeError, r"^param_dtype=.*int32.* is not a high-precision floating-point dtype",
         r"use jnp\.float32, jnp\.bfloat16"),
    case("linen-dense-recipe-string",
         lambda: _linen_init(te_nn.DenseGeneral(features=8, recipe="delayed"), X), TypeError,
         r"must be a te_flax\.quantize recipe .* got 'delayed'", r"DelayedScaling, "),
    case("linen-dense-kernel-axes-length",
         lambda: _linen_init(te_nn.DenseGeneral(features=8, kernel_axes=("embed",)), X),
         ValueError, r"logical axes \('embed',\) of parameter 'kernel'",
         r"one logical axis name \(or None\) per dimension"),
    case("linen-dense-fp8-state-missing", _linen_fp8_apply_of_bf16_init, ValueError,
         r"DenseGeneral is applied with the FP8 recipe",
         r"Initialise inside te_flax\.autocast\(enabled=True"),
    case("linen-bf16-apply-of-fp8-variables", _linen_bf16_apply_of_fp8_variables, ValueError,
         r"^DenseGeneral holds the FP8 variables .* but is applied without FP8",
         r"\{'params': variables\['params'\]\}.*migrate_fp8_state\(variables, target, "
         r"drop_extra=True\)"),
    case("linen-layernorm-type",
         lambda: _linen_init(te_nn.LayerNorm(layernorm_type="batch"), X), ValueError,
         r"^layernorm_type must be .* got 'batch'", r'"layernorm" or "rmsnorm"'),
    case("linen-layernorm-scalar-input", lambda: _linen_init(te_nn.LayerNorm(), SCALAR),
         ValueError, r"^LayerNorm's input has shape \(\) but needs at least one axis",
         r"x\.reshape\(1, -1\)"),
    case("linen-layernorm-dense-scalar-input",
         lambda: _linen_init(te_nn.LayerNormDenseGeneral(features=8), SCALAR), ValueError,
         r"^LayerNormDenseGeneral's input has shape \(\) but needs at least one axis",
         r"x\.reshape\(1, -1\)"),
    case("linen-layernorm-mlp-scalar-input",
         lambda: _linen_init(te_nn.LayerNormMLP(intermediate_dim=64), SCALAR), ValueError,
         r"^LayerNormMLP's input has shape \(\) but needs at least one axis",
         r"x\.reshape\(1, -1\)"),
    case("linen-layernorm-dense-axis",
         lambda: _linen_init(te_nn.LayerNormDenseGeneral(features=8, axis=-2), X), ValueError,
         r"^axis=-2 is not supported", r"move the features axis last"),
    case("linen-layernorm-mlp-activation",
         lambda: _linen_init(te_nn.LayerNormMLP(intermediate_dim=64, activations=("swish",)),
                             X),
         ValueError, r"unknown activation 'swish'", r"known: gelu"),
    case("linen-layernorm-mlp-dropout-rate",
         lambda: _linen_init(te_nn.LayerNormMLP(intermediate_dim=64,
                                                intermediate_dropout_rate=2.0), X),
         ValueError, r"^intermediate_dropout_rate must be a probability",
         r"use 0\.0 for no dropout"),
    case("linen-attention-gqa-groups",
         lambda: _linen_init(te_nn.DotProductAttention(head_dim=8, num_attention_heads=4,
                                                       num_gqa_groups=3), QKV, QKV, QKV),
         ValueError, r"num_attention_heads=4 must be a multiple of num_gqa_groups=3",
         r"choose num_gqa_groups among the divisors"),
    case("linen-attention-mask-type",
         lambda: _linen_init(te_nn.DotProductAttention(head_dim=8, num_attention_heads=4,
                                                       attn_mask_type="triangle"),
                             QKV, QKV, QKV),
         ValueError, r"^attn_mask_type must be one of", r"'padding_causal'"),
    case("linen-attention-head-dim",
         lambda: _linen_init(te_nn.DotProductAttention(head_dim=16, num_attention_heads=4,
                                                       transpose_batch_sequence=False),
                             QKV, QKV, QKV),
         ValueError, r"but head_dim=16", r"set head_dim to the input's last axis"),
    case("attention-segment-shape",
         lambda: te_nn.DotProductAttention(head_dim=8, num_attention_heads=4).apply(
             {}, jnp.ones((2, 4, 4, 8), F32), jnp.ones((2, 4, 4, 8), F32),
             jnp.ones((2, 4, 4, 8), F32),
             sequence_descriptor=te_flax.attention.SequenceDescriptor.from_segment_ids_and_pos(
                 jnp.ones((2, 5), jnp.int32), jnp.tile(jnp.arange(5), (2, 1)))),
         ValueError, r"^segment_ids must be \[batch, seq\] with seq 4",
         r"the tensors' sequence axis"),
    case("attention-segment-pos-missing",
         lambda: te_flax.attention.SequenceDescriptor.from_segment_ids_and_pos(
             jnp.ones((2, 4), jnp.int32)),
         ValueError, r"^from_segment_ids_and_pos needs segment_pos", r"pass \[0, 1, 0, 1, 2\]"),
    case("attention-segment-ids-negative",
         lambda: te_flax.attention.SequenceDescriptor.from_segment_ids_and_pos(
             jnp.array([[1, -1]]), jnp.array([[0, 0]])),
         ValueError, r"^segment_ids must be >= 0 .*got -1", r"pad with 0"),
    case("attention-reorder-length",
         lambda: te_flax.attention.reorder_causal_load_balancing(
             jnp.ones((2, 6, 4), F32), te_flax.attention.ReorderStrategy.DualChunkSwap, 2, 1),
         ValueError, r"divisible by 2 x cp_size = 4; got cp_size=2 and length 6",
         r"pad the sequence to a multiple of 4"),
    case("attention-cp-strategy",
         lambda: te_nn.DotProductAttention(
             head_dim=8, num_attention_heads=4, context_parallel_strategy="ulysses"
         ).apply({}, QKV, QKV, QKV),
         ValueError, r"^context_parallel_strategy must be one of .*got 'ulysses'",
         r"any case, or TE's CPStrategy"),
    case("attention-cp-length",
         lambda: _context_parallel_apply(QKV[:, :3]),
         ValueError, r"context parallelism over 2 devices needs a sequence length divisible",
         r"pad the sequence to a multiple of 2"),
    case("attention-cp-unsupported",
         lambda: _context_parallel_apply(QKV, bias=jnp.zeros((1, 4, 4, 4), F32)),
         ValueError, r"^DotProductAttention with context parallelism over 'context' .*got a bias",
         r"drop them, or give the context axis size 1"),
    case("attention-fp8-cp",
         lambda: _context_parallel_apply(QKV, recipe=q.Float8CurrentScaling(fp8_dpa=True)),
         ValueError, r"^FP8 attention .* is not built for context parallelism",
         r"Use a recipe with fp8_dpa=False .* or give the context axis size 1"),
    case("attention-fp8-cudnn",
         lambda: te_nn.DotProductAttention(
             head_dim=8, num_attention_heads=4, implementation="cudnn",
             recipe=q.Float8CurrentScaling(fp8_dpa=True)).apply({}, QKV, QKV, QKV),
         ValueError, r"^FP8 attention .* runs on the XLA attention",
         r"Use implementation='xla' or None"),
    case("linen-mha-rank-2",
         lambda: _linen_init(te_nn.MultiHeadAttention(head_dim=8, num_attention_heads=4),
                             jnp.ones((4, 32), F32), jnp.ones((4, 32), F32)),
         ValueError, r"^inputs_q must be \[batch, seq, hidden\]", r"reshape it to three axes"),
    case("linen-mha-te-spelling",
         lambda: _linen_init(te_nn.MultiHeadAttention(head_dim=8, num_attention_heads=4,
                                                      num_heads=4), X, X),
         TypeError, r"MultiHeadAttention\.num_heads", r"use num_attention_heads instead"),
    case("linen-transformer-heads",
         lambda: _linen_init(te_nn.TransformerLayer(**{**TRANSFORMER,
                                                       "num_attention_heads": 5}), X),
         ValueError, r"hidden_size=32 must be a multiple of num_attention_heads=5",
         r"head_dim = hidden_size / num_attention_heads"),
    case("linen-transformer-input",
         lambda: _linen_init(te_nn.TransformerLayer(**TRANSFORMER), jnp.ones((8, 32), F32)),
         ValueError, r"^inputs must be \[batch, seq, hidden\]", r"reshape it to three axes"),
    case("linen-transformer-layer-type",
         lambda: _linen_init(te_nn.TransformerLayer(**TRANSFORMER, layer_type="encoder"), X),
         ValueError, r"^layer_type must be", r"TransformerLayerType\.ENCODER or \.DECODER"),
    case("linen-transformer-decoder-alone",
         lambda: _linen_init(te_nn.TransformerLayer(
             **TRANSFORMER, layer_type=te_nn.TransformerLayerType.DECODER), X),
         ValueError, r"needs `encoded`", r"use layer_type=ENCODER for a decoder-only"),
    case("linen-transformer-dropout",
         lambda: _linen_init(te_nn.TransformerLayer(**TRANSFORMER, hidden_dropout=1.0), X),
         ValueError, r"^hidden_dropout must be a probability", r"use 0\.0 for no dropout"),
    # ------------------------------------------------------------------ NNX modules
    case("nnx-dense-other-input", lambda: te_nnx.DenseGeneral(64, 8, rngs=_rngs())(X),
         ValueError, r"built for input features \(64,\)", r"build it with in_features set"),
    case("nnx-dense-scalar-input", lambda: te_nnx.DenseGeneral(32, 8, rngs=_rngs())(SCALAR),
         ValueError, r"^DenseGeneral's input has shape \(\) but needs at least one axis",
         r"x\.reshape\(1, -1\)"),
    case("nnx-layernorm-mlp-scalar-input",
         lambda: te_nnx.LayerNormMLP(32, intermediate_dim=64, rngs=_rngs())(SCALAR), ValueError,
         r"^LayerNormMLP's input has shape \(\) but needs at least one axis",
         r"x\.reshape\(1, -1\)"),
    case("nnx-dense-in-features-zero", lambda: te_nnx.DenseGeneral(0, 8, rngs=_rngs()),
         ValueError, r"^in_features must be a positive int", r"e\.g\. in_features=x\.shape"),
    case("nnx-dense-in-features-string", lambda: te_nnx.DenseGeneral("32", 8, rngs=_rngs()),
         ValueError, r"^in_features must be .* got '32'", r"a positive int or a tuple"),
    case("nnx-dense-rngs", lambda: te_nnx.DenseGeneral(32, 8, rngs=0), TypeError,
         r"^rngs must be an nnx\.Rngs", r"e\.g\. rngs=nnx\.Rngs\(0\)"),
    case("nnx-dense-misspelt-attribute",
         lambda: te_nnx.DenseGeneral(32, 8, rngs=_rngs(), use_bais=True), TypeError,
         r"unknown attributes \['use_bais'\]", r"its attributes are .*'use_bias'"),
    case("nnx-layernorm-dense-other-input",
         lambda: te_nnx.LayerNormDenseGeneral(16, 8, rngs=_rngs())(X), ValueError,
         r"LayerNormDenseGeneral was built for input features \(16,\)", r"or reshape the input"),
    case("nnx-layernorm-mlp-intermediate",
         lambda: te_nnx.LayerNormMLP(32, rngs=_rngs(), intermediate_dim=-1), ValueError,
         r"^intermediate_dim must be", r"a positive int"),
    case("nnx-layernorm-param-dtype",
         lambda: te_nnx.LayerNorm(32, rngs=_rngs(), param_dtype=jnp.float8_e4m3fn), TypeError,
         r"^param_dtype=.*float8_e4m3fn.* is not", r"use jnp\.float32, jnp\.bfloat16"),
    case("nnx-mha-gqa-groups",
         lambda: te_nnx.MultiHeadAttention(32, head_dim=8, num_attention_heads=4,
                                           num_gqa_groups=3, rngs=_rngs()),
         ValueError, r"num_gqa_groups=3", r"choose num_gqa_groups among the divisors"),
    case("nnx-transformer-input",
         lambda: _abstract_nnx_transformer()(jnp.ones((2, 4, 16), F32)),
         ValueError, r"^TransformerLayer was built for inputs of 32 features .* have 16",
         r"build it with in_features \(and in_kv_features or encoded_features"),
    case("nnx-transformer-activation",
         lambda: nnx.eval_shape(lambda: te_nnx.TransformerLayer(
             **TRANSFORMER, mlp_activations=("swish",), rngs=_rngs())),
         ValueError, r"unknown activation 'swish'", r"known: gelu"),
    # ------------------------------------------------------------------ quantize
    case("recipe-history-zero", lambda: q.DelayedScaling(amax_history_len=0), ValueError,
         r"DelayedScaling\(amax_history_len=\.\.\.\) must be an int >= 1",
         r"1 keeps only the newest amax"),
    case("recipe-history-too-long", lambda: q.DelayedScaling(amax_history_len=10**9),
         ValueError, r"^DelayedScaling\(amax_history_len=1000000000\) is longer than te_flax "
         r"allows \(65536\)", r"3814\.7 MiB per tensor here\. Use at most 65536"),
    case("recipe-compute-algo", lambda: q.DelayedScaling(amax_compute_algo="mean"), ValueError,
         r"DelayedScaling\(amax_compute_algo=\.\.\.\)", r'"max" or "most_recent"'),
    case("recipe-format-string", lambda: q.DelayedScaling(fp8_format="HYBRID"), TypeError,
         r"DelayedScaling\(fp8_format=\.\.\.\) must be a te_flax\.quantize\.Format",
         r"use Format\.HYBRID"),
    case("recipe-e5m2", lambda: q.Float8CurrentScaling(fp8_format=q.Format.E5M2), ValueError,
         r"Float8CurrentScaling\(fp8_format=Format\.E5M2\)", r"use Format\.HYBRID"),
    case("recipe-fp8-mha", lambda: q.DelayedScaling(fp8_mha=True), ValueError,
         r"^DelayedScaling\(fp8_mha=True\) asks for FP8 multi-head attention",
         r"Leave fp8_mha=False; fp8_dpa=True"),
    case("recipe-fp8-dpa-block", lambda: q.MXFP8BlockScaling(fp8_dpa=True), ValueError,
         r"^MXFP8BlockScaling\(fp8_dpa=True\) asks for FP8 attention, which te_flax builds with "
         r"per-tensor scaling only", r"use DelayedScaling\(fp8_dpa=True\)"),
    case("recipe-margin-nan", lambda: q.DelayedScaling(margin=float("nan")), ValueError,
         r"DelayedScaling\(margin=\.\.\.\)", r"must be a finite number"),
    case("recipe-margin-negative", lambda: q.DelayedScaling(margin=-20), ValueError,
         r"^DelayedScaling\(margin=-20\) cannot work", r"must be from 0 to 14"),
    case("recipe-margin-too-large", lambda: q.DelayedScaling(margin=130), ValueError,
         r"^DelayedScaling\(margin=130\) cannot work", r"underflow to 0"),
    case("recipe-mxfp8-float4", lambda: q.MXFP8BlockScaling(fp8_format=q.Format.E2M1),
         ValueError, r"MXFP8BlockScaling\(fp8_format=Format\.E2M1\)",
         r"or NVFP4BlockScaling\(\) for float4"),
    case("recipe-nvfp4-rounding",
         lambda: q.NVFP4BlockScaling(disable_stochastic_rounding=1), TypeError,
         r"NVFP4BlockScaling\(disable_stochastic_rounding=\.\.\.\)", r"must be a bool"),
    case("factory-mode-and-recipe",
         lambda: q.QuantizerFactory.create_set(
             scaling_mode=q.ScalingMode.CURRENT_TENSOR_SCALING, fp8_recipe=q.DelayedScaling()),
         ValueError, r"takes a scaling_mode or an fp8_recipe, not both", r"recipe is preferred"),
    case("factory-n-groups", lambda: q.QuantizerFactory.create_set(n_groups=0), ValueError,
         r"create_set\(n_groups=\.\.\.\) must be a positive int, got 0",
         r"the number of groups of a grouped GEMM \(experts\), or None"),
    case("factory-grouped-set-in-dense",
         lambda: dense(X, KERNEL, quantizer_set=q.QuantizerFactory.create_set(
             fp8_recipe=q.Float8CurrentScaling(), n_groups=2)),
         ValueError, r"^quantizer_set\.x is a GroupedQuantizer",
         r"build this GEMM's set without n_groups"),
    case("recipe-blockwise-two-2d",
         lambda: q.Float8BlockScaling(x_block_scaling_dim=2), ValueError,
         r"x_block_scaling_dim=2, w_block_scaling_dim=2", r"give one of them 1"),
    case("recipe-blockwise-fast-accumulation",
         lambda: q.Float8BlockScaling(fp8_gemm_fprop=q.MMParams(use_split_accumulator=False)),
         ValueError, r"Float8BlockScaling\(fp8_gemm_fprop=", r"leave use_split_accumulator=True"),
    case("factory-recipe-string", lambda: q.QuantizerFactory.create_set(fp8_recipe="delayed"),
         TypeError, r"^fp8_recipe must be a te_flax\.quantize recipe", r"DelayedScaling, "),
    case("factory-zero-sets",
         lambda: q.QuantizerFactory.create_set(n_quantizer_sets=0,
                                               fp8_recipe=q.DelayedScaling()),
         ValueError, r"^n_quantizer_sets must be a positive int, got 0",
         r"e\.g\. n_quantizer_sets=1"),
    case("factory-rounding-state-shape",
         lambda: q.QuantizerFactory.create_set(
             fp8_recipe=q.NVFP4BlockScaling(),
             quantize_meta_set=q.QuantizeMetaSet(
                 x=q.QuantizeMeta(), kernel=q.QuantizeMeta(),
                 grad=q.QuantizeMeta(stochastic_rounding_rng_state=jnp.ones(3)))),
         ValueError, r"QuantizeMeta\(stochastic_rounding_rng_state=\.\.\.\)",
         r"uint32 of shape \(4,\), or a JAX key"),
    case("autocast-enabled-string", lambda: te_flax.autocast(enabled="yes").__enter__(),
         TypeError, r"autocast\(enabled=\.\.\.\)", r"must be a bool"),
    case("merge-by-max-string", lambda: q.merge_by_max("state"), TypeError,
         r"merge_by_max\(state=\.\.\.\)", r"pass the FP8 collection"),
    case("check-merged-structure",
         lambda: q.check_merged({"x_amax_history": KERNEL}, {"y_amax_history": KERNEL}),
         ValueError, r"previous and the updated FP8 state", r"pass the FP8 collection"),
    case("autocast-recipe-string",
         lambda: te_flax.autocast(enabled=True, recipe="delayed").__enter__(), TypeError,
         r"autocast\(recipe=\.\.\.\) must be a te_flax\.quantize recipe", r"DelayedScaling, "),
    # ------------------------------------------------------------------ training
    case("training-init-without-params",
         lambda: training.init_optimizer(TX, {"kernel": KERNEL}), TypeError,
         r"^variables must be a Flax variable dict", r"with a 'params' collection"),
    case("training-merge-without-params", lambda: training.merge_fp8_state({"kernel": KERNEL}),
         TypeError, r"^variables must be a Flax variable dict", r"with a 'params' collection"),
    case("combine-gradients-reduce",
         lambda: combine_gradients({"params": {"k": KERNEL}}, reduce="median"), ValueError,
         r"combine_gradients\(reduce=\.\.\.\)", r'"mean" averages the parameter gradients'),
    case("combine-gradients-structures",
         lambda: combine_gradients({"params": {"k": KERNEL}}, {"params": {"j": KERNEL}}),
         ValueError, r"gradient dicts of one structure", r"pass the gradients of one model"),
    case("training-optax-state", _apply_gradients_with_optax_state, TypeError,
         r"^opt_state must come from", r"te_flax\.training\.init_optimizer"),
    case("nnx-train-step-optax", lambda: _nnx_train_step(lambda model: TX), TypeError,
         r"^optimizer must be an nnx\.Optimizer", r"nnx\.Optimizer\(model, tx, wrt=nnx\.Param\)"),
    case("nnx-train-step-wrt",
         lambda: _nnx_train_step(lambda model: nnx.Optimizer(model, TX, wrt=nnx.Variable)),
         ValueError, r"optimizer must be built with wrt=nnx\.Param", r"got wrt="),
    # ------------------------------------------------------------------ sharding
    case("sharding-rule-set-name", lambda: sharding.load_axis_rules("dp_tp_xx"),
         FileNotFoundError, r"no rule set 'dp_tp_xx'", r"the shipped ones are \[.*'dp'"),
    case("sharding-rule-set-format",
         lambda tmp_path: sharding.load_axis_rules(_rules_file(tmp_path, "rules: {a: b}\n")),
         ValueError, r"rules\.yaml", r"expected 'rules: \[\[logical_name, mesh_axes\]"),
    case("sharding-rule-mesh-axis",
         lambda tmp_path: sharding.load_axis_rules(
             _rules_file(tmp_path, "rules: [[batch, model]]\n")),
         ValueError, r"the rule \['batch', 'model'\] names mesh axes \['model'\]",
         r"map 'batch' to one of those"),
    case("sharding-unknown-logical-axis",
         lambda: _constraint_under(sharding.load_axis_rules("dp"), {"data": 8},
                                   ("batch", "length", "embd")),
         ValueError, r"logical axis names \['embd'\]", r"fix the spelling, or add a rule"),
    case("sharding-rule-to-missing-mesh-axis",
         lambda: _constraint_under((("batch", "model"),), {"data": 8}, ("batch", None, None)),
         ValueError, r"map 'batch' to mesh axis 'model'", r"fix the rule, or build the mesh"),
    case("sharding-mesh-axis-name", lambda: sharding.make_mesh({"model": 8}), ValueError,
         r"unknown mesh axes \['model'\]", r"use only those in mesh_shape"),
    case("sharding-mesh-size", lambda: sharding.make_mesh({"data": 3}), ValueError,
         r"has 3 devices, not 8", r"mesh_shape sizes whose product is 8"),
    case("sharding-mesh-negative", lambda: sharding.make_mesh({"data": -8}), ValueError,
         r"^mesh_shape\['data'\] must be a positive int, got -8", r"e\.g\. make_mesh\("),
    case("sharding-constraint-length",
         lambda: sharding.with_logical_constraint(X, ("batch", "embed")), ValueError,
         r"logical axes \('batch', 'embed'\) name 2 dimensions",
         r"give one name \(or None\) per dimension"),
    case("mesh-resource-axis-type", lambda: sharding.MeshResource(dp_resource=0), TypeError,
         r"MeshResource\(dp_resource=0\)", r"one mesh axis name \(a str\) or None"),
    case("mesh-resource-guard-type",
         lambda: sharding.global_shard_guard({"dp_resource": "data"}).__enter__(), TypeError,
         r"global_shard_guard takes a MeshResource, got \{'dp_resource'",
         r"e\.g\. global_shard_guard\(MeshResource\("),
    case("mesh-resource-not-active", sharding.global_mesh_resource, ValueError,
         r"no MeshResource is active", r"wrap the code in .*global_shard_guard"),
    case("mesh-resource-tp-and-tpsp",
         lambda: _resource_rules(sharding.MeshResource(tp_resource="fsdp",
                                                       tpsp_resource="tensor")),
         ValueError, r"tp_resource='fsdp', tpsp_resource='tensor'\)", r"set one of them"),
    case("mesh-resource-unknown-axis",
         lambda: _resource_rules(sharding.MeshResource(tp_resource="model")), ValueError,
         r"names mesh axis 'model', but the mesh has axes",
         r"name one of those, or build the mesh with that axis"),
    # ------------------------------------------------------------------ checkpoint conversion
    case("convert-not-a-mapping", lambda: convert.from_transformer_engine([KERNEL]), TypeError,
         r"^variables must be a mapping of collections", r"pass the whole variable dict"),
    case("convert-one-collection", lambda: convert.from_transformer_engine({"kernel": KERNEL}),
         ValueError, r"variables hold neither 'params' nor 'fp8_metas'",
         r"pass the whole variable dict"),
    case("convert-already-converted",
         lambda: convert.from_transformer_engine({"params": {}, "fp8_metas": {},
                                                  "_overwrite_with_gradient": {}}),
         ValueError, r"already hold a '_overwrite_with_gradient' collection",
         r"pass it as it is"),
    case("convert-unknown-fp8-variable",
         lambda: convert.from_transformer_engine({"params": {}, "fp8_metas": {"x_amax": KERNEL}}),
         ValueError, r"unexpected FP8 variable 'x_amax' in 'fp8_metas'",
         r"only '\*_scale' and '\*_amax_history'"),
    case("convert-scalar-history",
         lambda: convert.from_transformer_engine(
             {"params": {}, "fp8_metas": {"x_amax_history": jnp.float32(1.0)}}),
         ValueError, r"'x_amax_history' has shape \(\)", r"1-D \[amax_history_len\]"),
    case("nnx-load-linen-variables",
         lambda: te_nnx.load_linen_variables(te_nnx.DenseGeneral(32, 8, rngs=_rngs()),
                                             {"params": {}}),
         ValueError, r"'params' collection does not fit DenseGeneral: missing .*'kernel'",
         r"pass the variables of the Linen module"),
    # ------------------------------------------------------------------ stock Flax models
    case("quantize-model-recipe", lambda: te_flax.quantize_model(nn.Dense(8), "fp8", X),
         TypeError, r"^quantize_model\(recipe=\) must be a te_flax\.quantize recipe",
         r"DelayedScaling"),
    case("quantize-model-rule-selects-nothing",
         lambda: te_flax.quantize_model(nn.Dense(8), q.DelayedScaling(), X,
                                        rules=[te_flax.QuantizeRule(module_path="mlp/.*")]),
         ValueError, r"module_path='mlp/\.\*'.* selects no product .* <root> \(dot_general\)",
         r"Fix the rule's module_path"),
    case("quantize-model-not-a-model",
         lambda: te_flax.quantize_model(jnp.tanh, q.DelayedScaling(), X), TypeError,
         r"^quantize_model takes a flax\.linen\.Module or a flax\.nnx\.Module",
         r"pass the model object"),
    case("dot-general-cls-batch-dims",
         lambda: nn.DenseGeneral(8, batch_dims=(0,), dot_general_cls=te_nn.make_dot_general_cls(
             q.DelayedScaling())).init(KEY, X), ValueError, r"it has batch dimensions",
         r"leave this layer in high precision"),
    # ------------------------------------------------------------------ example configuration
    case("config-unknown-key", lambda: load_config(overrides=["train.stpes=10"]),
         ConfigError, r"train\.stpes is not a configuration key", r"did you mean 'steps'"),
    case("config-recipe-value", lambda: load_config(overrides=["train.recipe=fp8"]), ConfigError,
         r"^train\.recipe='fp8' is not one of", r"'delayed', 'current'"),
    case("config-override-syntax", lambda: load_config(overrides=["train.steps"]), ConfigError,
         r"got \['train\.steps'\]", r"overrides must be key=value, e\.g\. train\.steps=100"),
    case("config-zero-batch", lambda: load_config(overrides=["train.batch=0"]), ConfigError,
         r"^train\.batch must be >= 1", r"set train\.batch to a positive int"),
    case("config-te-block-sizes",
         lambda: load_config(overrides=["model.block=te", "model.d_model=100"]), ConfigError,
         r"model\.block=te .* got d_model=100",
         r"needs model\.d_model = model\.heads \* model\.head_dim"),
]
# fmt: on


@pytest.mark.parametrize(("call", "error", "names", "fix"), CASES)
def test_bad_input(call, error, names, fix, tmp_path):
    arguments = (tmp_path,) if call.__code__.co_varnames[:1] == ("tmp_path",) else ()
    with pytest.raises(error) as info:
        call(*arguments)
    assert type(info.value) is error, f"raised {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert re.search(names, message), f"the message does not name the argument: {message}"
    assert re.search(fix, message), f"the message does not say the fix: {message}"


def test_every_case_is_documented():
    """Every case id appears in the table of docs/bad_inputs.md, and nothing else does."""
    page = DOCS_PAGE.read_text()
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", page, flags=re.MULTILINE)
    ids = [param.id for param in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert len(ids) >= 40
    assert sorted(documented) == sorted(ids)
