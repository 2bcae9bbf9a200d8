"""Rematerialization keeps the quantized operands: under ``jax.checkpoint`` with
``save_only_these_names`` of the layer's ``quantization_checkpoint_name`` (and, for
``LayerNormMLP``, the pre-activation's ``ffn1_ckpt_name``, which its backward also reads), the
compiled training step quantizes no forward operand again in the backward. Checked on the
deviceless H100 program: the step has exactly as many float8 (and NVFP4 float4) casts as the
same step without remat, for every recipe. Saving the quantized operands alone is not enough
for ``LayerNormMLP`` (its backward recomputes the pre-activation from quantized operands), which
shows that the count sees a re-quantization.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

import te_flax.linen as te_nn
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from tests.gpu_target import h100_sharding

pytestmark = pytest.mark.gpu_compile

NAME = "quantized"
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=16),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "blockwise": Float8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
# A cast to a float8 or float4 type: one quantization of one tensor (or of one layout of it).
_LOW_PRECISION_CAST = re.compile(r"= f(?:8e[0-9a-z]+|4e2m1fn)\[[^\]]*\]\S* convert\(")


def _casts(layer, names: tuple[str, ...] | None) -> int:
    """Low-precision casts in the compiled gradient step of ``sum(layer(x) * cotangent)``: a
    loss linear in the output, so that the backward needs no output of the layer."""
    x = jnp.ones((2, 256, 256), jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    rest = {name: value for name, value in variables.items() if name != "params"}

    def loss(params, rest, x, cotangent):
        out = layer.apply({**rest, "params": params}, x)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    if names is not None:
        loss = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(*names))
    out_shape = jax.eval_shape(layer.apply, variables, x)
    out_shape = out_shape[0] if isinstance(out_shape, tuple) else out_shape
    sharding = h100_sharding()
    arguments = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        (variables["params"], rest, x, jax.ShapeDtypeStruct(out_shape.shape, jnp.float32)),
    )
    text = jax.jit(jax.grad(loss)).lower(*arguments).compile().as_text()
    return len(_LOW_PRECISION_CAST.findall(text))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_layernorm_mlp_quantizes_nothing_again_with_its_names_saved(recipe):
    layer = te_nn.LayerNormMLP(
        intermediate_dim=512,
        activations=("gelu",),
        recipe=RECIPES[recipe],
        quantization_checkpoint_name=NAME,
    )
    without_remat = _casts(layer, None)
    assert without_remat >= 4  # x, kernel 1, the activation and kernel 2, at least
    assert _casts(layer, (NAME, "ffn1")) == without_remat


def test_saving_only_the_quantized_operands_recomputes_the_mlp_pre_activation():
    layer = te_nn.LayerNormMLP(
        intermediate_dim=512, recipe=RECIPES["delayed"], quantization_checkpoint_name=NAME
    )
    # GEMM 1 runs again for the pre-activation, so x and kernel 1 are quantized again.
    assert _casts(layer, (NAME,)) == _casts(layer, None) + 2


@pytest.mark.parametrize(
    ("module", "recipe"),
    [("DenseGeneral", "delayed"), ("LayerNormDenseGeneral", "mxfp8"), ("DenseGeneral", "nvfp4")],
)
def test_dense_layers_quantize_nothing_again_with_the_name_saved(module, recipe):
    layer = getattr(te_nn, module)(
        features=256, recipe=RECIPES[recipe], quantization_checkpoint_name=NAME
    )
    assert _casts(layer, (NAME,)) == _casts(layer, None)
