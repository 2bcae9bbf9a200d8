"""Every NNX module's signature lists its layer's attributes: the Linen twin's fields, each a
keyword with the same default and a type, as ``inspect.signature`` and ``help()`` show them."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import pydoc
import subprocess
import sys

import pytest
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx

MODULES = [
    "LayerNorm",
    "DenseGeneral",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "MoEBlock",
]


def _linen_fields(name):
    return [f for f in dataclasses.fields(getattr(te_nn, name)) if f.name not in ("parent", "name")]


@pytest.mark.parametrize("name", MODULES)
def test_every_linen_field_is_a_typed_parameter_with_its_default(name):
    parameters = inspect.signature(getattr(te_nnx, name)).parameters
    assert "self" not in parameters
    assert parameters["rngs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for field in _linen_fields(name):
        assert field.name in parameters, f"te_flax.nnx.{name} does not list {field.name}"
        parameter = parameters[field.name]
        assert parameter.annotation is not inspect.Parameter.empty, field.name
        if parameter.default is inspect.Parameter.empty:
            continue  # a size the NNX constructor requires (features, head_dim, ...)
        assert parameter.default is field.default or parameter.default == field.default, (
            f"te_flax.nnx.{name}.{field.name}: Linen's default {field.default!r}, "
            f"NNX's {parameter.default!r}"
        )


def test_help_shows_the_options():
    text = pydoc.render_doc(te_nnx.LayerNormMLP, renderer=pydoc.plaintext)
    assert "intermediate_dim: int = 2048" in text
    assert "layernorm_type: str = 'layernorm'" in text
    assert "low_rank_adaptation_dim: int = 32" in text


def test_the_signature_binds_as_the_constructor_does():
    signature = inspect.signature(te_nnx.LayerNormDenseGeneral)
    bound = signature.bind(8, 4, rngs=nnx.Rngs(0), epsilon=1e-5)
    layer = te_nnx.LayerNormDenseGeneral(*bound.args, **bound.kwargs)
    assert layer.epsilon == 1e-5 and layer.features == 4
    with pytest.raises(TypeError, match="unknown attributes"):
        te_nnx.LayerNormDenseGeneral(8, 4, rngs=nnx.Rngs(0), epsilom=1e-5)


def _annotations(part):
    return {
        name: kind
        for cls in reversed(part.__mro__)
        for name, kind in vars(cls).get("__annotations__", {}).items()
    }


def test_shared_parts_are_whole_in_every_layer_that_has_their_fields():
    """A part several layers share (the norm, LoRA) holds the methods; each layer declares the
    fields they read itself, where TransformerEngine's constructor of that layer has them. A
    layer has all of a part's fields exactly when it derives from the part (so it uses the
    part's methods, never a copy), each of the type the part reads, with one default in all."""
    from te_flax._layers import attention, base, linear, moe, relative_position, transformer

    descriptions = [
        linear.LayerNormDescription,
        linear.DenseGeneralDescription,
        linear.LayerNormDenseGeneralDescription,
        linear.LayerNormMLPDescription,
        moe.MoEBlockDescription,
        attention.DotProductAttentionDescription,
        attention.MultiHeadAttentionDescription,
        relative_position.RelativePositionBiasesDescription,
        transformer.TransformerLayerDescription,
    ]
    expected = {
        base.Norm: {
            "LayerNormDescription",
            "LayerNormDenseGeneralDescription",
            "LayerNormMLPDescription",
            "MoEBlockDescription",
        },
        base.FusedNorm: {
            "LayerNormDenseGeneralDescription",
            "LayerNormMLPDescription",
            "MoEBlockDescription",
        },
        base.LowRank: {
            "DenseGeneralDescription",
            "LayerNormDenseGeneralDescription",
            "LayerNormMLPDescription",
        },
    }
    for part, layers in expected.items():
        annotations = _annotations(part)
        assert annotations and not dataclasses.is_dataclass(part), part
        having = set()
        for description in descriptions:
            fields = {field.name: field for field in dataclasses.fields(description)}
            if annotations.keys() <= fields.keys():
                having.add(description.__name__)
                for name, kind in annotations.items():
                    assert fields[name].type == kind, (description.__name__, name)
            assert (description.__name__ in having) == issubclass(description, part), (
                description.__name__,
                part,
            )
        assert having == layers, part
        for name in annotations:
            defaults = [
                field.default
                for description in descriptions
                if issubclass(description, part)
                for field in dataclasses.fields(description)
                if field.name == name
            ]
            assert all(d == defaults[0] for d in defaults), (part, name, defaults)


def test_fp8_state_per_expert_from_the_description():
    from te_flax.quantize import DelayedScaling

    moe = te_nnx.MoEBlock(
        8, num_experts=4, intermediate_dim=16, recipe=DelayedScaling(amax_history_len=3),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    assert moe.fp8_groups == 4
    assert moe.x_0_amax_history[...].shape == (4, 3)
    dense = te_nnx.DenseGeneral(8, 4, recipe=DelayedScaling(amax_history_len=3), rngs=nnx.Rngs(0))
    assert dense.fp8_groups is None and dense.x_amax_history[...].shape == (3,)


def test_the_type_checkers_stub_is_written_from_the_descriptions():
    # te_flax/nnx/__init__.pyi spells the constructors out for mypy and IDEs (which read source,
    # not run-time signatures); tests/typing/nnx_constructors.py, type-checked with the library,
    # shows that a misspelt or mistyped option is an error there.
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "nnx_stub"
    completed = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
