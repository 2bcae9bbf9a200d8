"""Recipe fields: TransformerEngine 2.20's names and defaults, what each implemented field changes
in the numbers, and the refusal of each value te_flax cannot honour."""

import dataclasses
import functools
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from te_flax.dense import dense
from te_flax.layernorm_dense import layernorm_dense
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import (
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    GemmPrecision,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
    QuantizerSet,
)
from te_flax.quantize import recipes as recipes_module
from tests.helpers import F32, normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DEFAULT, HIGHEST = lax.Precision.DEFAULT, lax.Precision.HIGHEST

# ----------------------------------------------------------------------------- fields

# TransformerEngine 2.20.2's dataclass fields (annotated names, in order) and defaults, from
# transformer_engine/common/recipe/__init__.py with no NVTE_* variable set.
TE_FIELDS = {
    DelayedScaling: {
        "margin": 0,
        "fp8_format": Format.HYBRID,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None,
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    Float8CurrentScaling: {
        "use_power_2_scales": False,
        "fp8_format": Format.HYBRID,
        "fp8_gemm_fprop": MMParams(use_split_accumulator=False),
        "fp8_gemm_dgrad": MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": MMParams(use_split_accumulator=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    Float8BlockScaling: {
        "use_f32_scales": False,
        "fp8_format": Format.E4M3,
        "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1,
        "fp8_gemm_fprop": MMParams(use_split_accumulator=True),
        "fp8_gemm_dgrad": MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": MMParams(use_split_accumulator=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    MXFP8BlockScaling: {
        "margin": 0,
        "fp8_format": Format.E4M3,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
        "enable_2d_quantization": False,
    },
    NVFP4BlockScaling: {
        "disable_rht": False,
        "disable_stochastic_rounding": False,
        "disable_2d_quantization": False,
        "row_scaled_activation": False,
        "nvfp4_4over6": "none",
        "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE",
        "fp4_format": Format.E2M1,
        "fp8_format": Format.E4M3,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
}


@pytest.mark.parametrize("cls", list(TE_FIELDS), ids=lambda cls: cls.__name__)
def test_fields_and_defaults_are_transformer_engines(cls):
    recipe = cls()
    assert [f.name for f in dataclasses.fields(cls)] == list(TE_FIELDS[cls])
    assert {name: getattr(recipe, name) for name in TE_FIELDS[cls]} == TE_FIELDS[cls]
    hash(recipe)  # static configuration
    # Positional arguments land where TransformerEngine's do.
    assert cls(*TE_FIELDS[cls].values()) == recipe


def test_mmparams_default_and_precision():
    assert MMParams() == MMParams(use_split_accumulator=True)
    assert MMParams(True).precision == HIGHEST and MMParams(False).precision == DEFAULT
    with pytest.raises(TypeError, match=r"MMParams\(use_split_accumulator=\.\.\.\) must be a bool"):
        MMParams(use_split_accumulator=1)


def test_kind_predicates():
    kinds = ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4")
    for cls, kind in zip(TE_FIELDS, kinds, strict=True):
        assert {k: getattr(cls, k)() for k in kinds} == {k: k == kind for k in kinds}
        assert getattr(cls(), kind)()  # also on instances, as in TransformerEngine
        assert not cls.custom()
    assert DelayedScaling.float8_per_tensor_scaling()
    assert Float8CurrentScaling.float8_per_tensor_scaling()
    assert not MXFP8BlockScaling.float8_per_tensor_scaling()
    assert not Float8BlockScaling.float8_per_tensor_scaling()


def test_kind_predicates_follow_subclasses_and_carry_docstrings():
    @dataclasses.dataclass(frozen=True)
    class TunedDelayedScaling(DelayedScaling):
        note: str = ""

    assert TunedDelayedScaling.delayed() and TunedDelayedScaling(note="x").delayed()
    assert TunedDelayedScaling.float8_per_tensor_scaling()
    assert not TunedDelayedScaling.mxfp8() and not TunedDelayedScaling.custom()
    assert DelayedScaling.kinds == {"delayed", "float8_per_tensor_scaling"}
    assert MXFP8BlockScaling.kinds == {"mxfp8"}
    assert DelayedScaling.mxfp8.__doc__ == "Whether the recipe is MXFP8 block scaling."


def test_quantization_params_follow_the_fields():
    assert Float8CurrentScaling().fp8_quant_fwd_inp.power_2_scale is False
    power_2 = Float8CurrentScaling(use_power_2_scales=True)
    assert power_2.fp8_quant_fwd_weight.power_2_scale and power_2.fp8_quant_bwd_grad.power_2_scale
    assert NVFP4BlockScaling().fp4_quant_bwd_grad.stochastic_rounding
    nearest = NVFP4BlockScaling(disable_stochastic_rounding=True)
    assert not nearest.fp4_quant_bwd_grad.stochastic_rounding and not nearest.stochastic_rounding


REFUSED = [
    (lambda: DelayedScaling(reduce_amax=False), ValueError, r"one value per tensor"),
    (lambda: DelayedScaling(reduce_amax=0), TypeError, r"reduce_amax=\.\.\.\) must be a bool"),
    (lambda: DelayedScaling(backward_override="dequantized"), ValueError, r"only supports .*None"),
    (lambda: DelayedScaling(backward_override="fp8"), ValueError, r"must be None, 'high_prec"),
    (lambda: DelayedScaling(amax_compute_algo="mean"), ValueError, r"or a function of the amax"),
    (lambda: DelayedScaling(scaling_factor_compute_algo=2.0), TypeError, r"None or a function"),
    (lambda: DelayedScaling(fp8_mha=True), ValueError, r"FP8 multi-head attention .* does not"),
    (lambda: Float8CurrentScaling(fp8_mha=True), ValueError, r"Leave fp8_mha=False"),
    (lambda: Float8CurrentScaling(use_power_2_scales=1), TypeError, r"must be a bool"),
    (lambda: Float8CurrentScaling(fp8_gemm_fprop=True), TypeError, r"must be a te_flax\.quant"),
    (
        lambda: Float8CurrentScaling(backward_override="high_precision"),
        ValueError,
        r"not implemented in te_flax: its backward GEMMs always multiply",
    ),
    (lambda: MXFP8BlockScaling(margin=1), ValueError, r"take no margin"),
    (lambda: MXFP8BlockScaling(enable_2d_quantization=True), ValueError, r"1x32 blocks"),
    (lambda: MXFP8BlockScaling(fp8_dpa=True), ValueError, r"FP8 attention, which te_flax builds"),
    (lambda: MXFP8BlockScaling(backward_override="dequantized"), ValueError, r"not implemented"),
    (lambda: NVFP4BlockScaling(row_scaled_activation=True), ValueError, r"one tensor scale per"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6="all"), ValueError, r"4-over-6 .* not implement"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6="some"), ValueError, r"must be one of 'none'"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6_err_mode="L1"), ValueError, r"'MAE', 'MSE'"),
    (lambda: NVFP4BlockScaling(fp8_format=Format.HYBRID), ValueError, r"must be\s+Format\.E4M3"),
    (lambda: NVFP4BlockScaling(disable_rht=1), TypeError, r"disable_rht=\.\.\.\) must be a bool"),
    (lambda: NVFP4BlockScaling(fp8_mha=True), ValueError, r"FP8 multi-head attention"),
    (lambda: NVFP4BlockScaling(fp8_dpa=True), ValueError, r"per-tensor scaling only"),
    (lambda: NVFP4BlockScaling(backward_override="dequantized"), ValueError, r"not implemented"),
]


@pytest.mark.parametrize(("build", "error", "message"), REFUSED)
def test_values_te_flax_cannot_honour_are_refused(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_accepted_values_te_flax_honours_as_they_are():
    # 4-over-6 options without 4-over-6, and TE's switches to what te_flax does anyway.
    NVFP4BlockScaling(nvfp4_4over6_e4m3_use_256="none", nvfp4_4over6_err_mode="MSE")
    NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True)


def test_a_callable_field_must_hash():
    class Unhashable:
        __hash__ = None

        def __call__(self, history):
            return history[0]

    with pytest.raises(TypeError, match=r"must be hashable, .* jax\.jit's cache key"):
        DelayedScaling(amax_compute_algo=Unhashable())
    newest = functools.partial(jnp.take, indices=0)
    assert hash(DelayedScaling(amax_compute_algo=newest)) == hash(
        DelayedScaling(amax_compute_algo=newest)
    )


def test_no_environment_variable_is_read(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1")
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    source = pathlib.Path(recipes_module.__file__).read_text()
    assert "os.environ" not in source and "getenv" not in source
    assert not NVFP4BlockScaling().disable_stochastic_rounding
    assert not Float8CurrentScaling().use_power_2_scales


# ----------------------------------------------------------------------------- power-of-2 scales


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_2_scales_round_the_scale_down_to_a_power_of_two(dtype):
    fp8_max = float(jnp.finfo(dtype).max)
    quantizer = CurrentScaleQuantizer(dtype, power_2_scale=True)
    for amax in (3.0, 448.0, 449.0, 1e-3, 7.5e4, 2.0**-20):
        scale_inv = float(quantizer.scale_inv_for(jnp.float32(amax)))
        # TransformerEngine: scale = fp8_max / amax in float32, mantissa dropped.
        scale = np.float32(fp8_max) / np.float32(amax)
        expected = 1.0 / 2.0 ** np.floor(np.log2(scale))
        assert scale_inv == expected, amax
        assert np.log2(scale_inv) == np.round(np.log2(scale_inv))
        assert amax / fp8_max <= scale_inv < 2 * amax / fp8_max
    # Zero and non-finite amaxes keep the scale at 1, as without power-of-2 scales.
    assert float(quantizer.scale_inv_for(jnp.float32(0.0))) == 1.0
    assert float(quantizer.scale_inv_for(jnp.float32(jnp.inf))) == 1.0


def test_power_2_scales_change_the_quantized_gemm():
    x = normal(jax.random.key(0), (16, 32), scale=3.0)
    kernel = normal(jax.random.key(1), (32, 16))
    qs = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling(use_power_2_scales=True))
    assert qs.x.power_2_scale and qs.dgrad.power_2_scale

    def quantized(value, dtype):  # by hand: scale_inv = 2**ceil(log2(amax / fp8_max))
        amax = float(jnp.max(jnp.abs(value)))
        scale_inv = 2.0 ** np.ceil(np.log2(amax / float(jnp.finfo(dtype).max)))
        return (value / scale_inv).astype(dtype).astype(F32) * scale_inv

    expected = quantized(x, E4M3) @ quantized(kernel, E4M3)
    np.testing.assert_allclose(dense(x, kernel, quantizer_set=qs), expected, rtol=1e-5, atol=1e-5)
    plain = dense(
        x, kernel, quantizer_set=QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling())
    )
    assert not np.array_equal(plain, expected)


# ----------------------------------------------------------------------------- GEMM precision


def _dot_precisions(fn, *args):
    """The precision of every float8 ``dot_general`` in ``fn``'s jaxpr, in program order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and all(
                jnp.dtype(v.aval.dtype).itemsize == 1 for v in eqn.invars
            ):
                found.append(eqn.params["precision"][0])
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


FLIPPED = Float8CurrentScaling(
    fp8_gemm_fprop=MMParams(True), fp8_gemm_dgrad=MMParams(False), fp8_gemm_wgrad=MMParams(False)
)


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        (Float8CurrentScaling(), (DEFAULT, HIGHEST, HIGHEST)),
        (DelayedScaling(amax_history_len=2), (DEFAULT, HIGHEST, HIGHEST)),
        (FLIPPED, (HIGHEST, DEFAULT, DEFAULT)),
    ],
    ids=["current-default", "delayed", "current-flipped"],
)
def test_mmparams_set_each_gemms_precision(recipe, expected):
    x = normal(jax.random.key(0), (16, 32))
    kernel = normal(jax.random.key(1), (32, 16))
    gamma, beta = jnp.ones(32), jnp.zeros(32)
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)
    assert qs.precision == GemmPrecision(*expected)

    def dense_loss(x, kernel):
        return jnp.sum(dense(x, kernel, quantizer_set=qs))

    def layernorm_dense_loss(x, kernel):
        return jnp.sum(layernorm_dense(x, kernel, gamma, beta, quantizer_set=qs))

    grad = functools.partial(jax.grad, argnums=(0, 1))
    # forward, then dgrad and wgrad
    assert _dot_precisions(grad(dense_loss), x, kernel) == list(expected)
    assert _dot_precisions(grad(layernorm_dense_loss), x, kernel) == list(expected)

    sets = QuantizerFactory.create_set(2, fp8_recipe=recipe)
    kernels = (kernel.reshape(32, 1, 16), normal(jax.random.key(2), (16, 32)))

    def mlp_loss(x, kernels):
        out = layernorm_mlp(x, gamma, beta, kernels, (None, None), "layernorm", quantizer_sets=sets)
        return jnp.sum(out)

    forward, backward = expected[0], expected[1]
    assert _dot_precisions(grad(mlp_loss), x, kernels) == [forward] * 2 + [backward] * 4


def test_default_current_scaling_is_unchanged():
    """The recipe's default set computes what a set of plain quantizers computes."""
    x = normal(jax.random.key(0), (16, 32))
    kernel = normal(jax.random.key(1), (32, 16))
    by_hand = QuantizerSet(
        CurrentScaleQuantizer(E4M3), CurrentScaleQuantizer(E4M3), CurrentScaleQuantizer(E5M2)
    )
    from_recipe = QuantizerFactory.create_set(fp8_recipe=Float8CurrentScaling())

    def run(qs):
        return jax.value_and_grad(
            lambda x, k: jnp.sum(dense(x, k, quantizer_set=qs) ** 2), argnums=(0, 1)
        )(x, kernel)

    jax.tree.map(np.testing.assert_array_equal, run(from_recipe), run(by_hand))


# ----------------------------------------------------------------------------- delayed scaling


def _delayed_steps(recipe, amaxes):
    quantizer = DelayedScaleQuantizer.fresh(E4M3, recipe)
    scale_invs = []
    for amax in amaxes:
        quantizer = quantizer.update(jnp.float32(amax))
        scale_invs.append(float(quantizer.scale_inv[0]))
    return scale_invs


AMAXES = [2.0, 8.0, 4.0, 1.0]


def test_scaling_factor_compute_algo_gives_the_new_quantization_scale():
    def limited_growth(amax, old_scaling_factor, fp8_max, recipe):
        # TE's default with the recipe's margin, but never more than twice the old scale.
        target = fp8_max / amax / 2.0**recipe.margin
        return jnp.minimum(target, 2.0 * old_scaling_factor)

    recipe = DelayedScaling(
        margin=1, amax_history_len=2, scaling_factor_compute_algo=limited_growth
    )
    amaxes = [448.0, 896.0, 224.0, 112.0]
    expected, scale = [], 1.0  # TE's scaling factor: 1 / scale_inv
    history = [0.0, 0.0]
    for amax in amaxes:
        history = [amax, history[0]]
        scale = min(448.0 / max(history) / 2.0, 2.0 * scale)
        expected.append(1.0 / scale)
    assert expected == [2.0, 4.0, 4.0, 2.0]  # the growth limit cuts in at step 4 (1.0 without)
    np.testing.assert_allclose(_delayed_steps(recipe, amaxes), expected, rtol=1e-7)


def test_scaling_factor_compute_algo_keeps_the_scale_where_it_is_not_positive():
    recipe = DelayedScaling(scaling_factor_compute_algo=lambda amax, old, fp8_max, r: -old)
    assert _delayed_steps(recipe, [3.0]) == [1.0]


def test_callable_amax_compute_algo_reduces_the_history():
    def mean_of_two_newest(history):
        return (history[0] + history[1]) / 2.0

    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=mean_of_two_newest)
    expected = [1.0 / 448, 5.0 / 448, 6.0 / 448, 2.5 / 448]
    np.testing.assert_allclose(_delayed_steps(recipe, AMAXES), expected, rtol=1e-7)


def test_callable_fields_run_in_a_training_step():
    """Through an op: the x quantizer's new scale comes from the recipe's functions."""
    recipe = DelayedScaling(
        amax_history_len=4,
        amax_compute_algo=lambda history: history[0],
        scaling_factor_compute_algo=lambda amax, old, fp8_max, recipe: fp8_max / amax / 4.0,
    )
    x = normal(jax.random.key(0), (16, 32))
    kernel = normal(jax.random.key(1), (32, 16))
    qs = QuantizerFactory.create_set(fp8_recipe=recipe)
    for step in range(3):
        x_step = x * (step + 1)
        _, vjp = jax.vjp(lambda qs, x=x_step: dense(x, kernel, quantizer_set=qs), qs)
        (qs,) = jax.jit(vjp)(jnp.ones((16, 16)))
        expected = 4.0 * float(jnp.max(jnp.abs(x_step))) / 448.0
        np.testing.assert_allclose(float(qs.x.scale_inv[0]), expected, rtol=1e-6)


# ----------------------------------------------------------------------------- NVFP4 rounding


def _nvfp4_kernel_grad(recipe, sr_key):
    x = normal(jax.random.key(0), (32, 32))
    kernel = normal(jax.random.key(1), (32, 32))
    qs = QuantizerFactory.create_set(fp8_recipe=recipe, sr_key=sr_key)
    grad = jax.grad(lambda k: jnp.sum(dense(x, k, quantizer_set=qs) * x), argnums=0)
    return np.asarray(jax.jit(grad)(kernel))


def test_nvfp4_rounds_gradients_stochastically_by_default():
    recipe = NVFP4BlockScaling()
    assert recipe.stochastic_rounding
    first = _nvfp4_kernel_grad(recipe, jax.random.key(1))
    np.testing.assert_array_equal(first, _nvfp4_kernel_grad(recipe, jax.random.key(1)))
    assert not np.array_equal(first, _nvfp4_kernel_grad(recipe, jax.random.key(2)))
    with warnings.catch_warnings():  # without a key: to nearest, as TE (said once elsewhere)
        warnings.simplefilter("ignore")
        assert QuantizerFactory.create_set(fp8_recipe=recipe).dgrad.key is None


def test_nvfp4_disable_stochastic_rounding_is_deterministic():
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    assert QuantizerFactory.create_set(fp8_recipe=recipe).dgrad.key is None
    np.testing.assert_array_equal(
        _nvfp4_kernel_grad(recipe, jax.random.key(1)), _nvfp4_kernel_grad(recipe, None)
    )
