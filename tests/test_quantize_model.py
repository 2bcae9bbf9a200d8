"""te_flax.quantize_model on stock Flax models: which products it selects, equality with the
same model written with te_flax's layers, FP8 state across steps, rules, and composition."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_flax
import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax import training
from te_flax._quantize_model.bare_products import parameter_products
from te_flax.quantize import DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
from tests.helpers import BLOCK_FORWARD_TOLERANCE, FP8_FORWARD_TOLERANCE

RECIPE = DelayedScaling(amax_history_len=4)
OWG = "_overwrite_with_gradient"
D, VOCAB, EXPERTS = 32, 64, 2
KEY = jax.random.key(0)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # [b, t, d] each
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D)  # batched: stays as it is
        return self.out(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), v))


class MoE(nnx.Module):
    """Experts as einsums over parameters (every expert sees every token, gate-weighted)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.router = nnx.Linear(D, EXPERTS, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, D, 2 * D)))
        self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, 2 * D, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        gates = jax.nn.softmax(self.router(x), axis=-1)  # [b, t, e]
        hidden = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, self.w_in[...]))
        return jnp.einsum("btef,efd->btd", hidden * gates[..., None], self.w_out[...])


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.attn = Attention(rngs)
        self.moe = MoE(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm(x))
        return x + self.moe(x)


class GPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs)])
        self.lm_head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, VOCAB)


def _fp8_paths(model: nnx.Module) -> set[str]:
    state = nnx.state(model, te_nnx.Fp8Meta)
    return {
        "/".join(str(k) for k in path[:-1]) + ":" + str(path[-1]).split("_amax")[0]
        for path, _ in nnx.to_flat_state(state)
        if "amax_history" in str(path[-1])
    }


def _loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    logits = model(tokens)
    return jnp.mean(
        jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
    )


def test_stock_nnx_gpt_selects_projections_and_experts():
    model = GPT(nnx.Rngs(0))
    reference = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    with pytest.warns(te_flax.QuantizeModelNote, match="batch dimensions"):
        # The experts and attention are bare jnp.einsum calls: the fallback sees them.
        model = te_flax.quantize_model(model, RECIPE, TOKENS, bare_products=True)
    expected = set()
    for layer in ("blocks/0",):
        for module in ("attn/qkv", "attn/out"):
            expected |= {f"{layer}/{module}:{role}" for role in ("x", "kernel", "grad")}
        # The module's two einsums over expert parameters: postfixes "" and "_1".
        expected |= {f"{layer}/moe:{r}{p}" for r in ("x", "kernel", "grad") for p in ("", "_1")}
    assert _fp8_paths(model) == expected  # embed, lm_head and the routers stay as they were
    out = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    # A chain of FP8 GEMMs to the output (0.080 measured with two blocks): twice one GEMM's bound.
    assert 0 < error < 2 * FP8_FORWARD_TOLERANCE

    # Training and FP8 state updates: the tests below and examples/stock_nnx.


class StockMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


class TeMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = te_nnx.DenseGeneral(D, 2 * D, use_bias=False, recipe=RECIPE, rngs=rngs)
        self.down = te_nnx.DenseGeneral(2 * D, D, use_bias=False, recipe=RECIPE, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


def test_quantized_nnx_model_equals_the_model_written_with_te_flax_layers():
    x = jax.random.normal(jax.random.key(2), (16, D))
    stock = te_flax.quantize_model(StockMLP(nnx.Rngs(0)), RECIPE, x)
    te_model = TeMLP(nnx.Rngs(0))
    te_model.up.kernel[...] = stock.up.kernel[...]
    te_model.down.kernel[...] = stock.down.kernel[...]

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    step = nnx.jit(te_nnx.value_and_grad(loss, update_fp8_state=True))
    for scale in (1.0, 3.0):  # the second step uses the first step's scales
        stock_loss, stock_grads = step(stock, scale * x)
        te_loss, te_grads = step(te_model, scale * x)
        np.testing.assert_array_equal(stock_loss, te_loss)
        for name in ("up", "down"):
            np.testing.assert_array_equal(
                stock_grads[name]["kernel"][...], te_grads[name]["kernel"][...]
            )
    np.testing.assert_array_equal(
        nnx.state(stock, te_nnx.Fp8Meta)["up"]["x_amax_history"][...],
        nnx.state(te_model, te_nnx.Fp8Meta)["up"]["x_amax_history"][...],
    )
    assert np.count_nonzero(stock.down.grad_amax_history[...]) == 2


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(2 * D, use_bias=False, name="up")(x)
        x = nn.DenseGeneral((2, D), name="split")(jax.nn.relu(x))  # [b, 2, D]
        x = nn.Einsum((2, D, D), "bhd,hdf->bf", name="merge")(x)
        return nn.Dense(VOCAB, name="lm_head")(x)


def test_stock_linen_model_state_under_calling_modules_and_equal_to_te_dense():
    x = jax.random.normal(jax.random.key(3), (16, D))
    model = te_flax.quantize_model(LinenModel(), RECIPE, x)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    plain = jax.jit(LinenModel().init)(jax.random.key(0), x)
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(plain["params"])
    assert sorted(variables[OWG]) == ["merge", "split", "up"]  # the head stays as it was
    loss = training.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2))
    _, grads = jax.jit(loss)(variables, x)
    # "up" equals te_flax's DenseGeneral with the same kernel and state: the same new state.
    te_layer = te_nn.DenseGeneral(2 * D, use_bias=False, recipe=RECIPE)
    te_vars = {"params": {"kernel": variables["params"]["up"]["kernel"]}, OWG: variables[OWG]["up"]}
    _, te_grads = jax.jit(training.value_and_grad(lambda v, x: jnp.sum(te_layer.apply(v, x))))(
        te_vars, x
    )
    np.testing.assert_array_equal(
        grads[OWG]["up"]["x_amax_history"], te_grads[OWG]["x_amax_history"]
    )
    np.testing.assert_array_equal(
        grads[OWG]["up"]["kernel_amax_history"], te_grads[OWG]["kernel_amax_history"]
    )
    out = jax.jit(model.apply)(variables, x)
    reference = jax.jit(LinenModel().apply)(plain | {"params": variables["params"]}, x)
    error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert 0 < error < FP8_FORWARD_TOLERANCE


def test_rules_select_by_path_and_operation():
    rules = [
        te_flax.QuantizeRule(module_path=r".*/moe", op_names=("einsum",)),
        te_flax.QuantizeRule(module_path=r".*attn/qkv"),
    ]
    model = te_flax.quantize_model(
        GPT(nnx.Rngs(0)), RECIPE, TOKENS, rules=rules, bare_products=True
    )
    layers = {path.split(":")[0] for path in _fp8_paths(model)}
    assert layers == {"blocks/0/moe", "blocks/0/attn/qkv"}


def test_bad_inputs_name_the_fix():
    with pytest.raises(TypeError, match="recipe"):
        te_flax.quantize_model(StockMLP(nnx.Rngs(0)), "fp8", jnp.ones((4, D)))
    with pytest.raises(ValueError, match=r"up \(dot_general\)") as error:
        te_flax.quantize_model(
            StockMLP(nnx.Rngs(0)),
            RECIPE,
            jnp.ones((4, D)),
            rules=[te_flax.QuantizeRule(module_path="mlp/.*")],
        )
    assert "down (dot_general)" in str(error.value)
    with pytest.raises(TypeError, match=r"linen\.Module or a flax\.nnx\.Module"):
        te_flax.quantize_model(lambda x: x, RECIPE, jnp.ones((4, D)))


class ScannedLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.relu(self.proj(x))


class ScannedStack(nnx.Module):
    """Layers built stacked with nnx.vmap and run with nnx.scan, as in Flax's guides."""

    layer_type: type[nnx.Module] = ScannedLayer

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs):
            return self.layer_type(rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return body(x, self.layers)


class LinenScannedLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return x + jax.nn.relu(nn.remat(nn.Dense)(D)(x)), None


class LinenScannedStack(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layers = nn.scan(
            LinenScannedLayer,
            variable_axes={"params": 0, OWG: 0},
            split_rngs={"params": True},
            length=3,
        )
        return layers()(x, None)[0]


def test_scan_over_layers_keeps_one_fp8_state_per_layer():
    x = jax.random.normal(jax.random.key(4), (16, D))
    model = te_flax.quantize_model(ScannedStack(nnx.Rngs(0)), RECIPE, x)
    assert model.layers.proj.x_amax_history[...].shape == (3, 4)
    step = nnx.jit(te_nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2), update_fp8_state=True))
    step(model, x)
    history = model.layers.proj.x_amax_history[...]
    assert np.all(history[:, 0] > 0) and len(set(np.asarray(history[:, 0]).tolist())) == 3

    linen = te_flax.quantize_model(LinenScannedStack(), RECIPE, x)  # scan and remat
    variables = jax.jit(linen.init)(jax.random.key(0), x)
    loss = training.value_and_grad(lambda v, x: jnp.mean(linen.apply(v, x) ** 2))
    _, grads = jax.jit(loss)(variables, x)
    (layer_state,) = jax.tree.leaves(
        grads[OWG], is_leaf=lambda node: isinstance(node, dict) and "x_amax_history" in node
    )
    assert layer_state["x_amax_history"].shape == (3, 4)
    assert np.all(layer_state["x_amax_history"][:, 0] > 0)


def test_block_scaled_recipes_run_through_quantize_model():
    x = jax.random.normal(jax.random.key(5), (32, 2 * D))
    errors = {}
    for recipe in (MXFP8BlockScaling(), NVFP4BlockScaling()):  # NVFP4 rounds stochastically
        model = te_flax.quantize_model(
            nnx.Sequential(nnx.Linear(2 * D, 2 * D, rngs=nnx.Rngs(0))), recipe, x
        )
        linear = model.layers[0]
        reference = x @ linear.kernel[...] + linear.bias[...][None]
        step = nnx.jit(te_nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2)))
        _, grads = step(model, x)
        assert np.all(np.isfinite(grads["layers"][0]["kernel"][...]))
        out = nnx.jit(lambda m, x: m(x))(model, x)
        errors[type(recipe).__name__] = float(
            jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
        )
    assert 0 < errors["MXFP8BlockScaling"] < BLOCK_FORWARD_TOLERANCE["mxfp8"]
    assert 0 < errors["NVFP4BlockScaling"] < BLOCK_FORWARD_TOLERANCE["nvfp4"]


class ShardedMLP(nn.Module):
    """Stock layers whose kernels carry logical axes, as a sharded model's do."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def init(*axes):
            return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)

        h = nn.Dense(2 * D, use_bias=False, kernel_init=init("embed", "mlp"), name="up")(x)
        return nn.Dense(D, use_bias=False, kernel_init=init("mlp", "embed"), name="down")(
            jax.nn.relu(h)
        )


def test_sharded_step_equals_the_one_device_step():
    x = jax.random.normal(jax.random.key(6), (16, D))
    model = te_flax.quantize_model(ShardedMLP(), RECIPE, x)
    loss = jax.jit(training.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), x))
    expected = loss(variables, x)
    with te_flax.sharding.use_sharding("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}):
        rules = nn.get_logical_axis_rules()
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(abstract), jax.sharding.get_mesh(), rules
        )
        sharded = nn.meta.unbox(jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x))
        assert tuple(sharded["params"]["up"]["kernel"].sharding.spec) == ("fsdp", "tensor")
        result = loss(sharded, x)
    # The amax is global under jit: the same FP8 state and, up to float32 sums, the same step.
    jax.tree.map(np.testing.assert_array_equal, result[1][OWG], expected[1][OWG])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
        result[1]["params"],
        expected[1]["params"],
    )


class Reused(nnx.Module):
    """One layer applied twice (weight sharing): one FP8 state, two uses per step."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = self.proj(x)
        return x


def test_a_reused_call_site_merges_its_state_by_max():
    x = jax.random.normal(jax.random.key(7), (16, D))
    model = te_flax.quantize_model(Reused(nnx.Rngs(0)), RECIPE, x)
    assert model.proj.x_amax_history[...].shape == (4,)  # one state for both uses
    first = x @ model.proj.kernel[...]
    step = nnx.jit(te_nnx.value_and_grad(lambda m, x: jnp.sum(m(x)), update_fp8_state=True))
    step(model, x)
    # The max of the two uses' amax (x, then the first output), not their sum.
    expected = max(float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(first))))
    np.testing.assert_allclose(model.proj.x_amax_history[...][0], expected, rtol=0.07)


def test_orbax_restores_a_quantized_nnx_model_with_its_fp8_state(tmp_path):
    import orbax.checkpoint as ocp

    x = jax.random.normal(jax.random.key(8), (16, D))
    model = te_flax.quantize_model(StockMLP(nnx.Rngs(0)), RECIPE, x)
    step = nnx.jit(te_nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2), update_fp8_state=True))
    step(model, x)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", nnx.state(model))
        checkpointer.wait_until_finished()
        # The abstract model, quantized the same way, gives the tree to restore into.
        abstract = te_flax.quantize_model(nnx.eval_shape(lambda: StockMLP(nnx.Rngs(0))), RECIPE, x)
        graphdef, abstract_state = nnx.split(abstract)
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", abstract_state))
    np.testing.assert_array_equal(restored.up.x_amax_history[...], model.up.x_amax_history[...])
    assert np.count_nonzero(restored.up.x_amax_history[...]) == 1
    np.testing.assert_array_equal(
        nnx.jit(lambda m, x: m(x))(restored, x), nnx.jit(lambda m, x: m(x))(model, x)
    )


JAX_DOT_GENERAL, JAX_EINSUM = jax.lax.dot_general, jnp.einsum


class BareExpert(nnx.Module):
    """A layer's product and a bare einsum over a parameter; it notes which einsum it saw."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (2 * D, D)))
        self.saw_jax_functions: list[bool] = []

    def __call__(self, x: jax.Array) -> jax.Array:
        self.saw_jax_functions.append(
            jnp.einsum is JAX_EINSUM and jax.lax.dot_general is JAX_DOT_GENERAL
        )
        return jnp.einsum("tf,fd->td", jax.nn.relu(self.up(x)), self.w[...])


def test_bare_products_only_with_the_fallback_and_jax_untouched_without_it():
    x = jax.random.normal(jax.random.key(9), (16, D))
    with pytest.warns(te_flax.QuantizeModelNote, match=r"1 matrix product .* <root> \(1, over w\)"):
        model = te_flax.quantize_model(BareExpert(nnx.Rngs(0)), RECIPE, x)
    assert _fp8_paths(model) == {f"up:{role}" for role in ("x", "kernel", "grad")}
    model(x)
    assert all(model.saw_jax_functions)  # the layers' hooks replace no JAX function

    bare = te_flax.quantize_model(BareExpert(nnx.Rngs(0)), RECIPE, x, bare_products=True)
    roles = ("x", "kernel", "grad")
    assert _fp8_paths(bare) == {f"{p}:{r}" for p in ("up", "") for r in roles}
    bare.saw_jax_functions.clear()
    out = bare(x)
    assert bare.saw_jax_functions == [False]  # replaced while the model runs, and only then
    assert jnp.einsum is JAX_EINSUM and jax.lax.dot_general is JAX_DOT_GENERAL
    hidden = jax.nn.relu(x @ bare.up.kernel[...] + bare.up.bias[...][None])
    reference = hidden @ bare.w[...]
    error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert 0 < error < 2 * FP8_FORWARD_TOLERANCE


class LinenBare(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("w", nn.initializers.lecun_normal(), (2 * D, D))
        return jnp.einsum("tf,fd->td", nn.Dense(2 * D, name="up")(x), w)


def test_linen_bare_products_belong_to_the_calling_module():
    x = jax.random.normal(jax.random.key(10), (16, D))
    with pytest.warns(te_flax.QuantizeModelNote, match=r"quantize_model\(LinenBare\): 1 matrix"):
        layers_only = jax.eval_shape(te_flax.quantize_model(LinenBare(), RECIPE, x).init, KEY, x)
    assert sorted(layers_only[OWG]) == ["up"]
    model = te_flax.quantize_model(LinenBare(), RECIPE, x, bare_products=True)
    variables = jax.jit(model.init)(KEY, x)
    assert "up" in variables[OWG] and "x_amax_history" in variables[OWG]  # the root's einsum
    _, grads = jax.jit(training.value_and_grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))(
        variables, x
    )
    assert float(grads[OWG]["x_amax_history"][0]) > 0


class EinsumAtCall(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Einsum((D, D))(x, einsum_str="td,df->tf")


def test_linen_einsum_keeps_flax_parameters_and_call():
    x = jax.random.normal(jax.random.key(11), (2, 8, D))
    stock = nn.Einsum((D, 2, D), "...d,dhk->...hk", bias_init=nn.initializers.normal())
    model = te_flax.quantize_model(stock, RECIPE, x)
    variables = jax.jit(model.init)(KEY, x)
    plain = jax.jit(stock.init)(KEY, x)
    jax.tree.map(np.testing.assert_array_equal, variables["params"], plain["params"])
    assert sorted(variables[OWG]) == sorted(
        f"{r}_{k}" for r in ("x", "kernel", "grad") for k in ("amax_history", "scale_inv")
    )
    out = jax.jit(model.apply)(variables, x)
    reference = stock.apply(plain, x)
    error = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    assert out.shape == (2, 8, 2, D) and 0 < error < FP8_FORWARD_TOLERANCE
    # The equation given at call time, as Flax takes it.
    at_call = te_flax.quantize_model(EinsumAtCall(), RECIPE, x[0])
    assert "x_amax_history" in jax.eval_shape(at_call.init, KEY, x[0])[OWG]["Einsum_0"]


def test_bare_products_must_be_a_bool():
    with pytest.raises(TypeError, match="bare_products"):
        te_flax.quantize_model(StockMLP(nnx.Rngs(0)), RECIPE, jnp.ones((4, D)), bare_products=1)


# ----------------------------------------------------------------------------- bare products
# Without bare_products=True, the bare products over parameters are found in one trace of the
# quantized model and named in one note. Notes are given once per message: each test below
# quantizes a model class of its own.


def _notes(call):
    """``call()`` and the messages of the QuantizeModelNotes it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if w.category is te_flax.QuantizeModelNote]


class NotedExperts(nnx.Module):
    """Two bare einsums over expert parameters, and bare products of two activations."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, D, 2 * D)))
        self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, 2 * D, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        mixed = jax.nn.softmax(jnp.einsum("td,sd->ts", x, x)) @ x  # activations only
        w_in = self.w_in[...].astype(jnp.bfloat16).reshape(EXPERTS, D, 2, D)  # still w_in
        hidden = jnp.einsum("td,edgf->tegf", mixed, w_in.astype(x.dtype)).reshape(-1, 2, 2 * D)
        return jnp.einsum("tef,efd->td", jax.nn.relu(hidden), self.w_out[...])


class NotedModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(D, D, rngs=rngs)
        self.experts = NotedExperts(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.experts(self.up(x))


def test_nnx_bare_products_over_parameters_give_one_note_without_the_fallback():
    x = jax.random.normal(jax.random.key(12), (16, D))
    model, notes = _notes(lambda: te_flax.quantize_model(NotedModel(nnx.Rngs(0)), RECIPE, x))
    assert len(notes) == 1, notes
    assert notes[0].startswith("quantize_model(NotedModel): 2 matrix products over parameters")
    assert "high precision, in experts (2, over w_in, w_out)." in notes[0]
    assert "bare_products=True" in notes[0] and "quantize=False" in notes[0]
    assert _fp8_paths(model) == {f"up:{role}" for role in ("x", "kernel", "grad")}
    # With the fallback, nothing to note: both run in FP8.
    _, notes = _notes(
        lambda: te_flax.quantize_model(NotedModel(nnx.Rngs(0)), RECIPE, x, bare_products=True)
    )
    assert notes == []


class RuledModel(NotedModel):
    """NotedModel under another name (a note is given once per message)."""


def test_a_rule_that_keeps_bare_products_in_high_precision_silences_the_note():
    x = jax.random.normal(jax.random.key(13), (16, D))
    rules = [te_flax.QuantizeRule(module_path="experts", quantize=False), te_flax.QuantizeRule()]
    # The rule selects only bare products, and is taken (not refused as selecting nothing).
    _, notes = _notes(
        lambda: te_flax.quantize_model(RuledModel(nnx.Rngs(0)), RECIPE, x, rules=rules)
    )
    assert notes == []
    _, notes = _notes(lambda: te_flax.quantize_model(RuledModel(nnx.Rngs(0)), RECIPE, x))
    assert len(notes) == 1 and "in experts (2, over w_in, w_out)" in notes[0]


def test_stock_layers_and_products_of_activations_give_no_note():
    x = jax.random.normal(jax.random.key(14), (2, 16, D))
    cases = {"StockMLP": (StockMLP(nnx.Rngs(0)), x), "Attention": (Attention(nnx.Rngs(0)), x)}
    cases["LinenModel"] = (LinenModel(), x[0])
    for name, (model, inputs) in cases.items():
        _, notes = _notes(functools.partial(te_flax.quantize_model, model, RECIPE, inputs))
        assert notes == [], name


class LinenNotedExperts(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("w", nn.initializers.lecun_normal(), (D, EXPERTS, D))
        scores = jnp.einsum("td,sd->ts", x, x)  # activations only
        return jnp.einsum("td,def->tef", scores @ x, w)


class LinenNoted(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return LinenNotedExperts(name="experts")(nn.Dense(D, name="up")(x))


def test_linen_bare_products_over_parameters_give_one_note_without_the_fallback():
    x = jax.random.normal(jax.random.key(15), (16, D))
    model, notes = _notes(lambda: te_flax.quantize_model(LinenNoted(), RECIPE, x))
    assert len(notes) == 1, notes
    assert notes[0].startswith("quantize_model(LinenNoted): 1 matrix product over parameters")
    assert "in experts (1, over w)." in notes[0]
    assert sorted(jax.eval_shape(model.init, KEY, x)[OWG]) == ["up"]
    _, notes = _notes(lambda: te_flax.quantize_model(LinenNoted(), RECIPE, x, bare_products=True))
    assert notes == []


class ScannedBareLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.relu(jnp.einsum("td,df->tf", x, self.w[...]))


class ScannedBareStack(ScannedStack):
    layer_type = ScannedBareLayer


class CheckpointedBare(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        @jax.checkpoint
        def product(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.dot(x, w)

        return product(self.proj(x), self.w[...])


class LinenScannedBareLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        w = self.param("w", nn.initializers.lecun_normal(), (D, D))
        product = jax.checkpoint(lambda x, w: jnp.matmul(x, w))
        return x + jax.nn.relu(product(x, w)), None


class LinenScannedBare(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layers = nn.scan(
            nn.remat(LinenScannedBareLayer),
            variable_axes={"params": 0, OWG: 0},
            split_rngs={"params": True},
            length=3,
        )
        return layers(name="layers")(x, None)[0]


def test_bare_products_under_scan_and_checkpoint_are_found():
    x = jax.random.normal(jax.random.key(16), (16, D))
    expected = {
        ScannedBareStack: "in layers (1, over w)",
        CheckpointedBare: "in <root> (1, over w)",
    }
    for cls, fragment in expected.items():
        _, notes = _notes(lambda cls=cls: te_flax.quantize_model(cls(nnx.Rngs(0)), RECIPE, x))
        assert len(notes) == 1 and fragment in notes[0], (cls.__name__, notes)
    _, notes = _notes(lambda: te_flax.quantize_model(LinenScannedBare(), RECIPE, x))
    assert len(notes) == 1 and "in layers (1, over w)" in notes[0], notes


def test_parameter_products_follows_views_and_nested_jaxprs():
    @jax.custom_vjp
    def opaque(x, w):  # as te_flax's FP8 ops: its products are its own
        return x @ w

    opaque.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def forward(params, x):
        w = params["w"].astype(jnp.bfloat16).T.reshape(D, D).astype(x.dtype)  # views of w
        y = jax.jit(lambda x, w: x @ w)(x, w)  # 1: under jit
        y = jax.lax.cond(y.sum() > 0, lambda y: y @ params["v"], lambda y: y, y)  # 2: a branch
        y = jax.lax.fori_loop(0, 2, lambda i, y: y @ w, y)  # 3: in a while loop
        y = opaque(y, w) + (y @ y.T) @ y  # not listed: a custom_vjp; activations only
        return y @ jnp.tanh(params["v"])  # not listed: tanh is no view

    params = {"v": jnp.ones((D, D)), "w": jnp.ones((D, D))}
    found = parameter_products(forward, params, jnp.ones((4, D)))
    assert found == [frozenset({1}), frozenset({0}), frozenset({1})]


class TracedOnce(nnx.Module):
    """A model whose second trace fails (quantize_model's check for bare products traces it)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.calls = [0]

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[0] += 1
        if self.calls[0] > 1:
            raise RuntimeError("traced twice")
        return self.proj(x)


def test_a_failed_check_for_bare_products_is_a_note_not_an_error():
    x = jax.random.normal(jax.random.key(17), (16, D))
    model, notes = _notes(lambda: te_flax.quantize_model(TracedOnce(nnx.Rngs(0)), RECIPE, x))
    assert len(notes) == 1 and "could not trace the quantized model" in notes[0], notes
    assert "RuntimeError: traced twice" in notes[0] and "bare_products=True" in notes[0]
    assert _fp8_paths(model) == {f"proj:{role}" for role in ("x", "kernel", "grad")}
