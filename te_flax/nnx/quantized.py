"""FP8 for NNX models written with Flax's own layers: a ``dot_general`` and an ``einsum_op``.

``nnx.Linear(..., dot_general=te_flax.nnx.DotGeneral(recipe))`` and
``nnx.Einsum(..., einsum_op=te_flax.nnx.EinsumOp(recipe))`` run the layer's product as
te_flax's ``dense`` (the quantizers, FP8 state and max-merge rule of te_flax's layers); the
FP8 state is ``Fp8Meta`` variables of the ``DotGeneral`` / ``EinsumOp`` module, a child of the
layer, so ``nnx.state``, ``nnx.split``, optimizers and checkpoints see it. Train with
``te_flax.nnx.value_and_grad(..., update_fp8_state=True)`` or ``te_flax.nnx.train_step``.

``quantize_model`` reaches an NNX model's layers by graph surgery: ``hook_layers`` points each
``nnx.Linear`` / ``nnx.LinearGeneral``'s ``dot_general`` and ``nnx.Einsum``'s ``einsum_op`` at
a function that hands the product to a session, with the FP8 state as ``Fp8Meta`` variables
of the layer itself (and, for the fallback for bare products, makes each module's
``__call__`` known to the session).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from flax import nnx
from jax import Array

from te_flax._layers.base import named_sets
from te_flax._quantize_model.products import (
    Frame,
    Selection,
    Session,
    bare_fallback,
    layer_product,
    note_once,
    original,
    plan_product,
    postfix,
    run_plan,
    running,
)
from te_flax.nnx._fp8_meta import Fp8Meta, fp8_variables, sr_key
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.recipes import check_recipe
from te_flax.quantize.state import SR_RNG, fresh_state, needs_sr_key, quantizer_set, resolve_recipe

__all__ = [
    "DotGeneral",
    "EinsumOp",
    "add_fp8_state",
    "discovering",
    "hook_layers",
    "owner_quantizer_set",
]


def add_fp8_state(module: nnx.Module, recipe: Recipe | None, postfix: str) -> None:
    """Creates one GEMM's FP8 state (``Fp8Meta`` variables) on ``module``."""
    for name, value in fresh_state(recipe, postfix).items():
        setattr(module, name, Fp8Meta(value))


def owner_quantizer_set(
    module: nnx.Module,
    recipe: Recipe | None,
    postfix: str,
    checkpoint_name: str | None = None,
) -> QuantizerSet:
    """The quantizer set of one GEMM whose FP8 state is ``Fp8Meta`` variables of ``module``.

    Stochastic rounding draws its key from the module's ``sr_rngs`` stream."""
    state = fp8_variables(module, recipe, postfix)
    key = sr_key(module, recipe)
    (qs,) = named_sets([quantizer_set(recipe, postfix, state, key)], checkpoint_name)
    return qs


class _Product(nnx.Module):
    """One product's FP8 state and recipe; the subclasses give the call signature."""

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        quantization_checkpoint_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        if recipe is not None:
            check_recipe(recipe, f"{type(self).__name__}(recipe=)")
        self.recipe = resolve_recipe(recipe)
        self.quantization_checkpoint_name = quantization_checkpoint_name
        add_fp8_state(self, self.recipe, "")
        # Stochastic rounding (NVFP4) draws a key per call from its own stream.
        self.sr_rngs = (rngs or nnx.Rngs(0))[SR_RNG].fork() if needs_sr_key(self.recipe) else None

    def _run(
        self,
        op: str,
        lhs: Array,
        rhs: Array,
        spec: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Array:
        del precision, out_sharding  # the recipe sets the precision; the layer, the sharding
        plan = plan_product(op, lhs, rhs, spec)
        if isinstance(plan, str):
            raise ValueError(
                f"{type(self).__name__} runs a product as te_flax's dense, but this one cannot: "
                f"{plan} (operands {lhs.shape} and {rhs.shape}, {spec!r}); use it only on "
                "layers that contract an input with a kernel without batch dimensions, or "
                "leave this layer in high precision"
            )
        qs = owner_quantizer_set(self, self.recipe, "", self.quantization_checkpoint_name)
        return run_plan(plan, lhs, rhs, qs, preferred_element_type)


class DotGeneral(_Product):
    """A ``dot_general`` for ``nnx.Linear`` / ``nnx.LinearGeneral`` that runs in FP8.

    Args:
      recipe: the recipe (None: the active ``te_flax.autocast`` one when built, else no FP8).
      quantization_checkpoint_name: the ``jax.checkpoint`` name of the quantized operands the
        GEMM saves for its backward (default None).
      rngs: the ``"sr_rng"`` stream for NVFP4's stochastic rounding (default ``nnx.Rngs(0)``).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax.nnx as te_nnx
      >>> from te_flax.quantize import DelayedScaling
      >>> layer = nnx.Linear(32, 16, dot_general=te_nnx.DotGeneral(DelayedScaling()),
      ...                    rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32))).shape
      (4, 16)
      >>> sorted(nnx.state(layer, te_nnx.Fp8Meta)["dot_general"])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """

    def __call__(
        self, lhs: Array, rhs: Array, dimension_numbers: Any, *args: Any, **kwargs: Any
    ) -> Array:
        """``lax.dot_general(lhs, rhs, dimension_numbers, precision=None,
        preferred_element_type=None, out_sharding=None)`` in FP8."""
        return self._run("dot_general", lhs, rhs, dimension_numbers, *args, **kwargs)


class EinsumOp(_Product):
    """An ``einsum_op`` for ``nnx.Einsum`` that runs its two-operand product in FP8.

    Takes the arguments of ``DotGeneral``; called as ``jnp.einsum(subscripts, x, kernel,
    precision=None, preferred_element_type=None)``.
    """

    def __call__(self, subscripts: str, lhs: Array, rhs: Array, *args: Any, **kwargs: Any) -> Array:
        """``jnp.einsum(subscripts, lhs, rhs, precision=None, preferred_element_type=None,
        out_sharding=None)`` in FP8."""
        return self._run("einsum", lhs, rhs, subscripts, *args, **kwargs)


# ----------------------------------------------------------------------------- quantize_model

# The session of quantize_model's own trace of a model (None: the model's real calls).
_DISCOVERY: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "quantize_model_discovery", default=None
)


@contextlib.contextmanager
def discovering(session: Session) -> Iterator[None]:
    """Runs the block with every hooked module's products handed to ``session``."""
    token = _DISCOVERY.set(session)
    try:
        yield
    finally:
        _DISCOVERY.reset(token)


def _layer_quantizer_set(module: Any, recipe: Recipe, index: int) -> QuantizerSet | None:
    """The quantizer set of ``module``'s ``index``-th product (None: its state was not made)."""
    if index >= getattr(module, "_te_flax_products", 0):
        note_once(
            (module._te_flax_path, index),
            f"{module._te_flax_path}: a product that quantize_model's example inputs did not "
            "reach runs in high precision (its FP8 state was not created); quantize the model "
            "with inputs that take every branch",
        )
        return None
    return owner_quantizer_set(module, recipe, postfix(index))


def _frame(module: Any, bare_offset: int = 0) -> Frame:
    session = _DISCOVERY.get() or Session(module._te_flax_selection)
    quantizers = functools.partial(_layer_quantizer_set, module)
    return Frame(module, module._te_flax_path, session, quantizers, bare_offset)


def _product_attribute(module: nnx.Module) -> str | None:
    """The attribute through which a stock layer calls its product (None: none to take, e.g.
    one the user set already)."""
    if isinstance(module, nnx.Linear) and module.dot_general is original("dot_general"):
        return "dot_general"
    if isinstance(module, nnx.LinearGeneral):
        default = module.dot_general is None and module.dot_general_cls is None
        return "dot_general" if default else None
    if isinstance(module, nnx.Einsum) and module.einsum_op is original("einsum"):
        return "einsum_op"
    return None


def _layer_product(module: Any, attribute: str, *args: Any, **kwargs: Any) -> Any:
    op = "einsum" if attribute == "einsum_op" else "dot_general"
    function = vars(module)[attribute]  # LinearGeneral's None: lax.dot_general
    if function not in (None, original(op)):  # one the user set after quantize_model
        return function(*args, **kwargs)
    return layer_product(_frame(module), op, function, *args, **kwargs)


_CLASSES: dict[tuple[type, str | None, bool], type] = {}


def _hooked_class(cls: type, attribute: str | None, bare: bool) -> type:
    """``cls`` whose ``attribute`` (its product function) hands the product to a session, and,
    with ``bare``, whose ``__call__`` makes the module the owner of the bare products it calls
    (the fallback: JAX's product functions replaced while it runs)."""
    if (cls, attribute, bare) in _CLASSES:
        return _CLASSES[cls, attribute, bare]
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if attribute is not None:

        def get(self: Any) -> Callable[..., Any]:
            return functools.partial(_layer_product, self, attribute)

        def set_(self: Any, value: Any) -> None:
            vars(self)[attribute] = value  # the layer's own value stays in its graph

        namespace[attribute] = property(get, set_)
    if bare:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            with running(_frame(self, int(attribute is not None))), bare_fallback():
                return cls.__call__(self, *args, **kwargs)

        namespace["__call__"] = __call__
    _CLASSES[cls, attribute, bare] = type(cls.__name__, (cls,), namespace)
    return _CLASSES[cls, attribute, bare]


def hook_layers(model: nnx.Module, selection: Selection) -> dict[str, nnx.Module]:
    """Points each stock layer's product of ``model`` (and, with ``selection.bare_products``,
    each module's ``__call__``) at quantize_model's session; the hooked modules by path.

    The layers keep their parameters and their own product function (in their graph); their
    class becomes a subclass of the same name that reads it through the session."""
    hooked = {}
    module: Any
    for keys, module in nnx.iter_modules(model):
        attribute = _product_attribute(module)
        if type(module).__module__.startswith("te_flax."):
            continue  # te_flax's own layers run their products themselves
        if attribute is None and not selection.bare_products:
            continue
        module._te_flax_path = "/".join(str(key) for key in keys)
        module._te_flax_selection = selection
        module.__class__ = _hooked_class(type(module), attribute, selection.bare_products)
        hooked[module._te_flax_path] = module
    return hooked
