"""FP8 for Linen models written with Flax's own layers: TransformerEngine's injection helpers
and ``quantize_model``'s Linen hook.

``make_dot_general_cls(recipe)`` is a module class that ``flax.linen.Dense`` and
``DenseGeneral`` take as ``dot_general_cls``: their products run as te_flax's ``dense`` (the
same quantizers, FP8 state and max-merge rule as te_flax's layers), with the FP8 state in the
wrapper's own variables. ``wrap_function_in_te_state_module`` is the general form, and
``make_grouped_dense_cls`` its grouped GEMM.

``quantize_model`` reaches a Linen model's layers through Flax's own hook,
``flax.linen.intercept_methods``: ``hooks(session)`` runs each ``nn.Dense`` and
``nn.DenseGeneral`` with a ``dot_general`` that hands its product to the session, and
``nn.Einsum`` (which takes no product function) with its call written here around the same
parameters; the FP8 state is variables of the layer itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from te_flax._quantize_model.products import (
    Frame,
    Session,
    bare_fallback,
    innermost,
    layer_product,
    plan_product,
    postfix,
    run_plan,
    running,
)
from te_flax.dense import grouped_dense
from te_flax.linen._base import TransformerEngineBase, fp8_variables
from te_flax.quantize import QuantizerSet, Recipe
from te_flax.quantize.recipes import check_recipe
from te_flax.quantize.state import SR_RNG, needs_sr_key, quantizer_set
from te_flax.sharding import LOGICAL_AXES

__all__ = [
    "extend_logical_axis_rules",
    "make_dot_general_cls",
    "make_grouped_dense_cls",
    "wrap_function_in_te_state_module",
]

LogicalRules = Sequence[tuple[str, Any]]


def _check_recipe(recipe: object, where: str) -> None:
    if recipe is not None:
        check_recipe(recipe, where)


def wrap_function_in_te_state_module(
    f: Callable[..., Any],
    quantization_recipe: Recipe | None,
    name: str | None = None,
    quantization_checkpoint_name: str | None = None,
) -> type[nn.Module]:
    """A Linen module class that calls ``f(generate_quantizer_set, *args, **kwargs)``.

    The module has no parameters; ``generate_quantizer_set(postfix="", n_groups=None)`` gives
    ``f`` a quantizer set of ``quantization_recipe`` whose FP8 state is the module's variables
    in ``_overwrite_with_gradient`` (as ``TransformerEngineBase.generate_quantizer_set``).

    Args:
      f: the function; its first argument is ``generate_quantizer_set``.
      quantization_recipe: the recipe (None: the active ``te_flax.autocast`` one, else no FP8).
      name: the class is named ``TEWrapper_{name}`` (default: ``f.__name__``).
      quantization_checkpoint_name: the ``jax.checkpoint`` name of the quantized operands the
        GEMMs save for their backward (default None).

    Returns:
      The module class.
    """
    _check_recipe(quantization_recipe, "wrap_function_in_te_state_module(quantization_recipe=)")

    class TEWrapper(TransformerEngineBase):
        """A function with TransformerEngine quantizer sets whose state this module keeps."""

        def generate_quantizer_set(  # type: ignore[override]
            self, postfix: str = "", n_groups: int | None = None
        ) -> QuantizerSet:
            return super().generate_quantizer_set(
                postfix=postfix,
                quantization_checkpoint_name=quantization_checkpoint_name,
                fp8_recipe=quantization_recipe,
                n_groups=n_groups,
            )

        @nn.compact
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return f(self.generate_quantizer_set, *args, **kwargs)

    TEWrapper.__name__ = TEWrapper.__qualname__ = f"TEWrapper_{name if name else f.__name__}"
    return TEWrapper


def make_dot_general_cls(quantization_recipe: Recipe | None) -> type[nn.Module]:
    """A module class that runs ``lax.dot_general``'s products as te_flax FP8 GEMMs.

    Pass it as ``dot_general_cls`` to ``flax.linen.Dense`` or ``DenseGeneral``
    (``nn.Dense(features, dot_general_cls=make_dot_general_cls(DelayedScaling()))``): the layer
    keeps its parameters, and its product runs through te_flax's ``dense`` with the FP8 state
    of a ``TEWrapper_dot_general_0`` submodule in ``_overwrite_with_gradient``. Train it as any
    te_flax model (``te_flax.training``).

    Args:
      quantization_recipe: the recipe (None: the active ``te_flax.autocast`` one, else no FP8).

    Returns:
      The module class, called as ``dot_general(x, kernel, dimension_numbers, precision=None,
      preferred_element_type=None)``. Products with batch dimensions are refused, as in
      TransformerEngine; ``precision`` is that of the recipe's GEMMs. (``flax.linen.Einsum``
      takes no product function; ``te_flax.quantize_model`` quantizes it.)

    Example usage::

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from te_flax.linen import make_dot_general_cls
      >>> from te_flax.quantize import DelayedScaling
      >>> layer = nn.Dense(16, dot_general_cls=make_dot_general_cls(DelayedScaling()))
      >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 32)))
      >>> sorted(variables["_overwrite_with_gradient"]["TEWrapper_dot_general_0"])[:2]
      ['grad_amax_history', 'grad_scale_inv']
    """

    def dot_general(
        generate_quantizer_set: Callable[..., QuantizerSet],
        x: Array,
        kernel: Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> Array:
        del precision, kwargs  # the recipe sets the GEMMs' precision; sharding is the layer's
        plan = plan_product("dot_general", x, kernel, dimension_numbers)
        if isinstance(plan, str):
            raise ValueError(
                f"make_dot_general_cls runs a product as te_flax's dense, but this one cannot: "
                f"{plan} (x {x.shape}, kernel {kernel.shape}, dimension_numbers "
                f"{dimension_numbers}); use it only on layers whose product contracts x with "
                "the kernel without batch dimensions (Dense, DenseGeneral without batch_dims, "
                "...), or leave this layer in high precision"
            )
        return run_plan(plan, x, kernel, generate_quantizer_set(), preferred_element_type)

    return wrap_function_in_te_state_module(dot_general, quantization_recipe, "dot_general")


def make_grouped_dense_cls(
    quantization_recipe: Recipe | None, quantization_checkpoint_name: str | None = None
) -> nn.Module:
    """A grouped GEMM module (``x [M, K]``, ``kernel [G, K, N]``, ``group_sizes [G]``).

    Called as ``grouped(x, kernel, group_sizes)``; runs ``te_flax.dense.grouped_dense`` with
    one FP8 state per group (``[G, L]`` histories) kept in the module's variables. As in
    TransformerEngine this returns a module instance, not a class. TransformerEngine accepts
    only MXFP8 (or None) here; te_flax takes every recipe ``grouped_dense`` takes.

    Args:
      quantization_recipe: the recipe (None: the active ``te_flax.autocast`` one, else no FP8).
      quantization_checkpoint_name: the ``jax.checkpoint`` name of the saved quantized
        operands (default None).
    """

    def ragged_dot(
        generate_quantizer_set: Callable[..., QuantizerSet],
        x: Array,
        kernel: Array,
        group_sizes: Array,
        **kwargs: Any,
    ) -> Array:
        del kwargs
        quantizer_set = generate_quantizer_set(n_groups=kernel.shape[0])
        return grouped_dense(
            x,
            kernel,
            group_sizes=group_sizes,
            contracting_dims=((1,), (1,)),
            quantizer_set=quantizer_set,
        )

    cls = wrap_function_in_te_state_module(
        ragged_dot,
        quantization_recipe,
        "ragged_dot",
        quantization_checkpoint_name=quantization_checkpoint_name,
    )
    return cls()


def extend_logical_axis_rules(rules: LogicalRules) -> tuple[tuple[str, Any], ...]:
    """``rules`` followed by a rule for each logical name of te_flax's layers they leave out.

    te_flax's layers name their axes with Flax logical names (``batch``, ``embed``, ``mlp``,
    ``heads``, ...); each one ``rules`` does not map is added, replicated (None), so that
    Linen and NNX partition specs both see every name. TransformerEngine adds its own axis
    names mapped by its ``MeshResource``; te_flax's layers use Flax's names, so map those to
    mesh axes in ``rules`` (``configs/rules`` has rule sets for each kind of parallelism).

    Args:
      rules: ``[(logical_name, mesh_axis or tuple of mesh axes or None), ...]``.

    Returns:
      The extended rules, a tuple of pairs.
    """
    checked = []
    for item in rules:
        if not isinstance(item, tuple | list) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(
                f"a logical axis rule is a pair (logical_name, mesh_axes), got {item!r}; e.g. "
                "('batch', 'data') or ('embed', None)"
            )
        name, axes = item
        if not (
            axes is None
            or isinstance(axes, str)
            or (isinstance(axes, tuple | list) and all(isinstance(a, str) for a in axes))
        ):
            raise ValueError(
                f"the rule for {name!r} maps it to {axes!r}; map a logical name to a mesh axis "
                "name, a tuple of them, or None"
            )
        checked.append((name, tuple(axes) if isinstance(axes, list) else axes))
    named = {name for name, _ in checked}
    return (*checked, *((name, None) for name in LOGICAL_AXES if name not in named))


# ----------------------------------------------------------------------------- quantize_model


def _layer_quantizer_set(module: nn.Module, recipe: Recipe, index: int) -> QuantizerSet:
    """The quantizer set of ``module``'s ``index``-th product: FP8 state in its variables."""
    state = fp8_variables(module, recipe, postfix(index))
    key = module.make_rng(SR_RNG) if needs_sr_key(recipe) else None
    return quantizer_set(recipe, postfix(index), state, key)


@contextlib.contextmanager
def _field(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    """The layer's own field set for one call (Linen modules are frozen dataclasses)."""
    old = getattr(module, name)
    object.__setattr__(module, name, value)
    try:
        yield
    finally:
        object.__setattr__(module, name, old)


def _einsum_terms(einsum_str: str) -> tuple[str, str, str] | None:
    """(input, kernel, output) subscripts of an ``nn.Einsum`` equation (None: one Flax
    refuses, or one with an ellipsis in the kernel's subscripts)."""
    operands, arrow, output = einsum_str.partition("->")
    terms = operands.split(",")
    if not arrow or len(terms) != 2 or "..." in terms[1]:
        return None
    return terms[0], terms[1], output


def _einsum_call(frame: Frame, module: nn.Einsum, inputs: Array, einsum_str: str) -> Any:
    """``nn.Einsum``'s call with its product handed to ``frame``'s session: Flax's Einsum takes
    no product function, so its call is written here (the same parameters, made in order)."""
    terms = _einsum_terms(einsum_str)
    assert terms is not None
    x_term, kernel_term, output = terms
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias: Array | None = None
    if module.use_bias:
        # The bias has the kernel's output axes; it broadcasts over the others ("." never
        # names a kernel axis).
        n_ellipsis = inputs.ndim - (len(x_term) - 3) if "..." in x_term else 0
        output = output.replace("...", "." * n_ellipsis)
        sizes = [module.shape[kernel_term.index(c)] if c in kernel_term else 1 for c in output]
        bias_shape = [size for c, size in zip(output, sizes, strict=True) if c in kernel_term]
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    x, w, b = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = layer_product(
        frame,
        "einsum",
        None,
        einsum_str,
        x,
        w,
        precision=module.precision,
        preferred_element_type=module.preferred_element_type,
    )
    return y if b is None else y + jnp.reshape(b, sizes)


def _layer_call(frame: Frame, next_fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """A stock layer's ``__call__`` with its product handed to ``frame``'s session."""
    module = frame.module
    if isinstance(module, nn.Dense | nn.DenseGeneral):
        if module.dot_general is None and module.dot_general_cls is None:
            product = functools.partial(layer_product, frame, "dot_general", None)
            with _field(module, "dot_general", product):
                return next_fun(*args, **kwargs)
    elif type(module).__call__ is nn.Einsum.__call__:
        inputs = args[0] if args else kwargs["inputs"]
        given = args[1] if len(args) > 1 else kwargs.get("einsum_str")
        einsum_str = nn.merge_param("einsum_str", module.einsum_str, given).replace(" ", "")
        if _einsum_terms(einsum_str) is not None:
            return _einsum_call(frame, module, inputs, einsum_str)
    return next_fun(*args, **kwargs)


def _intercept(
    session: Session, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any
) -> Any:
    """Flax's method interceptor: keeps the stack of running modules (the owners of bare
    products), and hands each stock layer's product to ``session``."""
    module = context.module
    caller = innermost()
    if caller is not None and caller.module is module:  # a method calling another of its own
        return next_fun(*args, **kwargs)
    owned = module.scope is not None and not type(module).__module__.startswith("te_flax.")
    path = "/".join(str(key) for key in module.scope.path) if module.scope is not None else ""
    if module.scope is not None and not owned:
        session.own_modules.add(path)
    layer = isinstance(module, nn.Dense | nn.DenseGeneral | nn.Einsum)
    frame = Frame(
        module,
        path,
        session if owned else None,
        functools.partial(_layer_quantizer_set, module),
        bare_offset=int(layer),
    )
    with running(frame):
        if layer and owned and context.method_name == "__call__":
            return _layer_call(frame, next_fun, args, kwargs)
        return next_fun(*args, **kwargs)


@contextlib.contextmanager
def hooks(session: Session) -> Iterator[None]:
    """Runs the block with Linen modules' products handed to ``session``: the stock layers'
    through Flax's method interceptor, bare ``jnp`` / ``lax`` calls through the process-wide
    fallback where the session's selection asks for it (``bare_products``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(nn.intercept_methods(functools.partial(_intercept, session)))
        if session.selection.bare_products:
            stack.enter_context(bare_fallback())
        yield


class QuantizedModule(nn.Module):
    """A Linen model whose products run in FP8 (``quantize_model``'s result for Linen).

    It shares its scope with ``module``: the variables are the model's own, plus the FP8 state
    in ``_overwrite_with_gradient`` under each calling module.
    """

    module: nn.Module
    selection: Any  # quantize_model's recipe and rules

    def setup(self) -> None:
        nn.share_scope(self, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with hooks(Session(self.selection)):
            return self.module(*args, **kwargs)
