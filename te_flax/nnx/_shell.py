"""What every te_flax NNX module does: hold its parameters and FP8 state, call the layer."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import flax.linen as nn
from flax import nnx
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.checks import check_dtype, check_sizes
from te_flax._layers.base import ParamRecord, Params
from te_flax._layers.fp8_state import merge_reuse, watch_fp8_state
from te_flax._layers.fp8_stats import inspected
from te_flax.nnx._fp8_meta import NnxStats, create_fp8_variables, fp8_variables, sr_key
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.state import SR_RNG, needs_sr_key, quantizer_set, resolve_recipe

__all__ = ["NnxShell", "create_param", "described_by", "logical_param", "set_attributes"]


def create_param(record: ParamRecord, rngs: nnx.Rngs, dtype: Any) -> nnx.Param[Array]:
    """The parameter ``record`` describes, drawn from ``rngs.params()``.

    Its logical axes are sharding metadata only: arrays are placed by jit with the partition
    specs, under the logical axis rules, as for Linen (no mesh is needed to build a module).
    """
    value = record.init(rngs.params(), record.shape, dtype)
    return logical_param(value, record.axes)


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


ModuleType = TypeVar("ModuleType", bound=type)


def described_by(description: type) -> Callable[[ModuleType], ModuleType]:
    """Class decorator of an NNX module built from the layer ``description``.

    The module's ``__init__`` takes the description's attributes as ``**attributes``; its
    signature (``inspect.signature``, ``help()``) lists each of them instead, a keyword-only
    parameter with the description's type and default, after the sizes and ``rngs``.
    """

    def decorate(cls: ModuleType) -> ModuleType:
        init = cls.__init__  # type: ignore[misc]
        # The annotations as types, not strings, so that documentation tools can link them.
        own = inspect.signature(init, eval_str=True)
        types = typing.get_type_hints(description)
        explicit = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        named = {p.name for p in explicit}
        options = [
            inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                annotation=types[field.name],
            )
            # In the description's order: TransformerEngine's, then te_flax's own.
            for field in dataclasses.fields(description)
            if field.name not in named
        ]  # fmt: skip
        signature = own.replace(parameters=explicit + options)
        without_self = signature.replace(parameters=[*signature.parameters.values()][1:])
        for owner, value in ((init, signature), (cls, without_self)):
            setattr(owner, "__signature__", value)  # noqa: B010
        setattr(cls, "_description", description)  # noqa: B010
        return cls

    return decorate


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

        @property
        def fp8_groups(self) -> int | None: ...

        def in_features(self, x: Array) -> tuple[int, ...]: ...

        def param_records(self, in_features: tuple[int, ...]) -> list[ParamRecord]: ...

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
        for record in self.param_records(self.in_features_):
            setattr(self, record.name, create_param(record, rngs, self.param_dtype))
        recipe = resolve_recipe(self.recipe) if hasattr(self, "recipe") else None
        for postfix in self.fp8_postfixes:
            create_fp8_variables(self, recipe, postfix, self.fp8_groups)
        # Stochastic rounding draws a key per call from its own stream ("sr_rng", else default).
        self.sr_rngs = rngs[SR_RNG].fork() if needs_sr_key(recipe) else None

    @contextlib.contextmanager
    def _variables(self, inputs: Array) -> Iterator[tuple[Params, tuple[QuantizerSet, ...]]]:
        """The layer's parameters and one quantizer set per GEMM, for its ``forward`` in the
        block: a reused FP8 state merged by max, and inside ``te_flax.inspect_fp8()`` the
        statistics the block's ops report written to the module's variables when it ends
        (``fp8_stats.inspected``)."""
        if tuple(self.in_features(inputs)) != self.in_features_:
            raise ValueError(
                f"{type(self).__name__} was built for input features {self.in_features_} but got "
                f"an input of shape {inputs.shape}; its contracted (last) axes must match: "
                "build it with in_features set to those sizes, or reshape the input"
            )
        params = {
            record.name: getattr(self, record.name)[...]
            for record in self.param_records(self.in_features_)
        }
        recipe = resolve_recipe(self.recipe) if self.fp8_postfixes else None
        states = {
            postfix: fp8_variables(self, recipe, postfix, self.fp8_groups)
            for postfix in self.fp8_postfixes
        }
        states = merge_reuse(states)  # a layer applied twice merges by max
        params, states = watch_fp8_state(type(self).__name__, "nnx", params, states)
        sets = tuple(
            quantizer_set(recipe, postfix, states.get(postfix, {}), sr_key(self, recipe))
            for postfix in self.fp8_postfixes
        )
        stats = NnxStats(self)
        with inspected(sets, self.fp8_postfixes, self.fp8_groups, stats) as inspected_sets:
            yield params, inspected_sets
