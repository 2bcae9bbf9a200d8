"""Every attribute of TransformerEngine 2.20.2's Linen modules and recipes exists in te_flax with
TE's default, except the differences docs/porting.md lists."""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np
import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import te_flax.linen as te_nn
from te_flax import quantize
from tests.parity import te_reference as ref

MODULES = [
    "LayerNorm",
    "DenseGeneral",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
]
RECIPES = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
]

# Deliberate differences (docs/porting.md): Flax's ``dtype`` is the compute dtype, None for
# "the input's", with the storage dtype in ``param_dtype`` (float32); TE's ``dtype`` is the
# storage dtype with computation in the input's dtype, so both defaults behave alike
# (test_layers.py: bfloat16 inputs).
DTYPE_MEANS_COMPUTE = "dtype"


def _fields(cls):
    fields = {}
    for field in dataclasses.fields(cls):
        if field.name in ("parent", "name"):
            continue
        if field.default is not dataclasses.MISSING:
            fields[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            fields[field.name] = field.default_factory()
        else:
            fields[field.name] = dataclasses.MISSING
    return fields


def _same_default(ours, theirs):
    if isinstance(theirs, enum.Enum):
        return isinstance(ours, enum.Enum) and ours.name == theirs.name
    if callable(theirs) and callable(ours):
        # Initializers: the same values from the same key.
        key = jax.random.key(0)
        return np.array_equal(ours(key, (4, 6)), theirs(key, (4, 6)))
    if dataclasses.is_dataclass(theirs) and dataclasses.is_dataclass(ours):
        # Parameter objects such as MMParams: the same fields with the same values.
        theirs_fields, ours_fields = _fields(type(theirs)), _fields(type(ours))
        return theirs_fields.keys() <= ours_fields.keys() and all(
            _same_default(getattr(ours, f), getattr(theirs, f)) for f in theirs_fields
        )
    if isinstance(theirs, tuple | list) and isinstance(ours, tuple | list):
        return tuple(ours) == tuple(theirs)
    return (type(ours) is type(theirs) and ours == theirs) or (ours is theirs)


@pytest.mark.parametrize("name", MODULES)
def test_module_attributes_and_defaults(name):
    theirs, ours = _fields(getattr(ref.TE, name)), _fields(getattr(te_nn, name))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"te_flax.linen.{name} lacks TE's attributes {missing}"
    for field, default in theirs.items():
        if default is dataclasses.MISSING:
            continue  # TE requires it; te_flax may give a default (a superset breaks no TE code)
        if field == DTYPE_MEANS_COMPUTE and ours[field] is None:
            continue
        assert _same_default(ours[field], default), (
            f"{name}.{field}: TE's default {default!r}, te_flax's {ours[field]!r}"
        )


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fields_and_defaults(name):
    theirs, ours = _fields(getattr(ref.te_recipe, name)), _fields(getattr(quantize, name))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"te_flax.quantize.{name} lacks TE's fields {missing}"
    for field, default in theirs.items():
        assert _same_default(ours[field], default), (
            f"{name}.{field}: TE's default {default!r}, te_flax's {ours[field]!r}"
        )
