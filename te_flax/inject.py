"""``quantize_model``: FP8 for a Linen or NNX model written with Flax's own layers.

One call makes a model's matrix products (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``,
``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``; with ``bare_products=True`` also
``jax.lax.dot_general``, ``jnp.einsum``, ``jnp.dot``, ``jnp.matmul`` called in a module's
``__call__``) run as te_flax FP8 GEMMs (the ``dense`` op: te_flax's quantizers, FP8 state and
max-merge rule). Each product's FP8 state lives in the module that calls it: Linen variables in
``_overwrite_with_gradient``, NNX ``Fp8Meta`` variables. Rules choose products by module path
and operation; by default embeddings, the output head and MoE router gates stay in high
precision.

The layers are reached through Flax's own hooks: Linen's method interceptor
(``te_flax.linen.quantized.hooks``) and, in NNX, the layers' ``dot_general`` / ``einsum_op``
attributes (``te_flax.nnx.quantized.hook_layers``). Bare ``jnp`` / ``lax`` calls have no hook;
``bare_products=True`` reaches them by replacing JAX's four product functions for the whole
process while the model runs (``te_flax._quantize_model.products.intercepting``); without it, those
that read a parameter are found in the jaxpr of one trace of the quantized model
(``te_flax._quantize_model.bare_products``) and named in a note.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from te_flax._quantize_model.bare_products import (
    leaf_paths,
    module_of,
    parameter_products,
    unrun_note,
)
from te_flax._quantize_model.products import (
    LAYER,
    OPS,
    QuantizeModelNote,
    Record,
    Session,
    note_once,
    postfix,
)
from te_flax.linen.quantized import QuantizedModule, hooks
from te_flax.nnx.quantized import add_fp8_state, discovering, hook_layers
from te_flax.quantize import Recipe
from te_flax.quantize.recipes import check_recipe
from te_flax.quantize.state import SR_RNG, fresh_state, needs_sr_key

__all__ = ["DEFAULT_RULES", "QuantizeModelNote", "QuantizeRule", "quantize_model"]


@dataclasses.dataclass(frozen=True)
class QuantizeRule:
    """Which products a rule selects, and whether they run in FP8.

    Attributes:
      module_path: a regular expression that the calling module's path must match in full;
        paths join attribute names (NNX) or module names (Linen) with ``/``, e.g.
        ``"blocks/0/mlp/up"`` or ``"Block_0/Dense_1"`` (default ``".*"``: every module).
      op_names: the operations selected, among ``"dot_general"`` (``nn.Dense``,
        ``nn.DenseGeneral``, ``nnx.Linear``, ``nnx.LinearGeneral``, bare ``lax.dot_general``),
        ``"einsum"`` (``nn.Einsum``, ``nnx.Einsum``, bare ``jnp.einsum``), ``"dot"``,
        ``"matmul"`` (bare ``jnp.dot``, ``jnp.matmul``) (default None: all). Bare calls are
        seen with ``quantize_model(..., bare_products=True)``.
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
    """The selection of a quantized model's products (``Selection`` for its sessions)."""

    recipe: Recipe
    rules: tuple[QuantizeRule, ...]
    bare_products: bool = False

    def recipe_for(self, path: str, op: str) -> Recipe | None:
        """The recipe of a product (None: high precision): the first rule that selects it."""
        for rule in self.rules:
            if rule.matches(path, op):
                return (rule.recipe or self.recipe) if rule.quantize else None
        return None


_Records = dict[tuple[str, Any], Record]
# Each bare product over parameters that runs in high precision: the paths of those it reads.
_Unrun = list[tuple[str, ...]]


def _selects(rule: QuantizeRule, path: str, op: str) -> bool:
    """Whether ``rule`` selects a product; a bare product found in the jaxpr (op ``"bare"``) is
    one of the four operations, which one the jaxpr does not tell."""
    return any(rule.matches(path, op) for op in (OPS if op == "bare" else (op,)))


def _report(records: _Records, rules: Sequence[QuantizeRule] | None, unrun: _Unrun) -> None:
    """Refuses rules that select nothing; notes the selected products left as they were."""
    products = sorted(
        {(path, record.op) for (path, _), record in records.items()}
        | {(module_of(path), "bare") for reads in unrun for path in reads}
    )
    for rule in rules or ():
        if not any(_selects(rule, path, op) for path, op in products):
            listing = ", ".join(
                f"{path or '<root>'} ({'a bare jnp / lax product' if op == 'bare' else op})"
                for path, op in products
            )
            raise ValueError(
                f"{rule} selects no product of this model; the products are called from: "
                f"{listing or 'nowhere (the model calls no matrix product)'}. Fix the rule's "
                "module_path (a regular expression over the whole path) or op_names; bare jnp / "
                "lax products are listed where they read a parameter (with bare_products=True, "
                "all of them)"
            )
    left = sorted(
        {
            f"{path or '<root>'} ({record.op}): {record.reason}"
            for (path, _), record in records.items()
            if record.reason is not None
        }
    )
    if left:
        note_once(
            tuple(left),
            "quantize_model leaves these products in high precision, as FP8 cannot take them: "
            + "; ".join(left),
        )


def _note_unrun(model: Any, config: _Config, unrun: _Unrun) -> None:
    """One note for the bare products over parameters that a rule selects for FP8 but that
    run in high precision (without ``bare_products=True``)."""
    selected = [
        reads
        for reads in unrun
        if any(config.recipe_for(module_of(path), op) for path in reads for op in OPS)
    ]
    if selected:
        message = unrun_note(type(model).__name__, selected)
        note_once(message, message)


def _find_unrun(
    forward: Callable[..., Any], parameters: Any, args: tuple[Any, ...], theirs: set[str]
) -> _Unrun:
    """The products of one trace of ``forward(parameters, *args)`` (the quantized forward)
    that read a parameter of a module other than those in ``theirs`` (modules that run their
    own products: the stock layers and te_flax's modules, with their submodules)."""

    def owned(path: str) -> bool:
        module = module_of(path)
        return any(module == own or module.startswith(own + "/") for own in theirs)

    paths = leaf_paths(parameters)
    try:
        found = parameter_products(forward, parameters, *args)
    except Exception as error:  # a check that must never stop quantize_model
        note_once(
            ("bare products", repr(error)),
            "quantize_model could not trace the quantized model to look for bare jnp / lax "
            f"products over parameters ({type(error).__name__}: {error}); such products run "
            "in high precision unless quantize_model is called with bare_products=True",
        )
        return []
    unrun = [tuple(sorted(paths[i] for i in reads)) for reads in found]
    return [reads for reads in unrun if not all(owned(path) for path in reads)]


def _layer_paths(records: _Records) -> set[str]:
    """The paths of the stock layers whose products the hooks saw."""
    return {path for path, site in records if site == LAYER}


def _quantize_linen(
    model: nn.Module, config: _Config, inputs: tuple[Any, ...]
) -> tuple[nn.Module, _Records, _Unrun]:
    session = Session(config)
    key = jax.random.key(0)
    rngs = {"params": key, "dropout": key, SR_RNG: key}

    def init(*args: Any) -> Any:
        with hooks(session):
            return model.init(rngs, *args)

    variables = dict(jax.eval_shape(init, *inputs))
    quantized = QuantizedModule(model, config)
    if config.bare_products:
        return quantized, session.records, []
    others = {name: value for name, value in variables.items() if name != "params"}

    def forward(params: Any, others: Any, *args: Any) -> Any:
        return quantized.apply({"params": params, **others}, *args, rngs=rngs, mutable=True)

    theirs = _layer_paths(session.records) | session.own_modules
    params = variables.get("params", {})
    return quantized, session.records, _find_unrun(forward, params, (others, *inputs), theirs)


def _first_param_shape(module: nnx.Module) -> tuple[int, ...] | None:
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
    return tuple(jnp.shape(leaves[0])) if leaves else None


def _quantize_nnx(
    model: Any, config: _Config, inputs: tuple[Any, ...]
) -> tuple[Any, _Records, _Unrun]:
    by_path = hook_layers(model, config)
    graphdef, state = nnx.split(model)
    session = Session(config, discovering=True)
    seen_shapes: dict[str, tuple[int, ...] | None] = {}

    def discover(state: Any, *args: Any) -> None:
        with discovering(session):
            nnx.merge(graphdef, state)(*args)
        for path, owner in session.owners.items():
            seen_shapes[path] = _first_param_shape(owner)

    jax.eval_shape(discover, state, *inputs)
    for (path, _), record in session.records.items():
        if record.index is None:
            continue
        owner: Any = by_path[path]
        add_fp8_state(owner, record.recipe, postfix(record.index))
        owner._te_flax_products = max(getattr(owner, "_te_flax_products", 0), record.index + 1)
        if needs_sr_key(record.recipe) and getattr(owner, "sr_rngs", None) is None:
            owner.sr_rngs = nnx.Rngs(0)[SR_RNG].fork()
        _stack_state(owner, seen_shapes.get(path), record.recipe, postfix(record.index))
    unrun = [] if config.bare_products else _nnx_unrun(model, session.records, inputs)
    return model, session.records, unrun


def _nnx_unrun(model: nnx.Module, records: _Records, inputs: tuple[Any, ...]) -> _Unrun:
    """The quantized NNX model's bare products over parameters (one trace of its call)."""
    graphdef, params, *rest_states = nnx.split(model, nnx.Param, ...)
    (rest,) = rest_states

    def forward(params: Any, rest: Any, *args: Any) -> Any:
        return nnx.merge(graphdef, params, rest)(*args)

    own = {
        "/".join(str(key) for key in keys)
        for keys, module in nnx.iter_modules(model)
        if type(module).__module__.startswith("te_flax.")
    }
    return _find_unrun(forward, params, (rest, *inputs), _layer_paths(records) | own)


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
    bare_products: bool = False,
) -> Any:
    """Runs a Flax model's matrix products as te_flax FP8 GEMMs; one call, no model rewrite.

    The products of ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nnx.Linear``,
    ``nnx.LinearGeneral`` and ``nnx.Einsum`` (with ``bare_products=True`` also
    ``jax.lax.dot_general``, ``jnp.einsum``, ``jnp.dot`` and ``jnp.matmul`` called in a
    module's ``__call__``) run through te_flax's ``dense`` with ``recipe``: the quantizers, FP8
    state and max-merge rule of te_flax's layers. The layers are reached through Flax's own
    hooks (Linen's method interceptor; NNX layers' ``dot_general`` / ``einsum_op``).
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
      bare_products: also run in FP8 the products a module's ``__call__`` writes as bare
        ``jax.lax.dot_general``, ``jnp.einsum``, ``jnp.dot`` or ``jnp.matmul`` calls (MoE
        experts as einsums over parameters, say); each takes the next FP8 state of its module,
        in call order (default False: only the layers' products). Flax has no hook for such
        calls, so this fallback replaces those four JAX functions for the whole process while
        the quantized model runs (calls from other threads go to JAX's own). Without it, one
        trace of the quantized model (``jax.make_jaxpr``, nothing replaced) finds the bare
        products that read a parameter, and one ``QuantizeModelNote`` says how many run in
        high precision and in which modules (those that rules keep in high precision aside).

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
    if not isinstance(bare_products, bool):
        raise TypeError(f"bare_products must be True or False, got {bare_products!r}")
    config = _Config(recipe, _check_rules(rules), bare_products)
    if isinstance(model, nn.Module):
        quantized, records, unrun = _quantize_linen(model, config, model_inputs)
    elif isinstance(model, nnx.Module):
        quantized, records, unrun = _quantize_nnx(model, config, model_inputs)
    else:
        raise TypeError(
            f"quantize_model takes a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(model).__name__}; pass the model object (for Linen the unbound module "
            "whose init/apply you call, for NNX the module itself)"
        )
    _report(records, rules, unrun)
    _note_unrun(model, config, unrun)
    return quantized
