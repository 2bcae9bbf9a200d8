"""Property-based tests of the four functional ops against the plain-jnp references.

Hypothesis draws the cases: 1-4 leading axes; hidden, feature and intermediate sizes on and off
multiples of 16 and 32; float32, bfloat16 and float16 inputs; layernorm and rmsnorm, with and
without ``zero_centered_gamma``; with and without biases; every activation of the MLP; and the
settings of each recipe (no quantization, delayed and current scaling, MXFP8, NVFP4). Each
example compares the op's output and its gradients (input, kernels, gamma, beta, biases) with
the float32 references of ``tests/helpers.py``: elementwise at the dtype's tolerance without
quantization, normwise at the recipe's tolerance with it. Delayed scaling is checked on its
second step, which quantizes with the scales the first step recorded.

The examples come from the Hypothesis profile in force (``tests/conftest.py``): ``ci`` (the
default, a fixed seed and a few examples per test) or ``long`` (``HYPOTHESIS_PROFILE=long``,
many more, a fresh seed per run). Every test here carries the ``properties`` marker, so
``HYPOTHESIS_PROFILE=long pytest -m properties`` runs exactly them. The module prints how many
examples each op ran when it finishes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from hypothesis import event, given, settings
from hypothesis import strategies as st

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._ops.activations import ACTIVATIONS
from te_flax.dense import dense
from te_flax.layernorm import layernorm
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
from tests.helpers import (
    BLOCK_BACKWARD_TOLERANCE,
    BLOCK_FORWARD_TOLERANCE,
    F32,
    FP8_BACKWARD_TOLERANCE,
    FP8_FORWARD_TOLERANCE,
    assert_close,
    reference_dense,
    reference_norm,
    relative_error,
    tolerance,
)
from tests.test_layernorm_mlp import reference_mlp

pytestmark = pytest.mark.properties

RECIPE_NAMES = ("none", "delayed", "current", "mxfp8", "nvfp4")
# The block size of each block-scaled recipe: every contraction must be a multiple of it.
BLOCK = {"mxfp8": 32, "nvfp4": 16}
DTYPES = (jnp.dtype(F32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ACTIVATION_TYPES = (*((name,) for name in ACTIVATIONS), *((name, "linear") for name in ACTIVATIONS))

# Examples run per op, printed when the module finishes.
EXAMPLES: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_example_counts(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not EXAMPLES:
        return
    counts = ", ".join(f"{name} {count}" for name, count in sorted(EXAMPLES.items()))
    profile = settings.default
    with capture.global_and_fixture_disabled():
        reporter.write_line(
            f"\ntests/test_properties.py: {sum(EXAMPLES.values())} Hypothesis examples ({counts}); "
            f"profile max_examples={profile.max_examples}, derandomize={profile.derandomize}"
        )


def examples(fraction: float) -> settings:
    """The profile's settings with ``fraction`` of its examples (at least 1): the ops differ in
    compile time by an order of magnitude, so the cheap ones get more examples."""
    return settings(max_examples=max(1, round(settings.default.max_examples * fraction)))


# ----------------------------------------------------------------------------- strategies


@st.composite
def recipes(draw, name: str):
    """A recipe of kind ``name`` with drawn settings (None for ``"none"``)."""
    fp8_formats = st.sampled_from([Format.HYBRID, Format.E4M3])
    if name == "none":
        return None
    if name == "delayed":
        return DelayedScaling(
            fp8_format=draw(fp8_formats),
            amax_history_len=draw(st.integers(1, 4)),
            amax_compute_algo=draw(st.sampled_from(["max", "most_recent"])),
        )
    if name == "current":
        return Float8CurrentScaling(fp8_format=draw(fp8_formats))
    if name == "mxfp8":
        return MXFP8BlockScaling(fp8_format=draw(fp8_formats))
    return NVFP4BlockScaling(disable_stochastic_rounding=draw(st.booleans()))


def sizes(block: int | None, largest: int = 96) -> st.SearchStrategy[int]:
    """A feature size: a multiple of ``block`` for block-scaled recipes, else any size from 3,
    half of the draws on multiples of 16. (A layernorm of 2 elements gives +-1 whatever x, so
    its x gradient is only epsilon's rounding noise, which no tolerance relative to it fits.)"""
    if block is not None:
        return st.sampled_from(range(block, largest + 1, block))
    return st.one_of(st.sampled_from(range(16, largest + 1, 16)), st.integers(3, largest))


@st.composite
def leading_axes(draw, block: int | None) -> tuple[int, ...]:
    """1-4 leading (token) axes; for block-scaled recipes their product, the contraction of
    the weight-gradient GEMMs, is made a multiple of the block by growing the first axis."""
    axes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    if block is not None:
        axes[0] *= block // math.gcd(math.prod(axes), block)
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn example: shapes, dtype, options and the seed of the random values."""

    shapes: dict[str, tuple[int, ...]]
    dtype: jnp.dtype
    options: dict[str, object]  # the op's static options, shared by the reference
    recipe: object
    seed: int
    x_scale: float = 1.0
    param_dtype: object = F32


@st.composite
def norm_options(draw) -> dict[str, object]:
    return {
        "norm_type": draw(st.sampled_from(["layernorm", "rmsnorm"])),
        "zero_centered_gamma": draw(st.booleans()),
    }


def _norm_shapes(options, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = {"gamma": (hidden,)}
    if options["norm_type"] == "layernorm":
        shapes["beta"] = (hidden,)
    return shapes


@st.composite
def cases(draw, op: str, recipe_name: str, any_size: bool = False) -> Case:
    """A case of ``op`` under a recipe of kind ``recipe_name``. Block-scaled recipes get sizes
    they can block; with ``any_size`` half of the time any sizes instead, and parameters in a
    drawn dtype."""
    block = BLOCK.get(recipe_name)
    if any_size and draw(st.booleans()):
        block = None  # sizes free of the block: mostly refused by block-scaled recipes
    lead = draw(leading_axes(block))
    options: dict[str, object] = {}
    if op == "dense":
        n_contract = draw(st.integers(1, 2))
        contracted = (draw(sizes(block)),)
        if n_contract == 2:  # a second contracted axis in front: the product stays blocked
            contracted = (draw(st.integers(1, 3)), *contracted)
        features = (draw(sizes(block)),)
        if draw(st.booleans()):  # a second feature axis in front
            features = (draw(st.integers(1, 3)), draw(sizes(block, 48)))
        shapes = {"x": (*lead, *contracted), "kernel": (*contracted, *features)}
        options["n_contract"] = n_contract
    elif op == "layernorm":
        options.update(draw(norm_options()))
        hidden = draw(sizes(block))
        shapes = {"x": (*lead, hidden), **_norm_shapes(options, hidden)}
        features = (hidden,)
    elif op == "layernorm_dense":
        options.update(draw(norm_options()))
        hidden = draw(sizes(block))
        features = (draw(sizes(block)),)
        if draw(st.booleans()):
            features = (draw(st.integers(1, 3)), draw(sizes(block, 48)))
        shapes = {"x": (*lead, hidden), "kernel": (hidden, *features)}
        shapes.update(_norm_shapes(options, hidden))
    else:
        options.update(draw(norm_options()))
        options["activation_type"] = draw(st.sampled_from(ACTIVATION_TYPES))
        hidden, intermediate = draw(sizes(block, 64)), draw(sizes(block))
        n_act = len(options["activation_type"])
        shapes = {
            "x": (*lead, hidden),
            "kernel_1": (hidden, n_act, intermediate),
            "kernel_2": (intermediate, hidden),
            **_norm_shapes(options, hidden),
        }
        if draw(st.booleans()):
            shapes.update(bias_1=(n_act, intermediate), bias_2=(hidden,))
        features = (hidden,)
    if op in ("dense", "layernorm_dense") and draw(st.booleans()):
        shapes["bias"] = tuple(shapes["kernel"][options.get("n_contract", 1) :])
    shapes["cotangent"] = (*lead, *features)
    dtype = draw(st.sampled_from(DTYPES))
    # Norms take out the scale of x; the dense op sees it (the FP8 scales must follow it).
    x_scale = draw(st.sampled_from([0.01, 1.0, 30.0])) if op == "dense" else 1.0
    recipe = draw(recipes(recipe_name))
    seed = draw(st.integers(0, 2**32 - 1))
    param_dtype = draw(st.sampled_from(DTYPES)) if any_size else jnp.dtype(F32)
    case = Case(shapes, dtype, options, recipe, seed, x_scale, param_dtype)
    event(f"dtype {dtype.name}")
    event(f"{len(lead)} leading axes")
    return case


def make_arrays(case: Case) -> tuple[dict[str, jax.Array], jax.Array]:
    """The differentiable arrays of the case (x in the case's dtype, the rest float32) and the
    output cotangent. NumPy draws: jax.random would compile a sampler for every shape."""
    rng = np.random.default_rng(case.seed)

    def normal(shape, scale=1.0, shift=0.0, dtype=F32):
        return jnp.asarray((shift + scale * rng.standard_normal(shape)).astype(dtype))

    centered = bool(case.options.get("zero_centered_gamma", False))
    arrays = {}
    for name, shape in case.shapes.items():
        if name == "x":
            arrays[name] = normal(shape, 2 * case.x_scale, 0.5 * case.x_scale, case.dtype)
        elif name.startswith("kernel"):
            fan_in = math.prod(shape[: case.options.get("n_contract", 1)])
            arrays[name] = normal(shape, fan_in**-0.5)
        elif name == "gamma":
            arrays[name] = normal(shape, 0.2, 0.0 if centered else 1.0)
        else:
            arrays[name] = normal(shape, 0.1 if name != "cotangent" else 1.0)
    return arrays, arrays.pop("cotangent")


def make_state(op: str, recipe, seed: int):
    """Fresh quantizer state for the op: a set, two sets for the MLP, one quantizer for the norm."""
    key = jax.random.key(seed % 2**31)
    if op == "layernorm":
        if recipe is None:
            return None
        return QuantizerFactory.create_set(fp8_recipe=recipe, sr_key=key).x
    if recipe is None:
        return (noop_quantizer_set,) * 2 if op == "layernorm_mlp" else noop_quantizer_set
    n = 2 if op == "layernorm_mlp" else 1
    return QuantizerFactory.create_set(n, fp8_recipe=recipe, sr_key=key)


# ----------------------------------------------------------------------------- ops and references


def _dense(arrays, state, *, n_contract):
    x = arrays["x"]
    dims = (tuple(range(x.ndim - n_contract, x.ndim)), tuple(range(n_contract)))
    return dense(
        x, arrays["kernel"], arrays.get("bias"), contracting_dims=dims, quantizer_set=state
    )


def _dense_reference(arrays, *, n_contract):
    return reference_dense(arrays["x"], arrays["kernel"], arrays.get("bias"), n_contract)


def _layernorm(arrays, state, **options):
    return layernorm(arrays["x"], arrays["gamma"], arrays.get("beta"), quantizer=state, **options)


def _layernorm_reference(arrays, **options):
    return reference_norm(arrays["x"], arrays["gamma"], arrays.get("beta"), **options)


def _layernorm_dense(arrays, state, **options):
    return layernorm_dense(
        arrays["x"],
        arrays["kernel"],
        arrays["gamma"],
        arrays.get("beta"),
        arrays.get("bias"),
        quantizer_set=state,
        **options,
    )


def _layernorm_dense_reference(arrays, **options):
    norm = reference_norm(arrays["x"], arrays["gamma"], arrays.get("beta"), **options)
    return reference_dense(norm, arrays["kernel"], arrays.get("bias"))


def _mlp_arrays(arrays):
    return (
        arrays["x"],
        arrays["gamma"],
        arrays.get("beta"),
        arrays["kernel_1"],
        arrays["kernel_2"],
        arrays.get("bias_1"),
        arrays.get("bias_2"),
    )


def _layernorm_mlp(arrays, state, *, activation_type, **options):
    x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2 = _mlp_arrays(arrays)
    return layernorm_mlp(
        x,
        gamma,
        beta,
        [kernel_1, kernel_2],
        [bias_1, bias_2],
        activation_type=activation_type,
        quantizer_sets=state,
        **options,
    )


def _layernorm_mlp_reference(arrays, **options):
    return reference_mlp(*_mlp_arrays(arrays), **options)


OPS = {
    "dense": (_dense, _dense_reference),
    "layernorm": (_layernorm, _layernorm_reference),
    "layernorm_dense": (_layernorm_dense, _layernorm_dense_reference),
    "layernorm_mlp": (_layernorm_mlp, _layernorm_mlp_reference),
}


def _value_and_grad(op: str, options: dict[str, object]):
    """``(loss, out), (gradients of the arrays, new state)`` of ``loss = sum(out * cotangent)``
    as a function of ``(arrays, state, cotangent)``."""
    function = OPS[op][0]

    def op_loss(arrays, state, cotangent):
        out = function(arrays, state, **options)
        return jnp.sum(out.astype(F32) * cotangent), out

    # allow_int: NVFP4's stochastic-rounding key is a leaf of the state.
    return jax.value_and_grad(op_loss, (0, 1), has_aux=True, allow_int=True)


@functools.cache
def _step(op: str, options: tuple):
    """One jitted function: the op's output, gradients and new state, and the reference's
    float32 output and gradients, of ``loss = sum(out * cotangent)``."""
    reference = OPS[op][1]
    options_dict = dict(options)

    def reference_loss(arrays, cotangent):
        out = reference(arrays, **options_dict)
        return jnp.sum(out * cotangent), out

    def step(arrays, state, cotangent):
        (_, out), (grads, new_state) = _value_and_grad(op, options_dict)(arrays, state, cotangent)
        arrays_f32 = {name: array.astype(F32) for name, array in arrays.items()}
        (_, expected_out), expected_grads = jax.value_and_grad(reference_loss, has_aux=True)(
            arrays_f32, cotangent
        )
        return out, grads, new_state, expected_out, expected_grads

    return jax.jit(step)


# ----------------------------------------------------------------------------- the property


def _assert_finite_state(state) -> None:
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.all(np.isfinite(np.asarray(leaf))), state


def _run(op: str, case: Case, seed: int):
    """The op's results (after two steps for delayed scaling) and the reference's, on the
    case's shapes with the values of ``seed``."""
    arrays, cotangent = make_arrays(dataclasses.replace(case, seed=seed))
    state = make_state(op, case.recipe, seed)
    step = _step(op, tuple(sorted(case.options.items())))
    out, grads, new_state, expected_out, expected_grads = step(arrays, state, cotangent)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    if isinstance(case.recipe, DelayedScaling):
        # The first step quantizes with scale_inv = 1; the second with the scales it recorded.
        _assert_finite_state(new_state)
        out, grads, new_state, *_ = step(arrays, new_state, cotangent)
    _assert_finite_state(new_state)
    assert out.dtype == case.dtype and out.shape == expected_out.shape
    assert set(grads) == set(arrays)
    for name, grad in grads.items():
        assert grad.dtype == arrays[name].dtype and grad.shape == arrays[name].shape, name
    return {"out": out, **grads}, {"out": expected_out, **expected_grads}


# Quantized results are compared normwise over this many draws of the values (same shapes, so
# no recompilation): the normwise error of one small array (two tokens of 16 features) spreads
# from 0.03 to 0.12 across draws, around the 0.05 the tolerances are set for, while the error
# pooled over 8 draws stays near that mean.
POOLED_DRAWS = 8


def check_against_reference(op: str, recipe_name: str, case: Case) -> None:
    """Runs ``op`` on the case and checks its output and gradients against the reference."""
    EXAMPLES[op] += 1
    # Shapes rarely repeat across examples: free the executables of the previous ones, which a
    # long run would otherwise pile up by the thousand.
    _step.cache_clear()
    # Without quantization: elementwise at the dtype's tolerance. The MLP rounds four times in
    # a row in low precision (norm output, pre-activation, activation, output), as in
    # test_layernorm_mlp, so it gets twice that.
    low_precision = case.dtype != jnp.dtype(F32)
    tol = tolerance(case.dtype) * (2 if op == "layernorm_mlp" and low_precision else 1)
    if recipe_name == "none":
        actual, expected = _run(op, case, case.seed)
        for name, value in actual.items():
            assert_close(value, expected[name], tol, name)
        return

    if recipe_name in BLOCK:
        tolerances = BLOCK_FORWARD_TOLERANCE[recipe_name], BLOCK_BACKWARD_TOLERANCE[recipe_name]
    else:
        tolerances = FP8_FORWARD_TOLERANCE, FP8_BACKWARD_TOLERANCE
    # The bias of the last GEMM is summed from the unquantized output gradient, and the norm's
    # quantization is straight-through: these gradients never see the quantization.
    exact = {"bias", "bias_2"} | ({"x", "gamma", "beta"} if op == "layernorm" else set())
    # relu's derivative is a step: the quantization error of a pre-activation near 0 flips it
    # for a few percent of the elements, each then off by its whole gradient (measured 0.18
    # for ReGLU under current scaling, against 0.09 for SwiGLU). The gradients behind the
    # activation get twice the format's bound there.
    behind_step = set()
    if "relu" in case.options.get("activation_type", ()):
        behind_step = {"x", "gamma", "beta", "kernel_1", "bias_1"}
    squared_errors: collections.Counter[str] = collections.Counter()
    squared_norms: collections.Counter[str] = collections.Counter()
    for draw in range(POOLED_DRAWS):
        actual, expected = _run(op, case, case.seed + draw)
        for name, value in actual.items():
            if name in exact:
                assert_close(value, expected[name], tol, name)
                continue
            # NumPy: eager jnp would compile each operation for every new shape.
            reference = np.asarray(expected[name], np.float64)
            difference = np.asarray(value).astype(np.float64) - reference
            squared_errors[name] += float(np.sum(difference * difference))
            squared_norms[name] += float(np.sum(reference * reference))
    for name, squared_error in squared_errors.items():
        error = math.sqrt(squared_error / squared_norms[name])
        limit = (
            tolerances[0] if name == "out" else tolerances[1] * (2 if name in behind_step else 1)
        )
        assert error < limit, (name, error, limit)
        # Quantization really happened.
        assert name != "out" or error > 1e-4, (name, error)


def _property(op: str, fraction: float):
    """The test of ``op``: one per recipe, ``fraction`` of the profile's examples each."""

    @pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
    @examples(fraction)
    @given(data=st.data())
    def test(recipe_name, data):
        case = data.draw(cases(op, recipe_name), label="case")
        event(f"recipe {case.recipe!r}")
        check_against_reference(op, recipe_name, case)

    test.__name__ = f"test_{op}_matches_reference"
    test.__doc__ = f"``{op}``: output and gradients against the float32 reference."
    return test


test_layernorm_matches_reference = _property("layernorm", 1.5)
test_dense_matches_reference = _property("dense", 1.0)
test_layernorm_dense_matches_reference = _property("layernorm_dense", 1.0)
test_layernorm_mlp_matches_reference = _property("layernorm_mlp", 0.5)


# ----------------------------------------------------------------------------- traced only


def contracted_sizes(op: str, case: Case) -> list[int]:
    """The sizes every GEMM of a training step contracts (the norm's quantization: its hidden
    size): features in, features out and the tokens of the weight gradients."""
    shapes = case.shapes
    if op == "layernorm":
        return [shapes["x"][-1]]
    kernel = shapes["kernel_1"] if op == "layernorm_mlp" else shapes["kernel"]
    n_contract = int(case.options.get("n_contract", 1))
    tokens = math.prod(shapes["x"][: len(shapes["x"]) - n_contract])
    sizes = [math.prod(kernel[:n_contract]), math.prod(kernel[n_contract:]), tokens]
    if op == "layernorm_mlp":
        sizes.append(shapes["kernel_2"][0])  # the intermediate size, contracted by GEMM 2
    return sizes


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@examples(3)
@given(data=st.data())
def test_shapes_dtypes_and_block_size_errors(recipe_name, data):
    """Traced, not compiled, so cheap: for any op, recipe, sizes and dtypes (parameters in
    another dtype than x included), the output has x's dtype and the expected shape, each
    gradient its input's dtype and shape, the new state the old state's structure; and a
    block-scaled recipe refuses, with its clear error, exactly the sizes it cannot block."""
    op = data.draw(st.sampled_from(sorted(OPS)), label="op")
    case = data.draw(cases(op, recipe_name, any_size=True), label="case")
    EXAMPLES["traced"] += 1
    event(f"{op} {recipe_name}")
    arrays = {
        name: jax.ShapeDtypeStruct(shape, case.dtype if name == "x" else case.param_dtype)
        for name, shape in case.shapes.items()
    }
    cotangent = jax.ShapeDtypeStruct(arrays.pop("cotangent").shape, F32)
    state = make_state(op, case.recipe, case.seed)
    value_and_grad = _value_and_grad(op, case.options)
    block = BLOCK.get(recipe_name)
    unblocked = [size for size in contracted_sizes(op, case) if block and size % block]
    if unblocked:
        event("refused: a size not a multiple of the block")
        with pytest.raises(ValueError, match=f"blocks of {block} .* not a multiple of {block}"):
            jax.eval_shape(value_and_grad, arrays, state, cotangent)
        return
    (_, out), (grads, new_state) = jax.eval_shape(value_and_grad, arrays, state, cotangent)
    assert out.dtype == case.dtype and out.shape == cotangent.shape
    assert set(grads) == set(arrays)
    for name, grad in grads.items():
        assert (grad.dtype, grad.shape) == (arrays[name].dtype, arrays[name].shape), name
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


# ----------------------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(amax_history_len=1),
        Float8CurrentScaling(),
        NVFP4BlockScaling(disable_stochastic_rounding=True),
    ],
    ids=["delayed", "current", "nvfp4"],
)
def test_float16_gemms_do_not_overflow_before_their_scales(recipe):
    """Found by the dense property: a float16 FP8 GEMM accumulated the unscaled product of two
    quantized operands (e4m3 reaches 448) in float16, whose largest value is 65504, and gave
    inf for ordinary inputs. It now accumulates and scales in float32."""
    rng = np.random.default_rng(0)
    arrays = {
        "x": jnp.asarray(rng.standard_normal((32, 64)), jnp.float16),
        "kernel": jnp.asarray(rng.standard_normal((64, 32)) / 8, F32),
    }
    cotangent = jnp.asarray(rng.standard_normal((32, 32)), F32)
    state = make_state("dense", recipe, 0)
    step = _step("dense", (("n_contract", 1),))
    for _ in range(2):  # delayed scaling: the second step has scales far from 1
        out, grads, state, expected_out, expected_grads = step(arrays, state, cotangent)
    forward_tol, backward_tol = FP8_FORWARD_TOLERANCE, FP8_BACKWARD_TOLERANCE
    if isinstance(recipe, NVFP4BlockScaling):
        forward_tol, backward_tol = (
            BLOCK_FORWARD_TOLERANCE["nvfp4"],
            BLOCK_BACKWARD_TOLERANCE["nvfp4"],
        )
    assert out.dtype == jnp.float16
    assert relative_error(out, expected_out) < forward_tol
    for name in ("x", "kernel"):
        assert relative_error(grads[name], expected_grads[name]) < backward_tol, name


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@examples(1)
@given(data=st.data())
def test_linen_and_nnx_layernorm_mlp_make_the_same_variables(recipe_name, data):
    """Traced only: for drawn sizes, options and recipes, Linen's and NNX's ``LayerNormMLP``
    create the same parameters and FP8 variables (names, shapes, dtypes), and Linen's output
    has the input's shape and dtype."""
    EXAMPLES["modules"] += 1
    block = BLOCK.get(recipe_name)
    lead = data.draw(leading_axes(block), label="leading axes")
    hidden = data.draw(sizes(block, 64), label="hidden")
    attributes = {
        "intermediate_dim": data.draw(sizes(block), label="intermediate_dim"),
        "activations": data.draw(st.sampled_from(ACTIVATION_TYPES), label="activations"),
        "layernorm_type": data.draw(st.sampled_from(["layernorm", "rmsnorm"])),
        "zero_centered_gamma": data.draw(st.booleans(), label="zero_centered_gamma"),
        "use_bias": data.draw(st.booleans(), label="use_bias"),
        "recipe": data.draw(recipes(recipe_name), label="recipe"),
    }
    x = jax.ShapeDtypeStruct((*lead, hidden), data.draw(st.sampled_from(DTYPES), label="dtype"))
    keys = {"params": jax.random.key(0), "sr_rng": jax.random.key(1)}
    layer = te_nn.LayerNormMLP(**attributes)
    (out, _), variables = jax.eval_shape(
        functools.partial(layer.init_with_output, deterministic=True), keys, x
    )
    assert (out.shape, out.dtype) == (x.shape, x.dtype)
    nnx_layer = nnx.eval_shape(
        lambda: te_nnx.LayerNormMLP(hidden, rngs=nnx.Rngs(0, sr_rng=1), **attributes)
    )

    def shapes(tree):
        return jax.tree.map(lambda leaf: (leaf.shape, jnp.dtype(leaf.dtype)), tree)

    variables = nn.meta.unbox(variables)
    assert shapes(nnx.to_pure_dict(nnx.state(nnx_layer, nnx.Param))) == shapes(variables["params"])
    fp8_variables = variables.get(OVERWRITE_WITH_GRADIENT, {})
    assert bool(fp8_variables) == (recipe_name == "delayed")  # only delayed scaling keeps state
    assert shapes(nnx.to_pure_dict(nnx.state(nnx_layer, te_nnx.Fp8Meta))) == shapes(
        dict(fp8_variables)
    )
