"""TransformerEngine 2.20.2's Linen constructors take their fields positionally; te_flax's take
TE's fields first, in TE's order and with TE's defaults, then te_flax's own (``param_dtype``,
``recipe``, ...), so ``LayerNorm(1e-5)`` or ``LayerNormDenseGeneral(256, True, "rmsnorm")``
means what it means in TE."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from tests.parity import te_reference as ref
from tests.parity.test_fields import DTYPE_MEANS_COMPUTE, MODULES
from tests.parity.test_fields import _same_default as _same_value
from tests.parity.test_te_names import _same_default, _signature_differences
from tests.test_te_names import status_rows

# Flax appends these to every module's constructor, after the module's own fields.
FLAX_FIELDS = ("parent", "name")


def _constructor(module: type, *, with_defaults: bool = True):
    """A stand-in whose signature is ``module``'s constructor less Flax's own fields (without
    the defaults when ``with_defaults`` is False)."""
    parameters = [
        p if with_defaults else p.replace(default=inspect.Parameter.empty)
        for p in inspect.signature(module).parameters.values()
        if p.name not in FLAX_FIELDS
    ]

    def construct(*args, **kwargs):
        return module(*args, **kwargs)

    construct.__signature__ = inspect.Signature(parameters)
    return construct


@pytest.mark.parametrize("name", MODULES)
def test_tes_fields_come_first_in_tes_order(name):
    """TE's positional-or-keyword fields are the first of ours, same names, same order, same
    kind; te_flax's own come after them, each with a default."""
    theirs = _constructor(getattr(ref.TE, name), with_defaults=False)
    problems = _signature_differences(theirs, _constructor(getattr(te_nn, name)))
    assert not problems, f"te_flax.linen.{name}: {problems}"
    kinds = {p.kind for p in inspect.signature(theirs).parameters.values()}
    assert kinds == {inspect.Parameter.POSITIONAL_OR_KEYWORD}, kinds


@pytest.mark.parametrize("name", MODULES)
def test_tes_fields_have_tes_defaults(name):
    """For every module docs/porting.md calls "same", each field TE gives a default has it in
    te_flax too: the same value, or an initializer that draws the same values from the same key.
    ``dtype`` is the one deliberate difference (docs/porting.md, "What changes")."""
    assert status_rows()[f"transformer_engine.jax.flax.{name}"][0] == "same"
    ours = inspect.signature(getattr(te_nn, name)).parameters
    wrong = {}
    for field in inspect.signature(getattr(ref.TE, name)).parameters.values():
        if field.name in FLAX_FIELDS or field.default is inspect.Parameter.empty:
            continue  # TE requires it; te_flax may give a default (a superset breaks no TE code)
        default = ours[field.name].default
        if field.name == DTYPE_MEANS_COMPUTE and default is None:
            continue
        if not (_same_default(field.default, default) or _same_value(default, field.default)):
            wrong[field.name] = (field.default, default)
    assert not wrong, f"te_flax.linen.{name}: (TE's default, te_flax's) {wrong}"


def test_positional_construction_means_what_it_means_in_te():
    assert te_nn.LayerNorm(1e-5).epsilon == ref.TE.LayerNorm(1e-5).epsilon == 1e-5
    ours = te_nn.LayerNormDenseGeneral(8, True, "rmsnorm", 1e-5)
    theirs = ref.TE.LayerNormDenseGeneral(8, True, "rmsnorm", 1e-5)
    assert (ours.layernorm_type, ours.epsilon) == (theirs.layernorm_type, theirs.epsilon)
    assert te_nn.DenseGeneral(
        8, None, (), False, ours.bias_init, (), True
    ).enable_low_rank_adaptation
