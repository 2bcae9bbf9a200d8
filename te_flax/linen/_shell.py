"""What every te_flax Linen module does: run its layer description, through a host that creates
its parameters, FP8 state and sublayers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from te_flax._base.checks import check_dtype
from te_flax._layers.base import ParamRecord, Params
from te_flax._layers.composite import DropoutDescription
from te_flax._layers.fp8_state import merge_reuse, watch_fp8_state
from te_flax._layers.fp8_stats import Statistics, inspected
from te_flax._layers.host import Child, Host, Layer, description_among
from te_flax._layers.kv_cache import CacheSlots
from te_flax.linen._base import fp8_variables
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.inspection import STATS_COLLECTION
from te_flax.quantize.state import SR_RNG, needs_sr_key, quantizer_set, resolve_recipe

__all__ = ["LinenHost", "LinenShell", "LogicallyPartitioned", "create_param"]


class LogicallyPartitioned(nn.LogicallyPartitioned):
    """A parameter's logical axis names, kept as metadata when bridged to NNX.

    ``nnx.bridge.ToNNX`` turns the names into an ``nnx.Param``'s ``out_sharding``; te_flax's
    own NNX modules keep theirs without eager placement (``jit`` places the arrays by their
    partition specs), so that a module builds with or without a mesh. Bridged modules do the
    same.
    """

    def to_nnx_metadata(self) -> dict[str, Any]:
        return {**super().to_nnx_metadata(), "eager_sharding": False}


def create_param(module: nn.Module, record: ParamRecord, dtype: Any) -> Array:
    """The parameter ``record.name`` of ``module`` (created from ``record`` with its logical axes
    on first use), read as a plain array: Linen unboxes ``LogicallyPartitioned`` values."""

    def init(*args: Any) -> LogicallyPartitioned:
        return LogicallyPartitioned(record.init(*args), names=record.axes)

    return cast(Array, module.param(record.name, init, record.shape, dtype))


# The Linen module of each layer description, registered as the modules are defined; a
# composite layer's host builds its sublayers from it (Flax's own module for dropout).
_MODULES: dict[type, type[nn.Module]] = {DropoutDescription: nn.Dropout}


class LinenShell(nn.Module):
    """Base of te_flax's Linen modules: a layer description run as a Linen module.

    A module class names its description among its bases (``class DenseGeneral(LinenShell,
    TransformerEngineBase, DenseGeneralDescription)``): the description's fields are the
    module's attributes and its ``__call__``, run in Linen's compact scope, is the module's.
    The shell's one job is ``host``, through which that ``__call__`` creates and reads the
    module's variables and sublayers (``te_flax._layers.host``).
    """

    description: ClassVar[type[Layer]]  # the layer this module runs

    def __init_subclass__(cls, **kwargs: Any) -> None:
        description = description_among(cls.__bases__, nn.Module)
        if description is not None:  # a te_flax layer (not a user's subclass of one)
            cls.description = description
            _MODULES[description] = cls
            if "__call__" not in cls.__dict__:
                # The description's call, marked for Linen's compact scope; Flax wraps it.
                cls.__call__ = nn.compact(description.__call__)  # type: ignore[method-assign]
        super().__init_subclass__(**kwargs)

    @nn.nowrap
    def host(self, children: Mapping[str, Child] | None = None) -> Host:
        """This call's host: ``children`` (the description's ``children(...)`` for the call's
        inputs) are built as sublayers on first use."""
        return LinenHost(self, children or {})


class LinenHost:
    """A Linen module's ``Host``, made inside its compact ``__call__``."""

    def __init__(self, module: Any, children: Mapping[str, Child]):
        self.module = module  # a LinenShell subclass with its description's attributes
        self.children = children
        self.built: dict[str, Any] = {}

    @contextlib.contextmanager
    def variables(self, inputs: Array) -> Iterator[tuple[Params, tuple[QuantizerSet, ...]]]:
        """The layer's parameters and FP8 state created on first use, a reused state merged by
        max, and inside ``te_flax.inspect_fp8()`` the statistics the block's ops report written
        to the module's variables when it ends (``fp8_stats.inspected``)."""
        module = self.module
        records = module.param_records(module.in_features(inputs))
        params = {record.name: self.param(record) for record in records}
        recipe = resolve_recipe(module.recipe) if module.fp8_postfixes else None
        states = {
            postfix: fp8_variables(module, recipe, postfix, n_groups=module.fp8_groups)
            for postfix in module.fp8_postfixes
        }
        states = merge_reuse(states)  # a layer applied twice merges by max
        params, states = watch_fp8_state(type(module).__name__, "linen", params, states)
        sets = tuple(
            quantizer_set(
                recipe,
                postfix,
                states.get(postfix, {}),
                module.make_rng(SR_RNG) if needs_sr_key(recipe) else None,
            )
            for postfix in module.fp8_postfixes
        )
        stats = _LinenStats(module)
        with inspected(sets, module.fp8_postfixes, module.fp8_groups, stats) as inspected_sets:
            yield params, inspected_sets

    def param(self, record: ParamRecord) -> Array:
        module = self.module
        if module.has_variable("params", record.name):
            existing = jnp.shape(nn.meta.unbox(module.get_variable("params", record.name)))
            if existing != record.shape:
                raise ValueError(
                    f"{type(module).__name__} parameter {record.name!r} has shape {existing}, "
                    f"but this input needs {record.shape}: the input's feature size differs from "
                    "the one the module was initialised with; initialise it again with an input "
                    "of this shape, or reshape the input"
                )
        dtype = getattr(module, "param_dtype", jnp.float32)
        check_dtype(dtype, "param_dtype")
        return create_param(module, record, dtype)

    def layer(self, name: str) -> Any:
        if name not in self.built:
            kind, attributes, _ = self.children[name]
            self.built[name] = _MODULES[kind](**attributes, name=name)
        return self.built[name]

    def rng(self, stream: str) -> Array:
        return self.module.make_rng(stream)

    def cache(self, shape: tuple[int, ...], dtype: Any) -> tuple[CacheSlots, bool]:
        module = self.module
        created = not module.has_variable("cache", "cached_key")
        key = module.variable("cache", "cached_key", jnp.zeros, shape, dtype)
        value = module.variable("cache", "cached_value", jnp.zeros, shape, dtype)
        index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        return CacheSlots(key, value, index), created

    def fp8_state(self, recipe: Recipe, postfix: str) -> dict[str, Array]:
        return fp8_variables(self.module, recipe, postfix)

    def sow(self, name: str, value: Array) -> None:
        self.module.sow("intermediates", name, value)


class _LinenStats:
    """A Linen module's statistics variables, in the ``fp8_stats`` collection: created and
    written only where the collection is mutable (``apply(..., mutable=["fp8_stats"])``,
    ``init``); read wherever they were passed in."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def read(self, name: str, fresh: Statistics) -> Statistics | None:
        module = self.module
        mutable = module.is_mutable_collection(STATS_COLLECTION)
        if module.has_variable(STATS_COLLECTION, name):
            stored: Statistics = module.get_variable(STATS_COLLECTION, name)
            if jax.tree.map(jnp.shape, stored) == jax.tree.map(jnp.shape, fresh):
                return stored
            if not mutable:
                raise ValueError(
                    f"{type(module).__name__}'s FP8 statistics variable {name!r} holds "
                    f"{sorted(stored)}, shaped for another recipe or number of groups than "
                    f"this call's {sorted(fresh)}; make new ones for this model with "
                    "te_flax.training.fp8_stats_slots, or apply with "
                    f"mutable=[{STATS_COLLECTION!r}] once"
                )
        elif not mutable:
            return None
        module.put_variable(STATS_COLLECTION, name, fresh)
        return fresh

    def write(self, name: str, value: Statistics) -> None:
        if self.module.is_mutable_collection(STATS_COLLECTION):
            self.module.put_variable(STATS_COLLECTION, name, value)
