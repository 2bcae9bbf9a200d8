"""What every te_flax Linen module does: create its parameters and FP8 state, call the layer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from te_flax._base.checks import check_dtype
from te_flax._layers.base import ParamRecord, Params
from te_flax._layers.fp8_state import merge_reuse, watch_fp8_state
from te_flax._layers.fp8_stats import Statistics, inspected
from te_flax.linen._base import TransformerEngineBase, fp8_variables
from te_flax.quantize import QuantizerSet
from te_flax.quantize.inspection import STATS_COLLECTION
from te_flax.quantize.state import SR_RNG, needs_sr_key, quantizer_set, resolve_recipe

__all__ = ["LinenShell", "LogicallyPartitioned", "create_param"]


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


class LinenShell(TransformerEngineBase):
    """Base of the Linen modules; the layer description supplies attributes and ``forward``.

    Built on ``TransformerEngineBase`` as TransformerEngine's modules are: the layers' FP8 state
    and a subclass's ``generate_quantizer_set`` are the same variables."""

    @contextlib.contextmanager
    def _variables(self, inputs: Array) -> Iterator[tuple[Params, tuple[QuantizerSet, ...]]]:
        """The layer's parameters and one quantizer set per GEMM, for its ``forward`` in the
        block: the parameters and FP8 state created on first use, a reused state merged by
        max, and inside ``te_flax.inspect_fp8()`` the statistics the block's ops report
        written to the module's variables when it ends (``fp8_stats.inspected``)."""
        records = self.param_records(self.in_features(inputs))
        params = {record.name: self._param(record) for record in records}
        recipe = resolve_recipe(self.recipe) if self.fp8_postfixes else None
        states = {
            postfix: fp8_variables(self, recipe, postfix, n_groups=self.fp8_groups)
            for postfix in self.fp8_postfixes
        }
        states = merge_reuse(states)  # a layer applied twice merges by max
        params, states = watch_fp8_state(type(self).__name__, "linen", params, states)
        sets = tuple(
            quantizer_set(
                recipe,
                postfix,
                states.get(postfix, {}),
                self.make_rng(SR_RNG) if needs_sr_key(recipe) else None,
            )
            for postfix in self.fp8_postfixes
        )
        stats = _LinenStats(self)
        with inspected(sets, self.fp8_postfixes, self.fp8_groups, stats) as inspected_sets:
            yield params, inspected_sets

    def _param(self, record: ParamRecord) -> Array:
        if self.has_variable("params", record.name):
            existing = jnp.shape(nn.meta.unbox(self.get_variable("params", record.name)))
            if existing != record.shape:
                raise ValueError(
                    f"{type(self).__name__} parameter {record.name!r} has shape {existing}, but "
                    f"this input needs {record.shape}: the input's feature size differs from the "
                    "one the module was initialised with; initialise it again with an input of "
                    "this shape, or reshape the input"
                )
        check_dtype(self.param_dtype, "param_dtype")
        return create_param(self, record, self.param_dtype)


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
