"""The Linen modules: variable trees, agreement with the ops and with plain Flax, scan, remat,
dropout, LoRA, subclassing and the errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import te_flax
import te_flax.linen as te_nn
from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, QuantizerFactory
from te_flax.training import merge_fp8_state
from tests.helpers import F32, assert_close, normal, tolerance

FP8 = "_overwrite_with_gradient"
DELAYED = DelayedScaling(amax_history_len=4)
HIDDEN = 16


def _x(shape=(2, 3, HIDDEN), dtype=F32, seed=0):
    return normal(jax.random.key(seed), shape, dtype, 2.0) + jnp.asarray(0.5, dtype)


def _shapes(tree):
    return jax.tree.map(lambda a: (a.shape, str(a.dtype)), nn.meta.unbox(tree))


def _fp8_names(postfix=""):
    return sorted(
        f"{role}{postfix}_{kind}"
        for role in ("x", "kernel", "grad")
        for kind in ("amax_history", "scale_inv")
    )


# ----------------------------------------------------------------------------- variable trees


@pytest.mark.parametrize(
    "recipe", [None, DELAYED, Float8CurrentScaling()], ids=["none", "delayed", "current"]
)
def test_layernorm_dense_general_variables(recipe):
    layer = te_nn.LayerNormDenseGeneral(
        features=(3, 8),
        kernel_axes=("embed", "qkv", "heads"),
        use_bias=True,
        bias_axes=("qkv", "heads"),
        recipe=recipe,
    )
    variables = layer.init(jax.random.key(0), _x())
    assert _shapes(variables["params"]) == {
        "scale": ((HIDDEN,), "float32"),
        "ln_bias": ((HIDDEN,), "float32"),
        "kernel": ((HIDDEN, 3, 8), "float32"),
        "bias": ((3, 8), "float32"),
    }
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["kernel"] == P("embed", "qkv", "heads")
    assert specs["scale"] == P("embed") and specs["bias"] == P("qkv", "heads")
    if isinstance(recipe, DelayedScaling):
        assert sorted(variables[FP8]) == _fp8_names()
        assert variables[FP8]["x_amax_history"].shape == (4,)
        assert variables[FP8]["grad_scale_inv"].shape == (1,)
        np.testing.assert_array_equal(variables[FP8]["kernel_scale_inv"], [1.0])
    else:
        assert FP8 not in variables


def test_layernorm_mlp_variables_and_default_axes():
    mlp = te_nn.LayerNormMLP(intermediate_dim=32, activations=("gelu", "linear"), use_bias=True)
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        variables = mlp.init(jax.random.key(0), _x())
    assert _shapes(variables["params"]) == {
        "scale": ((HIDDEN,), "float32"),
        "ln_bias": ((HIDDEN,), "float32"),
        "wi_kernel": ((HIDDEN, 2, 32), "float32"),
        "wo_kernel": ((32, HIDDEN), "float32"),
        "wi_bias": ((2, 32), "float32"),
        "wo_bias": ((HIDDEN,), "float32"),
    }
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["wi_kernel"] == P("embed", "act", "mlp")
    assert specs["wo_kernel"] == P("mlp", "embed")
    assert specs["wi_bias"] == P("act", "mlp") and specs["wo_bias"] == P("embed")
    assert sorted(variables[FP8]) == sorted(_fp8_names("_0") + _fp8_names("_1"))


def test_layernorm_and_dense_general_variables():
    norm = te_nn.LayerNorm(layernorm_type="rmsnorm", zero_centered_gamma=True)
    variables = norm.init(jax.random.key(0), _x())
    assert _shapes(variables) == {"params": {"scale": ((HIDDEN,), "float32")}}
    np.testing.assert_array_equal(nn.meta.unbox(variables)["params"]["scale"], 0.0)

    dense_layer = te_nn.DenseGeneral(features=8, axis=(-2, -1), param_dtype=jnp.bfloat16)
    variables = dense_layer.init(jax.random.key(0), _x())
    assert _shapes(variables["params"]) == {
        "kernel": ((3, HIDDEN, 8), "bfloat16"),
        "bias": ((8,), "bfloat16"),
    }


def test_default_kernel_init_has_unit_fan_in_variance():
    layer = te_nn.LayerNormDenseGeneral(features=(4, 256))
    kernel = nn.meta.unbox(layer.init(jax.random.key(0), jnp.ones((1, 512))))["params"]["kernel"]
    # variance_scaling(1, fan_in): variance 1/fan_in with fan_in = the contracted size only.
    assert abs(float(jnp.var(kernel)) * 512 - 1.0) < 0.05


# ----------------------------------------------------------------------------- versus the ops


def _loss_and_grads(apply, variables, x, cotangent):
    def loss(variables, x):
        out = apply(variables, x)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(F32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, x)


@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["nofp8", "fp8"])
def test_layernorm_dense_general_is_the_op(recipe):
    layer = te_nn.LayerNormDenseGeneral(features=24, use_bias=True, recipe=recipe)
    x, cotangent = _x(), normal(jax.random.key(1), (2, 3, 24))
    variables = layer.init(jax.random.key(0), x)
    params = nn.meta.unbox(variables)["params"]
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)

    def op(variables, x, qs=qs):
        p = variables["params"]
        return layernorm_dense(
            x, p["kernel"], p["scale"], p["ln_bias"], p["bias"],
            quantizer_set=variables.get("qs", qs),
        )  # fmt: skip

    value, (grads, dx) = _loss_and_grads(layer.apply, variables, x, cotangent)
    # The quantizer set differentiated as the module's FP8 state is (a set that is not would
    # scale its fresh state just in time).
    expected_value, (expected_grads, expected_dx) = _loss_and_grads(
        op, {"params": params, "qs": qs}, x, cotangent
    )
    np.testing.assert_array_equal(value, expected_value)
    np.testing.assert_array_equal(dx, expected_dx)
    jax.tree.map(
        np.testing.assert_array_equal, nn.meta.unbox(grads)["params"], expected_grads["params"]
    )
    if recipe is not None:
        # The FP8 state's gradient is the op's new quantizer state, under the TE names.
        new_state = jax.jit(jax.grad(lambda q: jnp.sum(op({"params": params}, x, q) * cotangent)))(
            qs
        )
        # (Within an ulp: the two programs fuse the norm differently.)
        np.testing.assert_allclose(grads[FP8]["x_amax_history"], new_state.x.amax_history, 1e-6)
        np.testing.assert_allclose(grads[FP8]["grad_scale_inv"], new_state.dgrad.scale_inv, 1e-6)


@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["nofp8", "fp8"])
def test_layernorm_mlp_is_the_op(recipe):
    mlp = te_nn.LayerNormMLP(intermediate_dim=32, activations=("silu", "linear"), recipe=recipe)
    x, cotangent = _x(), normal(jax.random.key(1), (2, 3, HIDDEN))
    variables = mlp.init(jax.random.key(0), x)
    params = nn.meta.unbox(variables)["params"]
    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe) if recipe else None

    def op(variables, x):
        p = variables["params"]
        kwargs = {} if sets is None else {"quantizer_sets": variables["sets"]}
        return layernorm_mlp(
            x,
            p["scale"],
            p["ln_bias"],
            [p["wi_kernel"], p["wo_kernel"]],
            [None, None],
            "layernorm",
            activation_type=("silu", "linear"),
            **kwargs,
        )

    value, (grads, dx) = _loss_and_grads(
        lambda v, x: mlp.apply(v, x, deterministic=True), variables, x, cotangent
    )
    # The quantizer sets differentiated as the module's FP8 state is.
    expected_value, (expected_grads, expected_dx) = _loss_and_grads(
        op, {"params": params, "sets": sets}, x, cotangent
    )
    np.testing.assert_array_equal(value, expected_value)
    np.testing.assert_array_equal(dx, expected_dx)
    jax.tree.map(
        np.testing.assert_array_equal, nn.meta.unbox(grads)["params"], expected_grads["params"]
    )


def test_dense_general_is_the_op_with_multi_axis_contraction():
    layer = te_nn.DenseGeneral(features=(2, 5), axis=(-2, -1), recipe=DELAYED)
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    p = nn.meta.unbox(variables)["params"]
    qs = QuantizerFactory.create_set(fp8_recipe=DELAYED)
    expected = dense(x, p["kernel"], p["bias"], contracting_dims=((1, 2), (0, 1)), quantizer_set=qs)
    np.testing.assert_array_equal(layer.apply(variables, x), expected)


# ----------------------------------------------------------------------------- versus plain Flax


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_flax_layernorm_and_dense_general(dtype):
    layer = te_nn.LayerNormDenseGeneral(features=(3, 8), use_bias=True, epsilon=1e-5)
    x = _x(dtype=dtype)
    variables = layer.init(jax.random.key(0), x)
    p = nn.meta.unbox(variables)["params"]

    class FlaxReference(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm(epsilon=1e-5, dtype=F32, name="norm")(x.astype(F32))
            return nn.DenseGeneral((3, 8), dtype=F32, precision="highest", name="dense")(y)

    reference = {
        "params": {
            "norm": {"scale": p["scale"], "bias": p["ln_bias"]},
            "dense": {"kernel": p["kernel"], "bias": p["bias"]},
        }
    }
    out, _ = layer.apply(variables, x)
    assert out.dtype == dtype
    assert_close(out, FlaxReference().apply(reference, x), tolerance(dtype))


def test_matches_flax_mlp_block():
    mlp = te_nn.LayerNormMLP(
        intermediate_dim=32, activations=("gelu", "linear"), use_bias=True, layernorm_type="rmsnorm"
    )
    x = _x()
    variables = mlp.init(jax.random.key(0), x)
    p = nn.meta.unbox(variables)["params"]

    class FlaxMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.RMSNorm(epsilon=1e-6, name="norm")(x)
            h = nn.DenseGeneral((2, 32), precision="highest", name="wi")(y)  # [.., 2, 32]
            a = nn.gelu(h[..., 0, :], approximate=True) * h[..., 1, :]
            return nn.Dense(HIDDEN, precision="highest", name="wo")(a)

    reference = {
        "params": {
            "norm": {"scale": p["scale"]},
            "wi": {"kernel": p["wi_kernel"], "bias": p["wi_bias"]},
            "wo": {"kernel": p["wo_kernel"], "bias": p["wo_bias"]},
        }
    }
    out, ln = mlp.apply(variables, x, deterministic=True)
    assert ln is None
    assert_close(out, FlaxMLP().apply(reference, x), tolerance(F32))


def test_compute_dtype_and_param_dtype():
    layer = te_nn.LayerNormDenseGeneral(features=8, dtype=jnp.bfloat16, param_dtype=F32)
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    out, _ = layer.apply(variables, x)
    assert out.dtype == jnp.bfloat16
    assert nn.meta.unbox(variables)["params"]["kernel"].dtype == F32


# ----------------------------------------------------------------------------- options


def test_return_layernorm_output_and_depth_scaling():
    layer = te_nn.LayerNormDenseGeneral(features=8, return_layernorm_output=True, depth_scaling=4.0)
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    out, ln = layer.apply(variables, x)
    p = nn.meta.unbox(variables)["params"]
    norm = te_nn.LayerNorm().apply({"params": {"scale": p["scale"], "ln_bias": p["ln_bias"]}}, x)
    np.testing.assert_allclose(ln, norm, rtol=1e-6, atol=1e-6)
    plain, _ = layer.clone(return_layernorm_output=False, depth_scaling=None).apply(variables, x)
    np.testing.assert_allclose(out, plain / 4.0, rtol=1e-6)


def test_without_layernorm_the_layer_is_a_dense():
    layer = te_nn.LayerNormDenseGeneral(
        features=8, enable_layernorm=False, return_layernorm_output=True
    )
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    assert "scale" not in variables["params"]
    out, ln = layer.apply(variables, x)
    np.testing.assert_array_equal(ln, x)
    np.testing.assert_array_equal(out, dense(x, nn.meta.unbox(variables)["params"]["kernel"]))


@pytest.mark.parametrize("module", ["dense", "ln_dense", "mlp"])
def test_lora_with_zero_b_gives_the_base_output_and_trains(module):
    make = {
        "dense": lambda **kw: te_nn.DenseGeneral(features=8, **kw),
        "ln_dense": lambda **kw: te_nn.LayerNormDenseGeneral(features=8, **kw),
        "mlp": lambda **kw: te_nn.LayerNormMLP(intermediate_dim=32, **kw),
    }[module]
    x = _x()
    base = make()
    lora = make(
        enable_low_rank_adaptation=True, low_rank_adaptation_dim=4, low_rank_adaptation_alpha=8.0
    )
    variables = lora.init(jax.random.key(0), x)
    params = nn.meta.unbox(variables)["params"]
    base_params = {k: v for k, v in params.items() if "lora" not in k}
    lora_names = sorted(k for k in params if "lora" in k)
    assert (
        lora_names
        == {
            "dense": ["lora_a_kernel", "lora_b_kernel"],
            "ln_dense": ["lora_a_kernel", "lora_b_kernel"],
            "mlp": ["wi_lora_a_kernel", "wi_lora_b_kernel", "wo_lora_a_kernel", "wo_lora_b_kernel"],
        }[module]
    )

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    np.testing.assert_allclose(
        first(lora.apply({"params": params}, x)),
        first(base.apply({"params": base_params}, x)),
        rtol=1e-6,
        atol=1e-6,
    )
    # B receives a gradient (A's is zero while B is zero), and a non-zero B changes the output.
    grads = jax.grad(lambda p: jnp.sum(first(lora.apply({"params": p}, x)) ** 2))(params)
    b_name = lora_names[1]
    assert float(jnp.abs(grads[b_name]).max()) > 0
    params[b_name] = jnp.ones_like(params[b_name])
    assert not np.allclose(
        first(lora.apply({"params": params}, x)), first(base.apply({"params": base_params}, x))
    )


def test_lora_reads_the_norm_output_under_fp8_too():
    layer = te_nn.LayerNormDenseGeneral(
        features=8,
        enable_low_rank_adaptation=True,
        low_rank_adaptation_dim=2,
        return_layernorm_output=True,
        recipe=DELAYED,
    )
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    p = dict(nn.meta.unbox(variables)["params"])
    p["lora_b_kernel"] = normal(jax.random.key(3), p["lora_b_kernel"].shape)
    with_lora, ln = layer.apply({**variables, "params": p}, x)
    without, _ = layer.apply(
        {**variables, "params": {**p, "lora_b_kernel": jnp.zeros_like(p["lora_b_kernel"])}}, x
    )
    # The adapter's contribution is ln . A . B (scale 1 without alpha), not x . A . B.
    expected = jnp.einsum(
        "...h,hr,rf->...f", ln, p["lora_a_kernel"], p["lora_b_kernel"], precision="highest"
    )
    np.testing.assert_allclose(with_lora - without, expected, rtol=1e-4, atol=1e-4)


def test_intermediate_dropout_is_driven_by_its_rng_and_deterministic():
    mlp = te_nn.LayerNormMLP(intermediate_dim=64, intermediate_dropout_rate=0.5)
    x = _x()
    variables = mlp.init(jax.random.key(0), x, deterministic=True)
    fused, _ = mlp.apply(variables, x, deterministic=True)
    no_dropout, _ = mlp.clone(intermediate_dropout_rate=0.0).apply(variables, x)
    np.testing.assert_allclose(fused, no_dropout, rtol=1e-6, atol=1e-6)
    first, _ = mlp.apply(variables, x, rngs={"dropout": jax.random.key(1)})
    again, _ = mlp.apply(variables, x, rngs={"dropout": jax.random.key(1)})
    other, _ = mlp.apply(variables, x, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    assert not np.allclose(first, fused)
    with pytest.raises(Exception, match="dropout"):
        mlp.apply(variables, x)  # no rng for the dropout stream


def test_subclass_adds_a_residual():
    class ResidualMLP(te_nn.LayerNormMLP):
        residual_scale: float = 0.5

        @nn.compact
        def __call__(self, inputs, deterministic=False):
            out, ln = super().__call__(inputs, deterministic)
            return inputs + self.residual_scale * out, ln

    x = _x()
    block = ResidualMLP(intermediate_dim=32, residual_scale=0.25)
    variables = block.init(jax.random.key(0), x)
    out, _ = block.apply(variables, x, deterministic=True)
    plain, _ = te_nn.LayerNormMLP(intermediate_dim=32).apply(variables, x, deterministic=True)
    np.testing.assert_allclose(out, x + 0.25 * plain, rtol=1e-6)


# ----------------------------------------------------------------------------- scan and remat


class _Block(nn.Module):
    """One scanned layer: LayerNormDenseGeneral back to the hidden size, with a residual."""

    @nn.compact
    def __call__(self, x, _):
        y, _ = te_nn.LayerNormDenseGeneral(features=HIDDEN, recipe=DELAYED, name="dense")(x)
        return x + y, None


def _scanned(broadcast_fp8: bool, length=3):
    if broadcast_fp8:
        scan = nn.scan(
            _Block,
            variable_axes={"params": 0},
            variable_broadcast=FP8,
            split_rngs={"params": True},
            length=length,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
    else:
        scan = nn.scan(
            _Block,
            variable_axes={"params": 0, FP8: 0},
            split_rngs={"params": True},
            length=length,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
    return scan(name="layers")


def _layer_new_states(variables, x, length):
    """The new FP8 state of each layer of an unrolled copy of the stack (each state used once)."""
    layer = te_nn.LayerNormDenseGeneral(features=HIDDEN, recipe=DELAYED)
    params = nn.meta.unbox(variables["params"])["dense"]
    fp8 = variables[FP8]["dense"]
    per_layer = [
        {
            "params": jax.tree.map(lambda v, i=i: v[i], params),
            FP8: jax.tree.map(lambda v, i=i: v[i] if v.ndim == 2 else v, fp8),
        }
        for i in range(length)
    ]

    def loss(per_layer, x):
        for layer_variables in per_layer:
            x = x + layer.apply(layer_variables, x)[0]
        return jnp.sum(x**2)

    grads = jax.jit(jax.grad(loss))(per_layer, x)
    return [g[FP8] for g in grads]


@pytest.mark.parametrize("broadcast_fp8", [False, True], ids=["per-layer", "shared"])
def test_scan_fp8_state_per_layer_and_shared(broadcast_fp8):
    x = _x((4, HIDDEN))
    model = _scanned(broadcast_fp8)
    variables = model.init(jax.random.key(0), x, None)
    history = variables[FP8]["dense"]["x_amax_history"]
    assert history.shape == ((4,) if broadcast_fp8 else (3, 4))
    # The shared state crosses the scan boundary, so the step marks it before the scan.
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(merge_fp8_state(v), x, None)[0] ** 2)))(
        variables
    )
    new = grads[FP8]["dense"]
    singles = _layer_new_states(variables, x, 3)
    if broadcast_fp8:
        # One state read by three layers: its update is the elementwise max of theirs.
        expected = jax.tree.map(lambda *s: jnp.max(jnp.stack(s), axis=0), *singles)
    else:
        expected = jax.tree.map(lambda *s: jnp.stack(s), *singles)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new, expected)


def test_remat_with_checkpoint_names_keeps_gradients():
    x = _x()
    mlp = te_nn.LayerNormMLP(intermediate_dim=32, recipe=DELAYED)
    remat = nn.remat(
        te_nn.LayerNormMLP,
        policy=jax.checkpoint_policies.save_only_these_names("ffn1"),
        static_argnums=(2,),
    )(intermediate_dim=32, recipe=DELAYED)
    variables = mlp.init(jax.random.key(0), x)

    def grads(module):
        return jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, x, True)[0] ** 2)))(variables)

    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        grads(remat),
        grads(mlp),
    )


# ----------------------------------------------------------------------------- errors


def test_fp8_apply_of_a_model_initialised_without_fp8_is_refused():
    layer = te_nn.LayerNormDenseGeneral(features=8)
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    with (
        te_flax.autocast(enabled=True, recipe=DELAYED),
        pytest.raises(ValueError, match="initialised without FP8"),
    ):
        layer.apply(variables, x)


def test_plain_apply_of_a_model_initialised_with_fp8_is_refused():
    layer = te_nn.LayerNormMLP(intermediate_dim=8)
    x = _x()
    with te_flax.autocast(enabled=True, recipe=DELAYED):
        variables = layer.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="applied without FP8"):
        layer.apply(variables, x)


def test_changed_history_length_is_refused():
    layer = te_nn.DenseGeneral(features=8, recipe=DELAYED)
    x = _x()
    variables = layer.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="amax_history_len changed"):
        layer.clone(recipe=DelayedScaling(amax_history_len=8)).apply(variables, x)


def test_input_size_mismatch_is_refused():
    layer = te_nn.LayerNormDenseGeneral(features=8)
    variables = layer.init(jax.random.key(0), _x())
    with pytest.raises(
        ValueError, match="'scale' has shape \\(16,\\), but this input needs \\(32,\\)"
    ):
        layer.apply(variables, _x((2, 32)))


@pytest.mark.parametrize(
    "module",
    [
        te_nn.LayerNormDenseGeneral(features=8, axis=0),
        te_nn.LayerNormMLP(intermediate_dim=8, axis=-2),
    ],
)
def test_axis_other_than_last_is_refused(module):
    with pytest.raises(ValueError, match="only \\(axis=-1\\)"):
        module.init(jax.random.key(0), _x())


def test_dense_general_axis_must_be_trailing():
    with pytest.raises(ValueError, match="trailing axes"):
        te_nn.DenseGeneral(features=8, axis=0).init(jax.random.key(0), _x())


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        te_nn.LayerNormMLP(intermediate_dim=8, activations=("swish",)).init(jax.random.key(0), _x())


def test_missing_features_and_bad_axes_are_refused():
    with pytest.raises(TypeError, match="features is required"):
        te_nn.DenseGeneral().init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="name 1 dimensions but it has shape"):
        te_nn.DenseGeneral(features=8, kernel_axes=("embed",)).init(jax.random.key(0), _x())
