"""quantize_model's products on XLA:GPU, checked with a deviceless compile for an H100.

A training step of a stock NNX model and a stock Linen model, quantized by one call, compiles
to three FP8 cuBLASLt GEMMs per selected product (forward, dgrad, wgrad), and to no other GEMM.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

import te_flax
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from tests.gpu_target import h100_sharding
from tests.test_gpu_compile import FP8_GEMM, assert_no_other_gemm, parse_gemms

pytestmark = pytest.mark.gpu_compile

TOKENS, HIDDEN, MLP, EXPERTS = 256, 256, 512, 2


class StockMLP(nnx.Module):
    """Two nnx.Linear layers and two expert einsums over parameters: four products."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(HIDDEN, MLP, rngs=rngs)
        self.down = nnx.Linear(MLP, HIDDEN, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, HIDDEN, MLP)))
        self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, MLP, HIDDEN)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.down(jax.nn.relu(self.up(x)))
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, self.w_in[...]))
        return jnp.einsum("tef,efd->td", hidden, self.w_out[...])


class StockLinen(nn.Module):
    """nn.Dense, nn.DenseGeneral and nn.Einsum: three products."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(MLP)(x)
        x = nn.DenseGeneral((2, HIDDEN // 2))(jax.nn.relu(x))
        return nn.Einsum((2, HIDDEN // 2, HIDDEN), "thd,hdf->tf")(x)


def _abstract(tree):
    sharding = h100_sharding()
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype, sharding=sharding), tree
    )


def _nnx_step_hlo(recipe) -> str:
    x = jnp.zeros((TOKENS, HIDDEN), jnp.bfloat16)
    model = te_flax.quantize_model(StockMLP(nnx.Rngs(0)), recipe, x, bare_products=True)
    graphdef, state = nnx.split(model)

    def loss(state, x):
        out = nnx.merge(graphdef, state)(x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(_abstract(state), _abstract(x)).compile().as_text()


def _linen_step_hlo(recipe) -> str:
    x = jnp.zeros((TOKENS, HIDDEN), jnp.bfloat16)
    model = te_flax.quantize_model(StockLinen(), recipe, x)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(variables, x):
        out = model.apply(variables, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(_abstract(variables), _abstract(x)).compile().as_text()


@pytest.mark.parametrize(
    ("front_end", "recipe", "products"),
    [
        ("nnx", DelayedScaling(), 4),
        ("linen", Float8CurrentScaling(), 3),
    ],
)
def test_every_selected_product_is_three_fp8_gemms(front_end, recipe, products):
    # Stock models mix bfloat16 activations with float32 parameters: JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        hlo = (_nnx_step_hlo if front_end == "nnx" else _linen_step_hlo)(recipe)
    gemms = parse_gemms(hlo)
    assert [gemm.target for gemm in gemms] == [FP8_GEMM] * (3 * products), gemms
    assert_no_other_gemm(hlo, FP8_GEMM)
