"""make_dot_general_cls: a stock flax.linen.DenseGeneral given te_flax's and given
TransformerEngine's, run side by side for several training steps from the same variables."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from te_flax.convert import TE_FP8_COLLECTION, from_transformer_engine
from tests.parity import te_reference as ref

TOLERANCE = 1e-5
STEPS = 3
SHAPE = (2, 8, 32)
OVERWRITE = "_overwrite_with_gradient"


@pytest.mark.parametrize("recipe_name", ["none", "delayed", "current"])
def test_dot_general_cls_steps_equal_transformer_engine(recipe_name, parity_results):
    ours_recipe, te_recipe = ref.RECIPES[recipe_name]
    ours = nn.DenseGeneral(48, dot_general_cls=te_nn.make_dot_general_cls(ours_recipe))
    theirs = nn.DenseGeneral(48, dot_general_cls=ref.TE.make_dot_general_cls(te_recipe))
    x = jax.random.normal(jax.random.key(1), SHAPE)
    cotangent = jax.random.normal(jax.random.key(2), (*SHAPE[:-1], 48))
    our_variables = ours.init(jax.random.key(0), x)
    with ref.te_context(te_recipe):
        te_variables = theirs.init(jax.random.key(0), x)
    # The same parameters and, in TE's collection, state of the same shapes.
    assert ref.flat(our_variables["params"]).keys() == ref.flat(te_variables["params"]).keys()
    our_state = ref.flat(our_variables.get(OVERWRITE, {}))
    te_state = ref.flat(te_variables.get(OVERWRITE, {}))
    assert {k: v.shape for k, v in our_state.items() if "amax_history" in k} == {
        k: v.shape for k, v in te_state.items() if "amax_history" in k
    }
    te_variables = {**te_variables, "params": our_variables["params"]}
    our_runner = ref.Runner(ours, OVERWRITE, lambda: ref.our_context(None), {})
    te_runner = ref.Runner(theirs, OVERWRITE, lambda: ref.te_context(te_recipe), {})
    worst = {"output": 0.0, "parameter gradients": 0.0, "FP8 state": 0.0}
    for _ in range(STEPS):
        our_variables, our_result = our_runner.step(our_variables, x, cotangent)
        te_variables, te_result = te_runner.step(te_variables, x, cotangent)
        errors = {
            "output": ref.relative_error(our_result[0], te_result[0]),
            "parameter gradients": max(
                ref.relative_error(a, b)
                for a, b in zip(
                    jax.tree.leaves(our_result[1]), jax.tree.leaves(te_result[1]), strict=True
                )
            ),
        }
        # TE's state, in its own layout in this collection, converted to te_flax's; histories
        # compared without their oldest entry, which TE has cleared.
        converted = from_transformer_engine({"params": {}, TE_FP8_COLLECTION: te_result[2]})
        our_fp8, te_fp8 = ref.flat(our_result[2]), ref.flat(converted.get(OVERWRITE, {}))
        assert our_fp8.keys() == te_fp8.keys()
        errors["FP8 state"] = max(
            (ref.relative_error(our_fp8[k][:-1], te_fp8[k][:-1]) for k in our_fp8),
            default=0.0,
        )
        for what, error in errors.items():
            worst[what] = max(worst[what], error)
            assert error <= TOLERANCE, (what, error)
    parity_results[("stock DenseGeneral + make_dot_general_cls", recipe_name)] = worst
