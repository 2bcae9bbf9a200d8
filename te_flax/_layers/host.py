"""The one protocol of every layer: a description's ``__call__`` runs inside a front end's host.

A layer is one description class (``te_flax._layers.linear``, ``attention``, ``moe``,
``transformer``...): its attributes (TransformerEngine's names and defaults, as dataclass fields),
its parameters (``param_records``) or sublayers (``children``), and its ``__call__``, with
TransformerEngine's call signature, which computes the layer. A front end's module is the
description plus a shell (``te_flax.linen._shell.LinenShell``, ``te_flax.nnx._shell.NnxShell``)
whose one job is ``host(children)``: the ``Host`` through which ``__call__`` reaches what a
framework owns, the same way for leaf layers and for layers made of other layers:

- ``variables(x)``: the layer's own parameters and one quantizer set per GEMM, for the block
  (FP8 state created on first use, merged when reused, statistics written when it ends);
- ``layer(name)``: a sublayer, the front end's module for the description type ``children``
  names;
- ``param(record)``, ``rng(stream)``, ``cache(shape, dtype)``, ``fp8_state(recipe, postfix)``,
  ``sow(name, value)``: one parameter, an RNG key, the decoding cache, an FP8 state's arrays,
  a value the layer reports (MoE's routing statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from jax import Array

from te_flax._layers.base import ParamRecord, Params
from te_flax._layers.kv_cache import CacheSlots
from te_flax.quantize import QuantizerSet, Recipe

__all__ = ["Child", "Host", "Layer", "description_among"]


class Child(NamedTuple):
    """A sublayer: its description type, attributes and input size.

    ``in_features`` is the NNX constructor's input size (``(query, key/value)`` sizes for a
    cross-attention); Linen reads it from the input.
    """

    kind: type
    attributes: dict[str, Any]
    in_features: int | tuple[int, int] | None = None


class Host(Protocol):
    """What a front end gives a layer's ``__call__``: its variables, sublayers, RNG keys,
    decoding cache and FP8 state."""

    def variables(
        self, inputs: Array
    ) -> AbstractContextManager[tuple[Params, tuple[QuantizerSet, ...]]]:
        """The layer's parameters (its ``param_records`` for ``inputs``) and one quantizer set
        per ``fp8_postfixes`` entry, for the ``with`` block; inside ``te_flax.inspect_fp8()``
        the statistics the block's ops report are written when it ends."""
        ...

    def layer(self, name: str) -> Callable[..., Any]: ...

    def rng(self, stream: str) -> Array: ...

    def param(self, record: ParamRecord) -> Array:
        """The module's own parameter ``record.name`` (created from ``record`` where needed)."""
        ...

    def cache(self, shape: tuple[int, ...], dtype: Any) -> tuple[CacheSlots, bool]:
        """The cache slots, and whether they were created by this call (nothing cached yet)."""
        ...

    def fp8_state(self, recipe: Recipe, postfix: str) -> dict[str, Array]:
        """One GEMM's delayed-scaling state kept by the module (empty when the recipe keeps
        none)."""
        ...

    def sow(self, name: str, value: Array) -> None:
        """Reports ``value`` as the module's intermediate ``name``."""
        ...


class Layer:
    """Base of the layer descriptions: ``host`` is what a front end's shell supplies.

    A description on its own holds attributes and computes from given arrays (``forward``);
    its ``__call__`` runs only as a module of ``te_flax.linen`` or ``te_flax.nnx``.
    """

    def host(self, children: Mapping[str, Child] | None = None) -> Host:
        raise TypeError(
            f"{type(self).__name__} is a layer description, not a module: use the module of "
            "te_flax.linen or te_flax.nnx of that name"
        )


def description_among(bases: tuple[type, ...], module: type) -> type[Layer] | None:
    """The layer description a front end's module class names among its ``bases`` (the one
    that is not itself a ``module``), or None (a user's subclass of a te_flax module)."""
    return next(
        (base for base in bases if issubclass(base, Layer) and not issubclass(base, module)),
        None,
    )
