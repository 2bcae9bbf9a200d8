"""te_flax's Linen layers against TransformerEngine 2.20.2's, run side by side.

From the same init key: the same variable tree and the same initial values. From the same
variables, for several training steps: the same outputs, parameter gradients and new FP8
state (relative <= 1e-5 in float32). And TE's FP8 state, converted with
``from_transformer_engine``, continues TE's run in te_flax.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from te_flax.convert import from_transformer_engine
from tests.parity import te_reference as ref

TOLERANCE = 1e-5
STEPS = 3
SHAPE = (2, 8, 32)  # [batch, seq, hidden]

# case -> (layer, attributes, call arguments)
LAYERS = {
    "DenseGeneral": ("DenseGeneral", dict(features=48), {}),
    "LayerNormDenseGeneral layernorm": ("LayerNormDenseGeneral", dict(features=48), {}),
    "LayerNormDenseGeneral rmsnorm": (
        "LayerNormDenseGeneral",
        dict(features=48, layernorm_type="rmsnorm"),
        {},
    ),
    "LayerNormDenseGeneral zero-centered gamma": (
        "LayerNormDenseGeneral",
        dict(features=48, zero_centered_gamma=True, use_bias=True),
        {},
    ),
    "LayerNormMLP gelu": ("LayerNormMLP", dict(intermediate_dim=64), {"deterministic": True}),
    "LayerNormMLP silu+linear": (
        "LayerNormMLP",
        dict(intermediate_dim=64, activations=("silu", "linear"), layernorm_type="rmsnorm"),
        {"deterministic": True},
    ),
    "LayerNormMLP clamped SwiGLU": (
        "LayerNormMLP",
        dict(
            intermediate_dim=64,
            activations=("clamped_silu", "clamped_linear"),
            activation_params={"limit": 0.75, "alpha": 1.5},
        ),
        {"deterministic": True},
    ),
    "TransformerLayer": (
        "TransformerLayer",
        dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4),
        {"deterministic": True},
    ),
    "TransformerLayer learnable softmax": (
        "TransformerLayer",
        dict(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4, softmax_type="learnable"),
        {"deterministic": True},
    ),
}


def _inputs(step: int, out_features: int, dtype=jnp.float32):
    x_key, cotangent_key = jax.random.split(jax.random.key(100 + step))
    x = jax.random.normal(x_key, SHAPE, jnp.float32) * (1.0 + step)
    cotangent = jax.random.normal(cotangent_key, (*SHAPE[:-1], out_features), jnp.float32)
    return x.astype(dtype), cotangent


def _out_features(attributes):
    return attributes.get("features", SHAPE[-1])


def _perturbed(params, seed=7):
    """The initial parameters plus noise, so that zero-initialised ones (biases, zero-centered
    gammas) take part in the comparison."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        p + 0.05 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noisy)


# TE's own inconsistencies, found by this suite: where TE computes something other than its
# attributes say, te_flax is compared with what TE computes. (case, recipe) -> the attributes
# that give te_flax TE's behaviour.
TE_QUIRKS = {
    # Without FP8, TE's LayerNormMLP takes its unfused path, which drops activation_params and
    # uses the clamped SwiGLU's defaults (limit 7.0, alpha 1.702).
    ("LayerNormMLP clamped SwiGLU", "none"): {"activation_params": None},
}


def _init_both(case, recipe_name):
    layer, attributes, call = LAYERS[case]
    our_recipe, te_recipe = ref.RECIPES[recipe_name]
    theirs = getattr(ref.TE, layer)(**attributes)
    ours = getattr(te_nn, layer)(**{**attributes, **TE_QUIRKS.get((case, recipe_name), {})})
    x, _ = _inputs(0, _out_features(attributes))
    key = jax.random.key(0)
    with ref.te_context(te_recipe):
        te_variables = nn.meta.unbox(theirs.init(key, x, **call))
    with ref.our_context(our_recipe):
        our_variables = nn.meta.unbox(ours.init(key, x, **call))
    return theirs, ours, te_variables, our_variables


@pytest.mark.parametrize("recipe_name", list(ref.RECIPES))
@pytest.mark.parametrize("case", list(LAYERS))
def test_same_variables_from_the_same_key(case, recipe_name):
    _, _, te_variables, our_variables = _init_both(case, recipe_name)
    converted = ref.flat(from_transformer_engine(te_variables))
    ours = ref.flat(our_variables)
    assert sorted(converted) == sorted(ours)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, converted[name], err_msg=name)


def _run(case, recipe_name, steps=STEPS, te_steps_first=0):
    """Errors of te_flax against TE, step by step, from TE's (perturbed) initial variables.

    With ``te_steps_first``, TE runs that many steps alone first and te_flax starts from its
    converted variables: a TE run continued in te_flax.
    """
    _, attributes, call = LAYERS[case]
    our_recipe, te_recipe = ref.RECIPES[recipe_name]
    theirs, ours, te_variables, _ = _init_both(case, recipe_name)
    te_variables = {**te_variables, "params": _perturbed(te_variables["params"])}
    te_runner = ref.Runner(theirs, ref.TE_FP8_COLLECTION, lambda: ref.te_context(te_recipe), call)
    our_runner = ref.Runner(
        ours, ref.OURS_FP8_COLLECTION, lambda: ref.our_context(our_recipe), call
    )
    for step in range(te_steps_first):
        te_variables, _ = te_runner.step(te_variables, *_inputs(step, _out_features(attributes)))
    our_variables = from_transformer_engine(te_variables)
    errors = []
    for step in range(te_steps_first, te_steps_first + steps):
        x, cotangent = _inputs(step, _out_features(attributes))
        te_variables, te_result = te_runner.step(te_variables, x, cotangent)
        our_variables, our_result = our_runner.step(our_variables, x, cotangent)
        errors.append(
            ref.compare_steps(ref.our_step(our_result), ref.te_step_in_our_layout(te_result))
        )
    return errors


@pytest.mark.parametrize("recipe_name", list(ref.RECIPES))
@pytest.mark.parametrize("case", list(LAYERS))
def test_same_steps_from_the_same_variables(case, recipe_name, parity_results):
    errors = _run(case, recipe_name)
    worst = {what: max(step[what] for step in errors) for what in errors[0]}
    quirk = " (as TE computes it: see TE_QUIRKS)" if (case, recipe_name) in TE_QUIRKS else ""
    parity_results[(case + quirk, recipe_name)] = worst
    for what, error in worst.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"


@pytest.mark.parametrize("case", ["LayerNormMLP silu+linear", "TransformerLayer"])
def test_a_te_run_continues_in_te_flax(case, parity_results):
    errors = _run(case, "delayed", steps=2, te_steps_first=2)
    worst = {what: max(step[what] for step in errors) for what in errors[0]}
    parity_results[(f"{case}, TE's state after 2 steps", "delayed")] = worst
    for what, error in worst.items():
        assert error <= TOLERANCE, f"{what}: {error:.2e}"


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
@pytest.mark.parametrize("case", ["DenseGeneral", "LayerNormMLP silu+linear"])
def test_bfloat16_inputs_with_the_default_dtype(case, recipe_name):
    """TE's ``dtype=float32`` default stores float32 parameters and computes in the input's
    dtype; te_flax's ``dtype=None`` with ``param_dtype=float32`` does the same."""
    _, attributes, call = LAYERS[case]
    our_recipe, te_recipe = ref.RECIPES[recipe_name]
    theirs, ours, te_variables, our_variables = _init_both(case, recipe_name)
    for tree in (te_variables, our_variables):
        assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(tree["params"]))
    x, _ = _inputs(0, _out_features(attributes), jnp.bfloat16)
    if recipe_name == "delayed":
        # A fresh delayed state (scale 1, empty history) is quantized with scale 1 by TE and
        # just in time, by the tensor's own amax, by te_flax (docs/fp8_state.md, "Never-updated
        # state"): both get the same stored scale, so the stored-scale path is what is compared.
        te_variables = _with_stored_scale(te_variables, 2.0)
    with ref.te_context(te_recipe):
        te_out = theirs.apply(te_variables, x, **call)
    with ref.our_context(our_recipe):
        our_out = ours.apply(from_transformer_engine(te_variables), x, **call)
    te_out, our_out = (o[0] if isinstance(o, tuple) else o for o in (te_out, our_out))
    assert te_out.dtype == our_out.dtype == jnp.bfloat16
    # Both compute in bfloat16, rounding some intermediates (the activation, the GEMM outputs)
    # at different points: agreement to a few bfloat16 ulps (one is 2**-8 relative).
    assert ref.relative_error(our_out, te_out) <= 3e-2


def _with_stored_scale(te_variables, scale):
    """TE's variables with every FP8 ``*_scale`` set to ``scale`` (a state no longer fresh)."""

    def stored(path, leaf):
        is_scale = jax.tree_util.keystr(path).endswith("_scale']")
        return jnp.full_like(leaf, scale) if is_scale else leaf

    fp8 = jax.tree_util.tree_map_with_path(stored, te_variables[ref.TE_FP8_COLLECTION])
    return {**te_variables, ref.TE_FP8_COLLECTION: fp8}


def _swap_gradient_state(fp8):
    swapped = {}
    for name, value in fp8.items():
        for a, b in (("grad_0_", "grad_1_"), ("grad_1_", "grad_0_")):
            if a in name:
                name = name.replace(a, b)
                break
        swapped[name] = value
    return swapped


def compare_with_te_unfused_mlp(attributes: dict, recipe_name: str = "delayed") -> None:
    """Two steps of TE's LayerNormMLP on its unfused path and te_flax's from TE's variables:
    the same outputs, gradients and FP8 state, TE's gradient-state names exchanged."""
    our_recipe, te_recipe = ref.RECIPES[recipe_name]
    theirs, ours = ref.TE.LayerNormMLP(**attributes), te_nn.LayerNormMLP(**attributes)
    x, cotangent = _inputs(0, SHAPE[-1])
    with ref.te_context(te_recipe):
        te_variables = nn.meta.unbox(theirs.init(jax.random.key(0), x, deterministic=True))
    call = {"deterministic": True}
    te_runner = ref.Runner(theirs, ref.TE_FP8_COLLECTION, lambda: ref.te_context(te_recipe), call)
    our_runner = ref.Runner(
        ours, ref.OURS_FP8_COLLECTION, lambda: ref.our_context(our_recipe), call
    )
    our_variables = from_transformer_engine(te_variables)
    for step in range(2):
        x, cotangent = _inputs(step, SHAPE[-1])
        te_variables, te_result = te_runner.step(te_variables, x, cotangent)
        our_variables, our_result = our_runner.step(our_variables, x, cotangent)
        theirs_step = ref.te_step_in_our_layout(te_result)
        theirs_step.fp8 = _swap_gradient_state(theirs_step.fp8)
        errors = ref.compare_steps(ref.our_step(our_result), theirs_step)
        # Each run goes on with its own state: both quantize each gradient with its own
        # history, under different names.
        assert max(errors.values()) <= TOLERANCE, errors


def test_te_unfused_layernorm_mlp_names_its_gradient_state_the_other_way():
    """TE's LayerNormMLP quantizes the output gradient with ``grad_0_*`` on its fused path and
    with ``grad_1_*`` on its unfused one (``return_layernorm_output=True``, dropout); te_flax
    keeps the fused path's meaning everywhere (docs/porting.md). Everything else agrees."""
    compare_with_te_unfused_mlp(dict(intermediate_dim=64, return_layernorm_output=True))


@pytest.mark.parametrize("mask_type", ["causal", "padding"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one", "learnable"])
def test_dot_product_attention_softmax_types(softmax_type, mask_type, parity_results):
    """The attention sinks: output and gradients (query, key, value and the learned sink)."""
    attributes = dict(
        head_dim=8,
        num_attention_heads=4,
        num_gqa_groups=2,
        softmax_type=softmax_type,
        attn_mask_type=mask_type,
        transpose_batch_sequence=False,
    )
    theirs = ref.TE.DotProductAttention(**attributes)
    ours = te_nn.DotProductAttention(**attributes)
    keys = jax.random.split(jax.random.key(5), 4)
    query = jax.random.normal(keys[0], (2, 6, 4, 8))
    key, value = (jax.random.normal(k, (2, 6, 2, 8)) for k in keys[1:3])
    cotangent = jax.random.normal(keys[3], query.shape)
    # The second sequence's last two positions are padding; its last query sees no key.
    valid = jnp.arange(6)[None, :] < jnp.array([[6], [4]])
    mask = (~(valid[:, None, :, None] & valid[:, None, None, :])).astype(jnp.uint8)
    te_variables = nn.meta.unbox(theirs.init(jax.random.key(0), query, key, value, mask))
    te_variables = jax.tree.map(lambda p: p + jnp.linspace(-1.0, 2.0, p.size).reshape(p.shape),
                                te_variables)  # fmt: skip
    our_variables = from_transformer_engine(te_variables) if te_variables else {}

    def loss(module, variables):
        def value_of(variables, q, k, v):
            out = module.apply(variables, q, k, v, mask, deterministic=True)
            return jnp.sum(out * cotangent)

        return jax.value_and_grad(value_of, argnums=(0, 1, 2, 3))(variables, query, key, value)

    (te_loss, te_grads), (our_loss, our_grads) = (
        loss(theirs, te_variables),
        loss(ours, our_variables),
    )
    te_params = (
        from_transformer_engine({"params": te_grads[0]["params"]})["params"] if te_variables else {}
    )
    errors = {
        "output": ref.relative_error(our_loss, te_loss),
        "parameter gradients": max(
            [ref.relative_error(a, b) for a, b in zip(te_grads[1:], our_grads[1:], strict=True)]
            + [ref.relative_error(our_grads[0]["params"][k], v) for k, v in te_params.items()]
        ),
        "FP8 state": 0.0,
    }
    parity_results[(f"DotProductAttention {softmax_type}, {mask_type}", "none")] = errors
    assert max(errors.values()) <= TOLERANCE, errors
