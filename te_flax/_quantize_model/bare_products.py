"""Finding the products over parameters that a quantized model still runs in high precision.

``quantize_model`` runs Flax's own layers' products in FP8 through Flax's hooks; a product that a
module's ``__call__`` writes as a bare ``jnp.einsum`` / ``jnp.dot`` / ``jnp.matmul`` /
``lax.dot_general`` over its parameters (MoE experts, often) has no hook, and without
``bare_products=True`` it stays as written. ``parameter_products`` finds such products in the
jaxpr of one trace of the quantized forward: it marks the inputs that are parameters, follows
them through the primitives that only change a shape, a dtype or a view (and into nested
jaxprs: ``jit``, ``checkpoint``, ``scan``, ``cond``, ``while``, ``closed_call``), and lists each
``dot_general`` that reads one. The bodies of ``custom_vjp`` / ``custom_jvp`` calls are not
entered: te_flax's FP8 GEMMs are ``custom_vjp`` ops, whose parameters are already quantized.
Nothing here replaces a JAX function or runs at train time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

__all__ = ["leaf_paths", "module_of", "parameter_products", "unrun_note"]

# Primitives whose output is a view of their first operand (its shape, dtype or a slice of it):
# a parameter seen through one is still the parameter.
_VIEWS = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "device_put",
        "sharding_constraint",
        "mesh_cast",
        "reduce_precision",
        "slice",
        "dynamic_slice",
        "gather",
    }
)

_NONE: frozenset[int] = frozenset()

# Variable -> the indices of the parameters it is a view of.
_Marks = dict[Any, frozenset[int]]


def _marks_of(marks: _Marks, atom: Any) -> frozenset[int]:
    return _NONE if isinstance(atom, Literal) else marks.get(atom, _NONE)


def _open(value: Any) -> Any:
    """The open jaxpr of a ``Jaxpr`` or ``ClosedJaxpr`` parameter (None: not a jaxpr)."""
    inner = getattr(value, "jaxpr", value)
    return inner if hasattr(inner, "eqns") and hasattr(inner, "invars") else None


def _nested(eqn: Any) -> Iterator[tuple[Any, Sequence[Any]]]:
    """Each jaxpr nested in ``eqn``, with the outer operands its inputs are, by position.

    The nested jaxpr's inputs are the equation's last operands (``cond`` passes its branch
    index first, ``while`` its condition's constants), except a ``while``'s condition, which
    computes no product worth a note and is skipped."""
    for name, value in eqn.params.items():
        if name == "cond_jaxpr":
            continue
        for candidate in value if isinstance(value, tuple | list) else (value,):
            inner = _open(candidate)
            if inner is None or len(inner.invars) > len(eqn.invars):
                continue
            yield inner, eqn.invars[len(eqn.invars) - len(inner.invars) :]


def _walk(jaxpr: Any, marks: _Marks, found: list[frozenset[int]]) -> list[frozenset[int]]:
    """Appends to ``found`` the parameters each ``dot_general`` of ``jaxpr`` reads; the marks
    of ``jaxpr``'s outputs."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith("custom_"):
            continue  # custom_vjp / custom_jvp: te_flax's FP8 ops (and nothing to note)
        read = [_marks_of(marks, atom) for atom in eqn.invars]
        if name == "dot_general":
            if read[0] | read[1]:
                found.append(read[0] | read[1])
        elif name in _VIEWS:
            if read and read[0]:
                marks.update((out, read[0]) for out in eqn.outvars)
        else:
            for inner, operands in _nested(eqn):
                inner_marks = {
                    var: _marks_of(marks, atom)
                    for var, atom in zip(inner.invars, operands, strict=True)
                }
                outs = _walk(inner, inner_marks, found)
                if len(outs) == len(eqn.outvars):
                    for out, mark in zip(eqn.outvars, outs, strict=True):
                        if mark:
                            marks[out] = marks.get(out, _NONE) | mark
    return [_marks_of(marks, atom) for atom in jaxpr.outvars]


def parameter_products(
    forward: Callable[..., Any], parameters: Any, *args: Any
) -> list[frozenset[int]]:
    """The products of ``forward(parameters, *args)`` that read a parameter outside a
    ``custom_vjp`` op: for each, the indices (in ``jax.tree.leaves(parameters)`` order) of
    the parameters it reads. One trace (``jax.make_jaxpr``); nothing runs.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> def forward(params, x):
      ...     scores = jnp.einsum("td,sd->ts", x, x)  # two activations: not listed
      ...     return jnp.einsum("ts,tf,fd->sd", scores, x, params["w"].astype(x.dtype))
      >>> parameter_products(forward, {"w": jnp.ones((8, 8))}, jnp.ones((4, 8)))
      [frozenset({0})]
    """
    closed = jax.make_jaxpr(forward)(parameters, *args)
    jaxpr = _open(closed)
    count = len(jax.tree.leaves(parameters))
    marks = {var: frozenset({i}) for i, var in enumerate(jaxpr.invars[:count])}
    found: list[frozenset[int]] = []
    _walk(jaxpr, marks, found)
    return found


def leaf_paths(tree: Any) -> list[str]:
    """The ``/``-joined path of each leaf of ``tree`` (dictionary keys and sequence indices;
    attribute names, such as a boxed value's ``value``, are left out).

    Example usage::

      >>> leaf_paths({"blocks": [{"w": 1}], "b": 2})
      ['b', 'blocks/0/w']
    """
    paths = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [getattr(key, "key", getattr(key, "idx", None)) for key in keys]
        paths.append("/".join(str(name) for name in names if name is not None))
    return paths


def module_of(path: str) -> str:
    """The path of the module that owns the parameter at ``path`` (``""``: the root)."""
    return path.rpartition("/")[0]


def unrun_note(model_name: str, products: Sequence[Sequence[str]], most: int = 8) -> str:
    """The note for ``products`` (each the paths of the parameters it reads) left in high
    precision: how many, in which modules, why, and the fix.

    Example usage::

      >>> print(unrun_note("MoE", [["moe/w_in"], ["moe/w_out"]]))  # doctest: +ELLIPSIS
      quantize_model(MoE): 2 matrix products over parameters are bare jnp / lax calls ...
    """
    counts: dict[str, int] = {}
    names: dict[str, set[str]] = {}
    for reads in products:
        owner = min(module_of(path) for path in reads)  # the module it is listed under
        counts[owner] = counts.get(owner, 0) + 1
        names.setdefault(owner, set()).update(path.rpartition("/")[2] for path in reads)
    listing = [
        f"{owner or '<root>'} ({count}, over {', '.join(sorted(names[owner]))})"
        for owner, count in sorted(counts.items())
    ]
    more = f" and {len(listing) - most} more modules" if len(listing) > most else ""
    count = (
        "1 matrix product over parameters is a bare jnp / lax call"
        if len(products) == 1
        else f"{len(products)} matrix products over parameters are bare jnp / lax calls"
    )
    return (
        f"quantize_model({model_name}): {count} (jnp.einsum, jnp.dot, jnp.matmul, "
        "lax.dot_general), which no Flax hook reaches: left in high precision, in "
        + "; ".join(listing[:most])
        + more
        + ". Pass bare_products=True to run them in FP8, or, if high precision is meant, put "
        "QuantizeRule(module_path=<these modules' paths>, quantize=False) in the rules"
    )
