"""``quantize_model``: FP8 for a Linen or NNX model written with Flax's own layers.

One call makes a model's matrix products (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``,
``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, and ``jax.lax.dot_general``,
``jnp.einsum``, ``jnp.dot``, ``jnp.matmul`` called in module methods) run as te_flax FP8 GEMMs
(the ``dense`` op: te_flax's quantizers, FP8 state and max-merge rule). Each product's FP8 state
lives in the module that calls it: Linen variables in ``_overwrite_with_gradient``, NNX
``Fp8Meta`` variables. Rules choose products by module path and operation; by default
embeddings, the output head and MoE router gates stay in high precision.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from te_flax._layers.fp8_state import SR_RNG, fresh_state, needs_sr_key, quantizer_set
from te_flax._ops import products as _inject
from te_flax._ops.products import OPS, fp8_reason, plan_product, postfix, run_plan
from te_flax.linen._base import fp8_variables
from te_flax.nnx.inject import add_fp8_state, owner_quantizer_set
from te_flax.quantize import Recipe
from te_flax.quantize.recipes import check_recipe

__all__ = ["DEFAULT_RULES", "QuantizeModelNote", "QuantizeRule", "quantize_model"]


class QuantizeModelNote(UserWarning):
    """Products ``quantize_model`` leaves in high precision although a rule selects them."""


@dataclasses.dataclass(frozen=True)
class QuantizeRule:
    """Which products a rule selects, and whether they run in FP8.

    Attributes:
      module_path: a regular expression that the calling module's path must match in full;
        paths join attribute names (NNX) or module names (Linen) with ``/``, e.g.
        ``"blocks/0/mlp/up"`` or ``"Block_0/Dense_1"`` (default ``".*"``: every module).
      op_names: the operations selected, among ``"dot_general"`` (``nn.Dense``,
        ``nn.DenseGeneral``, ``nnx.Linear``, ``nnx.LinearGeneral``, ``lax.dot_general``),
        ``"einsum"`` (``nn.Einsum``, ``nnx.Einsum``, ``jnp.einsum``), ``"dot"``, ``"matmul"``
        (default None: all).
      quantize: True (default) runs the selected products in FP8, False keeps them as they are.
      recipe: the recipe of the selected products (default None: ``quantize_model``'s).
    """

    module_path: str = ".*"
    op_names: tuple[str, ...] | None = None
    quantize: bool = True
    recipe: Recipe | None = None

    def matches(self, path: str, op: str) -> bool:
        """Whether the rule selects the product ``op`` called by the module at ``path``."""
        ops_match = self.op_names is None or op in self.op_names
        return ops_match and re.fullmatch(self.module_path, path) is not None


# Names of embeddings, output heads and routers (a whole path component): kept in high precision.
_HIGH_PRECISION_NAMES = (
    r"\w*embed\w*|wte|wpe|lm_head|head|output|unembed\w*|logits?|router|gate|gating"
)
DEFAULT_RULES = (
    QuantizeRule(module_path=rf"(.*/)?({_HIGH_PRECISION_NAMES})(/.*)?", quantize=False),
    QuantizeRule(),
)


def _check_rules(rules: object) -> tuple[QuantizeRule, ...]:
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, QuantizeRule) or not isinstance(rules, Sequence):
        raise TypeError(
            f"rules must be a sequence of te_flax.QuantizeRule, got {rules!r}; e.g. "
            "rules=[te_flax.QuantizeRule(module_path='.*mlp.*')]"
        )
    for rule in rules:
        if not isinstance(rule, QuantizeRule):
            raise TypeError(f"rules must hold te_flax.QuantizeRule objects, got {rule!r}")
        try:
            re.compile(rule.module_path)
        except (re.error, TypeError) as error:
            raise ValueError(
                f"QuantizeRule.module_path {rule.module_path!r} is not a regular expression: "
                f"{error}"
            ) from error
        unknown = sorted(set(rule.op_names or ()) - set(OPS))
        if unknown or isinstance(rule.op_names, str):
            raise ValueError(
                f"QuantizeRule.op_names {rule.op_names!r} names unknown operations {unknown}; "
                f"use a tuple of {OPS}"
            )
        if rule.recipe is not None:
            check_recipe(rule.recipe, "QuantizeRule(recipe=)")
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: Recipe
    rules: tuple[QuantizeRule, ...]

    def recipe_for(self, path: str, op: str) -> Recipe | None:
        """The recipe of a product (None: high precision): the first rule that selects it."""
        for rule in self.rules:
            if rule.matches(path, op):
                return (rule.recipe or self.recipe) if rule.quantize else None
        return None


@dataclasses.dataclass
class _Record:
    op: str
    recipe: Recipe | None
    reason: str | None
    index: int | None  # the product's FP8 state postfix index in its module (FP8 only)


def _path(keys: Sequence[Any]) -> str:
    return "/".join(str(key) for key in keys)


class _Session:
    """The handler of one model call: finds the calling module, plans and runs each product."""

    def __init__(self, front_end: str, config: _Config, discovering: bool = False) -> None:
        self.front_end = front_end
        self.config = config
        self.discovering = discovering
        self.sites: dict[tuple[str, Any], int] = {}
        self.counts: dict[str, int] = {}
        self.records: dict[tuple[str, Any], _Record] = {}
        self.owners: dict[str, Any] = {}  # path -> the module as seen in the call (NNX)

    def _owner(self) -> tuple[Any, Any, str] | None:
        for frame in _inject.calling_frames(3):
            owner = frame.f_locals.get("self")
            if self.front_end == "linen":
                if not isinstance(owner, nn.Module) or owner.scope is None:
                    continue
                path = _path(owner.scope.path)
            else:
                if not isinstance(owner, nnx.Module) or not hasattr(owner, "_te_flax_path"):
                    continue
                path = owner._te_flax_path
            # te_flax's own layers run their products themselves.
            if type(owner).__module__.startswith("te_flax."):
                return None
            return owner, frame, path
        return None

    def __call__(self, op: str, lhs: Any, rhs: Any, spec: Any, original: Callable[[], Any]) -> Any:
        found = self._owner()
        if found is None:
            return None
        owner, frame, path = found
        site = (path, (frame.f_code, frame.f_lasti))
        recipe = self.config.recipe_for(path, op)
        plan = plan_product(op, lhs, rhs, spec)
        reason = None if recipe is None else fp8_reason(plan, lhs, rhs, recipe)
        if site not in self.sites and recipe is not None and reason is None:
            self.sites[site] = self.counts.get(path, 0)
            self.counts[path] = self.sites[site] + 1
        index = self.sites.get(site)
        self.records.setdefault(site, _Record(op, recipe, reason, index))
        self.owners.setdefault(path, owner)
        if index is None or self.discovering or isinstance(plan, str):
            return None
        assert recipe is not None
        out = jax.eval_shape(original)  # the product's own output dtype
        if self.front_end == "linen":
            state = fp8_variables(owner, recipe, postfix(index))
            key = owner.make_rng(SR_RNG) if needs_sr_key(recipe) else None
            qs = quantizer_set(recipe, postfix(index), state, key)
        else:
            qs = self._nnx_set(owner, path, recipe, index)
            if qs is None:
                return None
        return run_plan(plan, lhs, rhs, qs, out.dtype)

    def _nnx_set(self, owner: nnx.Module, path: str, recipe: Recipe, index: int) -> Any:
        if index >= getattr(owner, "_te_flax_products", 0):
            _note_once(
                (path, index),
                f"{path}: a product that quantize_model's example inputs did not reach runs "
                "in high precision (its FP8 state was not created); quantize the model with "
                "inputs that take every branch",
            )
            return None
        return owner_quantizer_set(owner, recipe, postfix(index))


_NOTED: set[Any] = set()


def _note_once(key: Any, message: str) -> None:
    if key not in _NOTED:
        _NOTED.add(key)
        warnings.warn(message, QuantizeModelNote, stacklevel=3)


def _report(records: dict[tuple[str, Any], _Record], rules: Sequence[QuantizeRule] | None) -> None:
    """Refuses rules that select nothing; notes the selected products left as they were."""
    products = sorted({(path, record.op) for (path, _), record in records.items()})
    for rule in rules or ():
        if not any(rule.matches(path, op) for path, op in products):
            listing = ", ".join(f"{path or '<root>'} ({op})" for path, op in products)
            raise ValueError(
                f"{rule} selects no product of this model; the products are called from: "
                f"{listing or 'nowhere (the model calls no matrix product)'}. Fix the rule's "
                "module_path (a regular expression over the whole path) or op_names"
            )
    left = sorted(
        {
            f"{path or '<root>'} ({record.op}): {record.reason}"
            for (path, _), record in records.items()
            if record.reason is not None
        }
    )
    if left:
        _note_once(
            tuple(left),
            "quantize_model leaves these products in high precision, as FP8 cannot take them: "
            + "; ".join(left),
        )


# ----------------------------------------------------------------------------- Linen


class QuantizedModule(nn.Module):
    """A Linen model whose products run in FP8 (``quantize_model``'s result for Linen).

    It shares its scope with ``module``: the variables are the model's own, plus the FP8 state
    in ``_overwrite_with_gradient`` under each calling module.
    """

    module: nn.Module
    config: _Config

    def setup(self) -> None:
        nn.share_scope(self, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _inject.intercepting(_Session("linen", self.config)):
            return self.module(*args, **kwargs)


_Records = dict[tuple[str, Any], _Record]


def _quantize_linen(
    model: nn.Module, config: _Config, inputs: tuple[Any, ...]
) -> tuple[nn.Module, _Records]:
    quantized = QuantizedModule(model, config)
    session = _Session("linen", config)
    key = jax.random.key(0)
    rngs = {"params": key, "dropout": key, SR_RNG: key}

    def init(*args: Any) -> Any:
        with _inject.intercepting(session):
            return model.init(rngs, *args)

    jax.eval_shape(init, *inputs)
    return quantized, session.records


# ----------------------------------------------------------------------------- NNX


def _linen_free_dot_general(*args: Any, **kwargs: Any) -> Array:
    """``nnx.Linear``'s product, looked up when called (so that it can be intercepted)."""
    return jax.lax.dot_general(*args, **kwargs)


def _einsum_op(*args: Any, **kwargs: Any) -> Array:
    """``nnx.Einsum``'s product, looked up when called (so that it can be intercepted)."""
    return jnp.einsum(*args, **kwargs)


_QUANTIZED_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that runs inside the model's interception."""
    if cls not in _QUANTIZED_CLASSES:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _inject.intercepting(_Session("nnx", self._te_flax_config)):
                return cls.__call__(self, *args, **kwargs)

        _QUANTIZED_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _QUANTIZED_CLASSES[cls]


def _first_param_shape(module: nnx.Module) -> tuple[int, ...] | None:
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
    return tuple(jnp.shape(leaves[0])) if leaves else None


def _quantize_nnx(model: Any, config: _Config, inputs: tuple[Any, ...]) -> tuple[Any, _Records]:
    modules: dict[Any, Any] = dict(nnx.iter_modules(model))
    for keys, module in modules.items():
        module._te_flax_path = _path(keys)
        if isinstance(module, nnx.Linear) and module.dot_general is jax.lax.dot_general:
            module.dot_general = _linen_free_dot_general
        if isinstance(module, nnx.Einsum) and module.einsum_op is jnp.einsum:
            module.einsum_op = _einsum_op
    graphdef, state = nnx.split(model)
    session = _Session("nnx", config, discovering=True)
    seen_shapes: dict[str, tuple[int, ...] | None] = {}

    def discover(state: Any, *args: Any) -> None:
        copy = nnx.merge(graphdef, state)
        with _inject.intercepting(session):
            copy(*args)
        for path, owner in session.owners.items():
            seen_shapes[path] = _first_param_shape(owner)

    jax.eval_shape(discover, state, *inputs)
    by_path = {module._te_flax_path: module for module in modules.values()}
    for (path, _), record in session.records.items():
        if record.index is None:
            continue
        owner: Any = by_path[path]
        add_fp8_state(owner, record.recipe, postfix(record.index))
        owner._te_flax_products = max(getattr(owner, "_te_flax_products", 0), record.index + 1)
        if needs_sr_key(record.recipe) and getattr(owner, "sr_rngs", None) is None:
            owner.sr_rngs = nnx.Rngs(0)[SR_RNG].fork()
        _stack_state(owner, seen_shapes.get(path), record.recipe, postfix(record.index))
    model._te_flax_config = config
    model.__class__ = _quantized_class(type(model))
    return model, session.records


def _stack_state(
    owner: nnx.Module, traced: tuple[int, ...] | None, recipe: Recipe | None, post: str
) -> None:
    """A module built stacked (``nnx.vmap``, for ``nnx.scan`` over layers) gets stacked state:
    its parameters have leading axes the call did not see, and so does its FP8 state."""
    real = _first_param_shape(owner)
    if traced is None or real is None or len(real) <= len(traced):
        return
    lead = real[: len(real) - len(traced)]
    for name, value in fresh_state(recipe, post).items():
        getattr(owner, name).set_value(jnp.broadcast_to(value, (*lead, *value.shape)))


# ----------------------------------------------------------------------------- entry point


def quantize_model(
    model: Any,
    recipe: Recipe,
    *model_inputs: Any,
    rules: Sequence[QuantizeRule] | None = None,
) -> Any:
    """Runs a Flax model's matrix products as te_flax FP8 GEMMs; one call, no model rewrite.

    The products of ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nnx.Linear``,
    ``nnx.LinearGeneral`` and ``nnx.Einsum``, and ``jax.lax.dot_general``, ``jnp.einsum``,
    ``jnp.dot`` and ``jnp.matmul`` called in the model's module methods, run through te_flax's
    ``dense`` with ``recipe``: the quantizers, FP8 state and max-merge rule of te_flax's layers.
    A product whose shapes or dtypes FP8 cannot take (a contracting size that is not a multiple
    of 16, integer operands, batch dimensions) stays as it was, with one note
    (``QuantizeModelNote``) that names it and why.

    The FP8 state of a product lives in the module that calls it, named as in te_flax's layers
    (``x_amax_history``, ``kernel_scale_inv``...; the module's second product ``x_1_...``):

    * Linen: variables in ``_overwrite_with_gradient`` (train with ``te_flax.training``; in
      ``nn.scan`` list that collection in ``variable_axes`` or ``variable_broadcast``).
    * NNX: ``te_flax.nnx.Fp8Meta`` variables (train with
      ``te_flax.nnx.value_and_grad(..., update_fp8_state=True)`` or ``te_flax.nnx.train_step``;
      keep them out of the optimizer with ``nnx.Optimizer(..., wrt=nnx.Param)``).

    Args:
      model: a ``flax.linen.Module`` or an ``nnx.Module`` (changed in place and returned).
      recipe: the FP8 recipe (``DelayedScaling``, ``Float8CurrentScaling``,
        ``MXFP8BlockScaling``, ``NVFP4BlockScaling``).
      *model_inputs: example inputs of the model's ``__call__`` (arrays or
        ``jax.ShapeDtypeStruct``); the model is traced on them (not run) to find its products.
      rules: ``QuantizeRule``\\ s, the first that selects a product decides; a product no rule
        selects stays as it is (default ``DEFAULT_RULES``: embeddings, output heads and
        routers in high precision, every other product in FP8).

    Returns:
      Linen: a ``QuantizedModule`` to ``init`` and ``apply`` in place of ``model`` (the same
      parameter tree). NNX: ``model`` itself.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import te_flax
      >>> from te_flax.quantize import DelayedScaling
      >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.relu,
      ...                        nnx.Linear(64, 32, rngs=nnx.Rngs(1)))
      >>> model = te_flax.quantize_model(model, DelayedScaling(), jnp.ones((16, 32)))
      >>> sorted(nnx.state(model, te_flax.nnx.Fp8Meta)["layers"][0])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """
    if recipe is None:
        raise TypeError(
            "quantize_model needs a recipe, got None; e.g. te_flax.quantize.DelayedScaling()"
        )
    check_recipe(recipe, "quantize_model(recipe=)")
    config = _Config(recipe, _check_rules(rules))
    if isinstance(model, nn.Module):
        quantized, records = _quantize_linen(model, config, model_inputs)
    elif isinstance(model, nnx.Module):
        quantized, records = _quantize_nnx(model, config, model_inputs)
    else:
        raise TypeError(
            f"quantize_model takes a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}; pass the model object (for Linen the unbound module "
            "whose init/apply you call, for NNX the module itself)"
        )
    _report(records, rules)
    return quantized
