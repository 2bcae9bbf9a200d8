"""What every te_flax NNX module does: hold its parameters and FP8 state, call the layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.checks import check_dtype, check_sizes
from te_flax._layers.fp8_state import (
    SR_RNG,
    check_state_matches,
    fresh_state,
    merge_reuse,
    needs_sr_key,
    quantizer_set,
    resolve_recipe,
    state_names,
    watch_fp8_state,
)
from te_flax.nnx._fp8_meta import Fp8Meta
from te_flax.quantize import QuantizerSet, Recipe

if TYPE_CHECKING:
    from te_flax._layers.linear import ParamSpec

__all__ = ["NnxShell", "create_param", "logical_param", "set_attributes"]


def create_param(spec: ParamSpec, rngs: nnx.Rngs, dtype: Any) -> nnx.Param[Array]:
    """The parameter ``spec`` describes, drawn from ``rngs.params()``.

    Its logical axes are sharding metadata only: arrays are placed by jit with the partition
    specs, under the logical axis rules, as for Linen (no mesh is needed to build a module).
    """
    value = spec.init(rngs.params(), spec.shape, dtype)
    return logical_param(value, spec.axes)


def logical_param(value: Array, axes: Sequence[str | None]) -> nnx.Param[Array]:
    """An ``nnx.Param`` whose logical ``axes`` are sharding metadata (no eager sharding).

    Through ``nnx.bridge.to_linen`` it becomes a Linen ``LogicallyPartitioned`` box, so that
    ``nn.get_partition_spec`` of the Linen variables reads the same axes. Without that type
    the bridge drops ``eager_sharding=False`` and rebuilds the variable when asked for its
    partition spec, which Flax 0.12.12 refuses outside a mesh.
    """
    return nnx.Param(
        value,
        out_sharding=tuple(axes),
        eager_sharding=False,
        sharding_rules=None,
        linen_meta_type=nn.LogicallyPartitioned,
    )


def set_attributes(
    module: nnx.Module, description: type, attributes: Mapping[str, Any], rngs: object
) -> None:
    """Sets every field of the layer description on ``module``: given, else the default."""
    fields = {f.name: f for f in dataclasses.fields(description)}
    unknown = sorted(set(attributes) - set(fields))
    if unknown:
        raise TypeError(
            f"{type(module).__name__} got unknown attributes {unknown}; its attributes are "
            f"{sorted(fields)}"
        )
    for name, field in fields.items():
        setattr(module, name, attributes.get(name, field.default))
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, got {rngs!r}; e.g. rngs=nnx.Rngs(0)")


class NnxShell(nnx.Module):
    """Base of the NNX modules; the layer description supplies attributes and ``forward``.

    Subclasses also derive from one layer description (a dataclass of TE's attributes), whose
    fields become plain (static) attributes of the module.
    """

    _description: type  # the layer description class

    if TYPE_CHECKING:  # supplied by the layer description
        param_dtype: DTypeLike
        recipe: Recipe | None
        fp8_postfixes: tuple[str, ...]

        def in_features(self, x: Array) -> tuple[int, ...]: ...

        def param_specs(self, in_features: tuple[int, ...]) -> list[ParamSpec]: ...

        def forward(
            self,
            params: dict[str, Array],
            x: Array,
            quantizer_sets: Sequence[QuantizerSet] = (),
            dropout: Array | None = None,
        ) -> Any: ...

    def _setup(
        self, in_features: tuple[int, ...], rngs: nnx.Rngs, attributes: Mapping[str, Any]
    ) -> None:
        set_attributes(self, self._description, attributes, rngs)
        self.in_features_ = check_sizes(in_features, "in_features")
        check_dtype(self.param_dtype, "param_dtype")
        for spec in self.param_specs(self.in_features_):
            setattr(self, spec.name, create_param(spec, rngs, self.param_dtype))
        recipe = resolve_recipe(self.recipe) if hasattr(self, "recipe") else None
        for postfix in self.fp8_postfixes:
            for name, value in fresh_state(recipe, postfix).items():
                setattr(self, name, Fp8Meta(value))
        # Stochastic rounding draws a key per call from its own stream ("sr_rng", else default).
        self.sr_rngs = rngs[SR_RNG].fork() if needs_sr_key(recipe) else None

    def _run(self, inputs: Array, dropout_rng: Array | None = None) -> Any:
        if tuple(self.in_features(inputs)) != self.in_features_:
            raise ValueError(
                f"{type(self).__name__} was built for input features {self.in_features_} but got "
                f"an input of shape {inputs.shape}; its contracted (last) axes must match: "
                "build it with in_features set to those sizes, or reshape the input"
            )
        params = {
            spec.name: getattr(self, spec.name)[...] for spec in self.param_specs(self.in_features_)
        }
        recipe = resolve_recipe(self.recipe) if self.fp8_postfixes else None
        states = {postfix: self._fp8_state(recipe, postfix) for postfix in self.fp8_postfixes}
        states = merge_reuse(self, states)  # a layer applied twice merges by max
        params, states = watch_fp8_state(type(self).__name__, "nnx", params, states)
        sets = tuple(
            quantizer_set(recipe, postfix, states.get(postfix, {}), self._sr_key(recipe))
            for postfix in self.fp8_postfixes
        )
        return self.forward(params, inputs, sets, dropout_rng)

    def _fp8_state(self, recipe: Recipe | None, postfix: str) -> dict[str, Array]:
        fresh = fresh_state(recipe, postfix)
        names = state_names(postfix)
        present = {n for n in names if isinstance(getattr(self, n, None), Fp8Meta)}
        check_state_matches(type(self).__name__, recipe, set(fresh), present)
        state = {}
        for name, value in fresh.items():
            stored = getattr(self, name)[...]
            if jnp.shape(stored) != value.shape:
                raise ValueError(
                    f"{type(self).__name__} FP8 variable {name!r} has shape {jnp.shape(stored)} "
                    f"but the recipe {recipe} needs {value.shape}; build the module again "
                    "(amax_history_len changed)"
                )
            state[name] = stored
        return state

    def _sr_key(self, recipe: Recipe | None) -> Array | None:
        if not needs_sr_key(recipe):
            return None
        if self.sr_rngs is None:
            raise ValueError(
                f"{type(self).__name__} is applied with {recipe}, whose stochastic rounding "
                "needs an RNG stream, but it was built without that recipe; build it inside "
                "the same te_flax.autocast (or with recipe=), so that it keeps an 'sr_rng' "
                "stream from its rngs"
            )
        key: Array = self.sr_rngs()
        return key
