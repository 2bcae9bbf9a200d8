"""The Pallas kernels in programs partitioned over a mesh, on 8 CPU devices in interpret mode.

Each kernel runs on every device's block (``te_flax._ops.kernels.partition``): the results equal the
unpartitioned program's (float8 data and amax histories bit for bit, float32 gradients within
their sum order), and the program has the collectives of the XLA-stage program, no gather added.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_flax._ops.kernels import (
    activation_grad_operand,
    activation_quantize_operand,
    pallas_kernels,
    tiled_quantize_operand,
)
from te_flax._ops.kernels.partition import mesh_partitioned
from te_flax._tools.hlo import parse_collectives
from te_flax.layernorm_dense import layernorm_dense
from te_flax.quantize import (
    LEADING,
    TRAILING,
    DelayedScaling,
    Float8CurrentScaling,
    QuantizerFactory,
)
from te_flax.quantize.tensor_quantizers import quantize_operand
from te_flax.sharding import make_mesh
from tests.helpers import normal

BATCH, SEQ, HIDDEN, FEATURES = 4, 8, 64, 128
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}
# (x, kernel) layouts on a data x tensor mesh: sequence and tensor parallel (the rows split
# both ways, the kernel's outputs over tensor) and tensor parallel (the rows over data).
# The norm kernels need whole rows: where the norm's hidden axis is split
# (a kernel's input axis split with nothing constraining the activations), its rows are
# gathered, where XLA's stage reduces partial row sums instead; the shipped rule sets never
# split it.
LAYOUTS = {
    "tp_sp": (P("data", "tensor", None), P(None, "tensor")),
    "tp": (P("data", None, None), P(None, "tensor")),
}
PARTITIONED_CALL = "CustomSPMDPartitioning"  # custom_partitioning's call in the lowered program


@functools.cache
def _mesh() -> jax.sharding.Mesh:
    return make_mesh({"data": 2, "tensor": 4})


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    x = normal(keys[0], (BATCH, SEQ, HIDDEN)) * 2.0 + 1.0
    kernel = normal(keys[1], (HIDDEN, FEATURES)) * 0.1
    gamma = 1.0 + 0.1 * normal(keys[2], (HIDDEN,))
    beta = 0.1 * normal(keys[3], (HIDDEN,))
    return x, kernel, gamma, beta


def _step(recipe: str):
    def loss(x, kernel, gamma, beta, quantizers):
        out = layernorm_dense(x, kernel, gamma, beta, quantizer_set=quantizers)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


@functools.cache
def _unpartitioned(recipe: str):
    quantizers = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe])
    with pallas_kernels("1"):
        return jax.jit(_step(recipe))(*_inputs(), quantizers)


def _partitioned(recipe: str, layout: str, switch: str = "1"):
    """The step's results, its optimized HLO and its kernel calls with a partitioning rule, on the
    mesh, ``x`` and the kernel sharded."""
    x_spec, kernel_spec = LAYOUTS[layout]
    mesh = _mesh()
    x, kernel, gamma, beta = _inputs()
    quantizers = QuantizerFactory.create_set(fp8_recipe=RECIPES[recipe])
    with jax.set_mesh(mesh), pallas_kernels(switch):
        x = jax.device_put(x, NamedSharding(mesh, x_spec))
        kernel = jax.device_put(kernel, NamedSharding(mesh, kernel_spec))
        step = jax.jit(_step(recipe))
        args = (x, kernel, gamma, beta, quantizers)
        lowered = step.lower(*args)
        partitioned_calls = lowered.as_text().count(PARTITIONED_CALL)
        return step(*args), lowered.compile().as_text(), partitioned_calls


def _assert_equal(actual, expected) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, want), got in zip(leaves, jax.tree.leaves(actual), strict=True):
        want, got = np.asarray(want), np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, jax.tree_util.keystr(path)
        if want.dtype == np.float32:  # gradients: GEMM and norm partial sums in another order
            scale = float(np.sqrt(np.mean(np.square(want)))) or 1.0
            np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=0, err_msg=str(path))
        else:
            np.testing.assert_array_equal(got, want, jax.tree_util.keystr(path))


def tensor_collectives(hlo_text: str) -> tuple[list[tuple[str, str, str]], set[str]]:
    """The collectives' inputs of more than a few values (kind, element type, dims), sorted,
    and the element types of the small ones (the amaxes and the loss)."""
    tensors, small = [], set()
    for collective in parse_collectives(hlo_text):
        for element_type, dims in collective.operands:
            if math.prod(dims) > 16:
                tensors.append((collective.kind, element_type, ",".join(map(str, dims))))
            else:
                small.add(element_type)
    return sorted(tensors), small


@pytest.mark.parametrize(
    ("recipe", "layout"),
    [
        ("delayed", "tp_sp"),
        ("current", "tp"),
    ],
)
def test_partitioned_step_with_kernels_equals_unpartitioned(recipe, layout):
    results, hlo_text, partitioned_calls = _partitioned(recipe, layout)
    _assert_equal(results, _unpartitioned(recipe))
    # Every kernel ran on the blocks: the norm-quantize, the kernel's quantize and the norm
    # backward (each twice under current scaling: the amax pass, then the quantizing pass).
    assert partitioned_calls == (3 if recipe == "delayed" else 5)
    # No collective added for the kernels: every collective of a tensor is one the XLA stages'
    # program has too (the norm's reductions over both mesh axes take one all-reduce each where
    # XLA's take two); the amaxes' all-reduces may be combined otherwise.
    _, xla_stages, none = _partitioned(recipe, layout, switch="0")
    assert none == 0
    (large, small), (xla_large, xla_small) = (
        tensor_collectives(hlo_text),
        tensor_collectives(xla_stages),
    )
    assert not Counter(large) - Counter(xla_large), (large, xla_large)
    assert [c for c in xla_large if c[0] == "all-gather"] == [
        c for c in large if c[0] == "all-gather"
    ]
    assert small <= xla_small


def test_activation_grad_kernel_per_shard_with_bias():
    keys = jax.random.split(jax.random.key(1), 2)
    grad = normal(keys[0], (BATCH, SEQ, FEATURES)).astype(jnp.bfloat16)
    pre_activation = normal(keys[1], (BATCH, SEQ, 2, FEATURES)).astype(jnp.bfloat16)
    quantizer = QuantizerFactory.create_set(fp8_recipe=RECIPES["delayed"]).dgrad
    quantizer = quantizer.update(jnp.float32(3.0))  # a scale other than 1

    def unused():
        raise AssertionError("the kernel runs everywhere under pallas_kernels('1')")

    def prepared(grad, pre_activation, quantizer):
        assert mesh_partitioned() == (not jax.sharding.get_abstract_mesh().empty)
        return activation_grad_operand(
            grad, pre_activation, ("silu", "linear"), quantizer, jnp.float32, unused, unused
        )

    with pallas_kernels("1"):
        expected = jax.jit(prepared)(grad, pre_activation, quantizer)
    mesh = _mesh()
    with jax.set_mesh(mesh), pallas_kernels("1"):
        # Tokens over data, the intermediate axis over tensor (tensor parallel MLP).
        grad = jax.device_put(grad, NamedSharding(mesh, P("data", None, "tensor")))
        pre = jax.device_put(pre_activation, NamedSharding(mesh, P("data", None, None, "tensor")))
        actual = jax.jit(prepared)(grad, pre, quantizer)
    _assert_equal(actual, expected)
    assert actual.bias is not None and actual.bias.shape == (2, FEATURES)


def test_activation_quantize_kernel_per_shard():
    """The forward activation's kernel on tensor-parallel blocks: the same float8 data and
    amax (in a partitioned program it writes the data alone; XLA lays it out for wgrad)."""
    pre_activation = normal(jax.random.key(2), (BATCH, SEQ, 2, FEATURES)).astype(jnp.bfloat16)
    quantizer = QuantizerFactory.create_set(fp8_recipe=RECIPES["delayed"]).x
    quantizer = quantizer.update(jnp.float32(3.0))  # a scale other than 1

    def unused():
        raise AssertionError("the kernel runs everywhere under pallas_kernels('1')")

    def operand(pre_activation, quantizer):
        result, new_quantizer = activation_quantize_operand(
            pre_activation, ("silu", "linear"), quantizer, (TRAILING, LEADING), unused
        )
        return result.data, result.scale_inv, new_quantizer

    with pallas_kernels("1"):
        expected = jax.jit(operand)(pre_activation, quantizer)
    mesh = _mesh()
    with jax.set_mesh(mesh), pallas_kernels("1"):
        pre = jax.device_put(pre_activation, NamedSharding(mesh, P("data", None, None, "tensor")))
        actual = jax.jit(operand)(pre, quantizer)
    _assert_equal(actual, expected)


def test_vmapped_kernel_on_a_mesh_runs_the_xla_stage():
    # Dense's stages run under vmap over groups: the kernels' partitioning rule has no batching
    # rule, so on a mesh the XLA stage quantizes each group (the same float8 data).
    quantizer = QuantizerFactory.create_set(fp8_recipe=RECIPES["delayed"]).kernel
    groups = normal(jax.random.key(2), (2, HIDDEN, FEATURES))
    uses = (TRAILING, LEADING)

    def quantized(groups):
        def one(kernel):
            def xla_stage():
                return quantize_operand(kernel, quantizer, kernel.dtype, 1, uses)

            return tiled_quantize_operand(kernel, quantizer, 1, uses, xla_stage)[0].data

        return jax.vmap(one)(groups)

    with pallas_kernels("1"):
        expected = jax.jit(quantized)(groups)
    with jax.set_mesh(_mesh()), pallas_kernels("1"):
        actual = jax.jit(quantized)(groups)
    _assert_equal(actual, expected)
