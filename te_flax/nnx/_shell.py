"""What every te_flax NNX module does: build its parameters, FP8 state and sublayers, and run its
layer description through a host."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax import Array
from jax.typing import DTypeLike

from te_flax._base.checks import check_dtype, check_sizes
from te_flax._layers.base import ParamRecord, Params
from te_flax._layers.composite import DropoutDescription
from te_flax._layers.fp8_state import merge_reuse, watch_fp8_state
from te_flax._layers.fp8_stats import inspected
from te_flax._layers.host import Child, Host, Layer, description_among
from te_flax._layers.kv_cache import CacheSlots
from te_flax.nnx._fp8_meta import NnxStats, create_fp8_variables, fp8_variables, sr_key
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.state import SR_RNG, needs_sr_key, quantizer_set, resolve_recipe

__all__ = [
    "NnxHost",
    "NnxShell",
    "build_children",
    "create_param",
    "logical_param",
    "set_attributes",
]


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


def _signature(cls: type, description: type) -> None:
    """Gives an NNX module's constructor, which takes the description's attributes as
    ``**attributes``, a signature (``inspect.signature``, ``help()``) that lists each of them
    instead: a keyword-only parameter with the description's type and default, after the sizes
    and ``rngs``."""
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


# The NNX module of each layer description, registered as the modules are defined; a composite
# layer's constructor builds its sublayers from it (``build_children``).
_MODULES: dict[type, Callable[..., nnx.Module]] = {}


class NnxShell(nnx.Module):
    """Base of te_flax's NNX modules: a layer description run as an NNX module.

    A module class names its description among its bases (``class DenseGeneral(NnxShell,
    DenseGeneralDescription)``): the description's fields are the module's (static) attributes
    and its ``__call__`` is the module's. The shell builds the variables and sublayers in the
    constructor and gives ``__call__`` its ``host`` (``te_flax._layers.host``).
    """

    description: ClassVar[type[Layer]]  # the layer this module runs

    if TYPE_CHECKING:  # supplied by the layer description
        param_dtype: DTypeLike
        recipe: Recipe | None
        fp8_postfixes: tuple[str, ...]

        @property
        def fp8_groups(self) -> int | None: ...

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        description = description_among(cls.__bases__, nnx.Module)
        if description is not None:  # a te_flax layer (not a user's subclass of one)
            cls.description = description
            _MODULES[description] = cls
            _signature(cls, description)

    def host(self, children: Mapping[str, Child] | None = None) -> Host:
        """This call's host; ``children`` (the description's for the call's inputs) are
        checked against the sublayers the module was built with."""
        return NnxHost(self, children or {})

    def _setup(
        self, in_features: tuple[int, ...], rngs: nnx.Rngs, attributes: Mapping[str, Any]
    ) -> None:
        """A leaf layer's constructor: its attributes, parameters and FP8 state."""
        set_attributes(self, self.description, attributes, rngs)
        self.in_features_ = check_sizes(in_features, "in_features")
        check_dtype(self.param_dtype, "param_dtype")
        for record in cast(Any, self).param_records(self.in_features_):
            setattr(self, record.name, create_param(record, rngs, self.param_dtype))
        recipe = resolve_recipe(self.recipe) if hasattr(self, "recipe") else None
        for postfix in self.fp8_postfixes:
            create_fp8_variables(self, recipe, postfix, self.fp8_groups)
        # Stochastic rounding draws a key per call from its own stream ("sr_rng", else default).
        self.sr_rngs = rngs[SR_RNG].fork() if needs_sr_key(recipe) else None


def build_children(module: nnx.Module, children: Mapping[str, Child], rngs: nnx.Rngs) -> None:
    """A composite layer's constructor: each sublayer built as the attribute of its name (the
    input sizes it was built for kept, for the host to check each call against)."""
    for name, child in children.items():
        # nnx.data: a sublayer may take the place of a static attribute of its name (TE names
        # TransformerLayer's output norm after its switch, ``output_layernorm``).
        setattr(module, name, nnx.data(_build(child, rngs)))
    sizes = tuple((name, child.in_features) for name, child in children.items())
    module._input_sizes = sizes  # type: ignore[attr-defined]


def _build(child: Child, rngs: nnx.Rngs) -> nnx.Module:
    kind, attributes, in_features = child
    if kind is DropoutDescription:  # a stream only where it draws: rate 0 needs no "dropout" stream
        return nnx.Dropout(**attributes, rngs=rngs if attributes["rate"] > 0 else None)
    module = _MODULES[kind]
    if in_features is None:
        return module(**attributes, rngs=rngs)
    if isinstance(in_features, tuple):  # a cross-attention: the (query, key/value) sizes
        query_features, kv_features = in_features
        return module(query_features, in_kv_features=kv_features, **attributes, rngs=rngs)
    return module(in_features, **attributes, rngs=rngs)


class _Slot:
    """An ``nnx.Cache`` seen through ``.value``, as a Linen variable is."""

    def __init__(self, variable: nnx.Cache[Array]):
        self.variable = variable

    @property
    def value(self) -> Array:
        return self.variable.get_value()

    @value.setter
    def value(self, new: Array) -> None:
        self.variable.set_value(new)


class NnxHost:
    """An NNX module's ``Host``: its variables, the sublayers built with it, the RNG stream it
    forked when built, its decoding cache (``init_cache``)."""

    def __init__(self, module: Any, children: Mapping[str, Child]):
        self.module = module  # an NnxShell subclass with its description's attributes
        built = dict(getattr(module, "_input_sizes", ()))
        for name, child in children.items():
            if name not in built:
                raise ValueError(
                    f"{type(module).__name__} was built without the sublayer {name!r} that this "
                    f"call needs (it has {sorted(built)}); build it for this call's inputs"
                )
            if child.in_features is not None and built[name] != child.in_features:
                raise ValueError(
                    f"{type(module).__name__} was built for inputs of {built[name]} features "
                    f"(its sublayer {name!r}) but this call's inputs have {child.in_features}; "
                    "build it with in_features (and in_kv_features or encoded_features for a "
                    "second input) set to the sizes of the inputs it is called with, or reshape "
                    "the input"
                )

    @contextlib.contextmanager
    def variables(self, inputs: Array) -> Iterator[tuple[Params, tuple[QuantizerSet, ...]]]:
        """The layer's parameters and one quantizer set per GEMM, for the block: a reused
        FP8 state merged by max, and inside ``te_flax.inspect_fp8()`` the statistics the
        block's ops report written to the module's variables when it ends
        (``fp8_stats.inspected``)."""
        module = self.module
        if tuple(module.in_features(inputs)) != module.in_features_:
            raise ValueError(
                f"{type(module).__name__} was built for input features {module.in_features_} but "
                f"got an input of shape {inputs.shape}; its contracted (last) axes must match: "
                "build it with in_features set to those sizes, or reshape the input"
            )
        params = {
            record.name: getattr(module, record.name)[...]
            for record in module.param_records(module.in_features_)
        }
        recipe = resolve_recipe(module.recipe) if module.fp8_postfixes else None
        states = {
            postfix: fp8_variables(module, recipe, postfix, module.fp8_groups)
            for postfix in module.fp8_postfixes
        }
        states = merge_reuse(states)  # a layer applied twice merges by max
        params, states = watch_fp8_state(type(module).__name__, "nnx", params, states)
        sets = tuple(
            quantizer_set(recipe, postfix, states.get(postfix, {}), sr_key(module, recipe))
            for postfix in module.fp8_postfixes
        )
        stats = NnxStats(module)
        with inspected(sets, module.fp8_postfixes, module.fp8_groups, stats) as inspected_sets:
            yield params, inspected_sets

    def param(self, record: ParamRecord) -> Array:
        return cast(Array, getattr(self.module, record.name)[...])

    def layer(self, name: str) -> Any:
        return getattr(self.module, name)

    def rng(self, stream: str) -> Array:
        """A key from the stream the module forked when built (its dropout's, ``stream``)."""
        rngs = self.module.dropout_rngs
        if rngs is None:
            raise ValueError(
                f"{type(self.module).__name__} draws from the {stream!r} RNG stream but was built "
                "without it; build it with rngs that have that stream and the dropout rate it "
                "is called with"
            )
        key: Array = rngs()
        return key

    def cache(self, shape: tuple[int, ...], dtype: Any) -> tuple[CacheSlots, bool]:
        module = self.module
        if getattr(module, "cached_key", None) is None:
            raise ValueError(
                f"{type(module).__name__} has no decoding cache: call "
                "init_cache(batch_size, max_length) before applying it with decode=True"
            )
        cached = module.cached_key.get_value()
        if cached.dtype != dtype:
            raise TypeError(
                f"the decoding cache holds {cached.dtype} but the keys are {jnp.dtype(dtype)}; "
                "call init_cache with dtype= the compute dtype"
            )
        slots = (module.cached_key, module.cached_value, module.cache_index)
        return CacheSlots(*(_Slot(variable) for variable in slots)), False

    def fp8_state(self, recipe: Recipe, postfix: str) -> dict[str, Array]:
        return fp8_variables(self.module, recipe, postfix)

    def sow(self, name: str, value: Array) -> None:
        """Writes ``value`` into the module's ``nnx.Intermediate`` ``name`` (made when built)."""
        getattr(self.module, name)[...] = value
