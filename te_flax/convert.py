"""Converting variable trees between TransformerEngine's Linen layout and te_flax's.

Parameters have the same names and shapes in both and are copied. FP8 state differs:

* TE keeps it in the ``fp8_metas`` collection as ``{x,kernel,grad}{postfix}_scale`` (the
  quantization multiplier, ``fp8_max / amax``) and ``..._amax_history``, stored after TE's
  update as ``[0, a(t-L+2), ..., a(t-1), a(t)]`` (oldest first, slot 0 cleared for the next step).
* te_flax keeps it in ``_overwrite_with_gradient`` as ``..._scale_inv`` (the dequantization
  scale, ``1 / scale``) and ``..._amax_history`` newest first, ``[a(t), a(t-1), ..., a(t-L+1)]``.

Both layouts give the next step the same scale and the same window of L amax values; the one
value te_flax keeps beyond TE (its oldest entry) is dropped by the next update anyway, and comes
back from TE as 0. ``scale_inv = 1 / scale`` is rounded to float32 (within one ulp).

``migrate_fp8_state`` fits the FP8 state of a restored te_flax checkpoint to a model whose
recipe differs from the saving run's: another ``amax_history_len``, FP8 state the checkpoint
lacks (a BF16 or current-scaling run) or holds but the model does not keep. Each change happens
only when the caller asks for it; otherwise the mismatch is an error that names it. Delayed
scaling's ``scale_inv`` depends on the saving run's format, margin and ``amax_compute_algo``,
which the checkpoint does not record: it is recomputed from each amax history under the
model's recipe (``recipe=``), and a warning says so when that changed a scale.

Example usage::

  >>> import jax.numpy as jnp
  >>> from te_flax.convert import from_transformer_engine
  >>> te_tree = {"params": {"kernel": jnp.ones((2, 2))},
  ...            "fp8_metas": {"x_scale": jnp.array([4.0]),
  ...                          "x_amax_history": jnp.array([0.0, 1.0, 3.0])}}
  >>> ours = from_transformer_engine(te_tree)
  >>> fp8 = ours["_overwrite_with_gradient"]
  >>> fp8["x_amax_history"], fp8["x_scale_inv"]
  (Array([3., 1., 0.], dtype=float32), Array([0.25], dtype=float32))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from jax import Array
from jax.typing import ArrayLike

from te_flax.quantize import DelayedScaling, Recipe
from te_flax.quantize.state import OVERWRITE_WITH_GRADIENT
from te_flax.training import scale_inv_from_history

__all__ = [
    "TE_FP8_COLLECTION",
    "RecomputedFp8ScalesWarning",
    "from_transformer_engine",
    "migrate_fp8_state",
    "to_transformer_engine",
]

TE_FP8_COLLECTION = "fp8_metas"
_HISTORY, _TE_SCALE, _SCALE_INV = "_amax_history", "_scale", "_scale_inv"
# A variable tree: collection -> nested mapping of arrays.
_Tree = Mapping[str, Any]
_LeafConverter = Callable[[str, Any], tuple[str, Any]]


def _history_from_te(history: ArrayLike) -> Array:
    history = jnp.asarray(history, jnp.float32)
    # TE: [0, oldest, ..., newest] -> te_flax: [newest, ..., oldest, 0]
    return jnp.concatenate([history[1:][::-1], jnp.zeros((1,), jnp.float32)])


def _history_to_te(history: ArrayLike) -> Array:
    history = jnp.asarray(history, jnp.float32)
    # te_flax: [newest, ..., oldest kept] -> TE: [0, ..., newest] (TE's slot 0 is cleared)
    return jnp.concatenate([jnp.zeros((1,), jnp.float32), history[:-1][::-1]])


def _convert_leaves(tree: _Tree, convert: _LeafConverter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out[key] = _convert_leaves(value, convert)
        else:
            new_key, new_value = convert(key, value)
            out[new_key] = new_value
    return out


def _check_history(name: str, value: ArrayLike) -> None:
    if jnp.ndim(value) != 1 or jnp.size(value) < 1:
        raise ValueError(
            f"FP8 variable {name!r} has shape {jnp.shape(value)}, but an amax history is 1-D "
            "[amax_history_len]; pass the variable dict as the model stores it"
        )


def _from_te_leaf(name: str, value: ArrayLike) -> tuple[str, Array]:
    if name.endswith(_HISTORY):
        _check_history(name, value)
        return name, _history_from_te(value)
    if name.endswith(_TE_SCALE):
        scale = jnp.asarray(value, jnp.float32)
        return name[: -len(_TE_SCALE)] + _SCALE_INV, 1.0 / scale
    raise ValueError(
        f"unexpected FP8 variable {name!r} in {TE_FP8_COLLECTION!r}: TE's delayed-scaling state "
        f"has only '*{_TE_SCALE}' and '*{_HISTORY}' variables"
    )


def _to_te_leaf(name: str, value: ArrayLike) -> tuple[str, Array]:
    if name.endswith(_HISTORY):
        _check_history(name, value)
        return name, _history_to_te(value)
    if name.endswith(_SCALE_INV):
        scale_inv = jnp.asarray(value, jnp.float32)
        return name[: -len(_SCALE_INV)] + _TE_SCALE, 1.0 / scale_inv
    raise ValueError(
        f"unexpected FP8 variable {name!r} in {OVERWRITE_WITH_GRADIENT!r}: te_flax's FP8 state "
        f"has only '*{_SCALE_INV}' and '*{_HISTORY}' variables"
    )


def _convert(variables: _Tree, source: str, target: str, convert: _LeafConverter) -> dict[str, Any]:
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables must be a mapping of collections, got {type(variables)}; pass the whole "
            "variable dict, e.g. {'params': ..., 'fp8_metas': ...}"
        )
    if target in variables:
        raise ValueError(
            f"variables already hold a {target!r} collection; nothing to convert into (the tree "
            "is already converted: pass it as it is)"
        )
    if "params" not in variables and source not in variables:
        raise ValueError(
            f"variables hold neither 'params' nor {source!r} (got {sorted(variables)}); pass the "
            f"whole variable dict, e.g. {{'params': ..., {source!r}: ...}}, not one collection"
        )
    out = {name: tree for name, tree in variables.items() if name != source}
    if source in variables:
        out[target] = _convert_leaves(variables[source], convert)
    if "params" in out:
        out["params"] = _move_attention_sinks(out["params"], to_te=source != TE_FP8_COLLECTION)
    return out


# TE keeps the learned attention sink (``softmax_type="learnable"``) in its attention backend's
# submodule, whose name depends on the backend it picked (fused on GPUs, unfused elsewhere),
# and under a ``DotProductAttention_0`` inside ``MultiHeadAttention``; te_flax keeps it on the
# attention module itself. Towards TE the unfused backend's name is used (a GPU run of TE
# names it ``_FusedDotProductAttention_0``).
_SINK = "softmax_offset"
_TE_BACKENDS = ("_UnfusedDotProductAttention_0", "_FusedDotProductAttention_0")
_TE_ATTENTION = "DotProductAttention_0"


def _move_attention_sinks(params: Any, to_te: bool) -> Any:
    if not isinstance(params, Mapping):
        return params
    out = {key: _move_attention_sinks(value, to_te) for key, value in params.items()}
    if to_te and _SINK in out:
        sink = {_TE_BACKENDS[0]: {_SINK: out.pop(_SINK)}}
        projections = {"qkv", "query", "out"} & set(out)  # a MultiHeadAttention
        out.update({_TE_ATTENTION: sink} if projections else sink)
    elif not to_te:
        # Bottom-up: the backend's submodule is lifted into DotProductAttention_0 first, then
        # that into the MultiHeadAttention.
        for wrapper in (*_TE_BACKENDS, _TE_ATTENTION):
            inner = out.get(wrapper)
            if isinstance(inner, Mapping) and set(inner) == {_SINK}:
                out[_SINK] = out.pop(wrapper)[_SINK]
    return out


def from_transformer_engine(variables: Mapping[str, Any]) -> dict[str, Any]:
    """A TE Linen variable tree (``params`` + ``fp8_metas``) as a te_flax one.

    Collections other than ``fp8_metas`` are copied unchanged.
    """
    return _convert(variables, TE_FP8_COLLECTION, OVERWRITE_WITH_GRADIENT, _from_te_leaf)


def to_transformer_engine(variables: Mapping[str, Any]) -> dict[str, Any]:
    """A te_flax variable tree (``params`` + ``_overwrite_with_gradient``) as a TE Linen one."""
    return _convert(variables, OVERWRITE_WITH_GRADIENT, TE_FP8_COLLECTION, _to_te_leaf)


# ---------------------------------------------------------------------------------------------
# Migrating a te_flax checkpoint's FP8 state to another recipe.

_MIGRATE = "te_flax.convert.migrate_fp8_state"
_MAX_LISTED = 3  # variables named per kind of difference in an error


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """A nested mapping as {path: leaf}; an empty mapping (or None) contributes no leaf."""
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, (*prefix, str(key))))
    return flat


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _listed(paths: list[tuple[str, ...]]) -> str:
    names = ", ".join(_name(path) for path in paths[:_MAX_LISTED])
    more = len(paths) - _MAX_LISTED
    return f"{names} and {more} more" if more > 0 else names


def _fresh(path: tuple[str, ...], like: Any) -> Array:
    """A freshly initialised FP8 variable shaped like ``like``: what a model's init gives."""
    name = path[-1]
    if name.endswith(_HISTORY):
        return jnp.zeros(like.shape, like.dtype)  # no amax seen yet
    if name.endswith(_SCALE_INV):
        return jnp.ones(like.shape, like.dtype)  # the first step quantizes with scale 1
    raise ValueError(
        f"cannot initialise the FP8 variable {_name(path)!r}: te_flax's FP8 state has only "
        f"'*{_SCALE_INV}' and '*{_HISTORY}' variables"
    )


def _resize_history(history: ArrayLike, length: int) -> Array:
    # Newest first along the last axis ([..., L], a leading layer axis under nn.scan): keep the
    # newest `length` entries; a longer history gets empty (0) slots at its old end.
    history = jnp.asarray(history)
    kept = history[..., :length]
    missing = length - kept.shape[-1]
    if missing <= 0:
        return kept
    padding = jnp.zeros((*history.shape[:-1], missing), history.dtype)
    return jnp.concatenate([kept, padding], axis=-1)


def _check_other_collections(variables: _Tree, target: _Tree) -> None:
    """Everything but the FP8 state must already fit: only FP8 state is migrated."""
    saved = _flatten({k: v for k, v in variables.items() if k != OVERWRITE_WITH_GRADIENT})
    wanted = _flatten({k: v for k, v in target.items() if k != OVERWRITE_WITH_GRADIENT})
    problems = []
    if missing := sorted(wanted.keys() - saved.keys()):
        problems.append(f"the model has {_listed(missing)}, which the checkpoint lacks")
    if extra := sorted(saved.keys() - wanted.keys()):
        problems.append(f"the checkpoint holds {_listed(extra)}, which the model lacks")
    reshaped = [
        f"{_name(path)} has shape {tuple(saved[path].shape)} in the checkpoint but "
        f"{tuple(wanted[path].shape)} in the model"
        for path in sorted(saved.keys() & wanted.keys())
        if tuple(saved[path].shape) != tuple(wanted[path].shape)
    ]
    problems += reshaped[:_MAX_LISTED]
    if problems:
        raise ValueError(
            "the checkpoint's parameters do not fit the model: " + "; ".join(problems) + ". "
            f"{_MIGRATE} migrates only the FP8 state ({OVERWRITE_WITH_GRADIENT!r}); restore "
            "into a model of the saving run's architecture"
        )


class RecomputedFp8ScalesWarning(UserWarning):
    """``migrate_fp8_state`` recomputed scales of a checkpoint from their amax histories, and
    some came out other than saved: the checkpoint was written under another format, margin
    or ``amax_compute_algo`` (or another history length) than the model's recipe."""


# Scales this close to the recomputed ones count as the same: TE's checkpoints store the
# reciprocal (1 / scale_inv, within one float32 ulp), nothing of a recipe's difference is
# smaller than a power of two or the ratio of two amaxes.
_SAME_SCALE_RTOL = 2.0**-20


def _described(recipe: Recipe) -> str:
    """A recipe as its class and the fields a delayed-scaling scale depends on."""
    if not isinstance(recipe, DelayedScaling):
        return type(recipe).__name__ + "()"
    return (
        f"DelayedScaling(fp8_format=Format.{recipe.fp8_format.name}, margin={recipe.margin}, "
        f"amax_compute_algo={recipe.amax_compute_algo!r}, "
        f"amax_history_len={recipe.amax_history_len})"
    )


def _delayed_pairs(
    flat: Mapping[tuple[str, ...], Any],
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """``(history path, scale_inv path)`` of each delayed-scaling state in a flat FP8 tree."""
    pairs = []
    for path in sorted(flat):
        if path[-1].endswith(_HISTORY):
            scale = (*path[:-1], path[-1][: -len(_HISTORY)] + _SCALE_INV)
            if scale in flat:
                pairs.append((path, scale))
    return pairs


def _check_recipe(recipe: Recipe | None, wanted: Mapping[tuple[str, ...], Any]) -> str | None:
    """Why ``recipe`` cannot recompute the model's delayed-scaling state, or None."""
    pairs = _delayed_pairs(wanted)
    if not pairs:
        if isinstance(recipe, DelayedScaling):
            return (
                f"recipe={_described(recipe)} keeps delayed-scaling state, but the model holds "
                "none; pass the model's own recipe (or leave recipe out for a model without FP8 "
                "state)"
            )
        return None
    if recipe is None:
        return (
            f"the model keeps delayed-scaling state ({_listed([p for p, _ in pairs])}), whose "
            "scale_inv the saving run's recipe computed from its format, margin and "
            "amax_compute_algo; the checkpoint does not record them (a checkpoint written "
            "under Format.HYBRID restored into an E4M3 model has gradient scales 128x too "
            f"small). Pass the model's recipe: {_MIGRATE}(..., recipe=DelayedScaling(...)) "
            "recomputes each scale_inv from its amax history under it"
        )
    if not isinstance(recipe, DelayedScaling):
        return (
            f"recipe={_described(recipe)} keeps no FP8 state, but the model keeps "
            "delayed-scaling state: pass the DelayedScaling recipe the model runs with"
        )
    lengths = sorted({int(wanted[path].shape[-1]) for path, _ in pairs})
    if lengths != [recipe.amax_history_len]:
        return (
            f"recipe has amax_history_len={recipe.amax_history_len}, but the model's amax "
            f"histories have length {', '.join(map(str, lengths))}: pass the recipe the model "
            "was built with"
        )
    return None


def _recompute_scales(
    fitted: dict[tuple[str, ...], Any], recipe: DelayedScaling
) -> dict[tuple[str, ...], Any]:
    """``fitted`` with each ``scale_inv`` recomputed from its history under ``recipe``, and a
    warning naming the scales that changed (where the values are concrete)."""
    out = dict(fitted)
    changed: list[tuple[str, float]] = []
    for history_path, scale_path in _delayed_pairs(fitted):
        saved = fitted[scale_path]
        new = scale_inv_from_history(scale_path[-1], fitted[history_path], saved, recipe)
        out[scale_path] = new.astype(jnp.result_type(saved))
        if isinstance(new, jax.core.Tracer) or isinstance(saved, jax.core.Tracer):
            continue
        ratio = np.asarray(new, np.float64) / np.asarray(saved, np.float64)
        worst = float(ratio.flat[np.argmax(np.abs(np.log2(ratio)))])
        if abs(worst - 1.0) > _SAME_SCALE_RTOL:
            changed.append((_name(scale_path), worst))
    if changed:
        examples = ", ".join(f"{name} x{factor:.6g}" for name, factor in changed[:_MAX_LISTED])
        if len(changed) > _MAX_LISTED:
            examples += ", ..."
        warnings.warn(
            f"{_MIGRATE} recomputed the scale_inv of the checkpoint's delayed-scaling state "
            f"from its amax histories under the model's recipe {_described(recipe)}: "
            f"{len(changed)} of {len(_delayed_pairs(fitted))} changed ({examples}), so "
            "the checkpoint was written under another format, margin, amax_compute_algo "
            "or amax_history_len. The returned state quantizes the next step as the model's "
            "recipe would have.",
            RecomputedFp8ScalesWarning,
            stacklevel=3,
        )
    return out


def migrate_fp8_state(
    variables: Mapping[str, Any],
    target: Mapping[str, Any],
    *,
    recipe: Recipe | None = None,
    resize_history: bool = False,
    init_missing: bool = False,
    drop_extra: bool = False,
) -> dict[str, Any]:
    """A restored variable tree with its FP8 state fitted to ``target``'s, as asked.

    The FP8 state (the ``_overwrite_with_gradient`` collection) of a checkpoint fits a model
    only if the saving run used the same kind of recipe and ``amax_history_len``. With every
    option off this function checks that, returns the variables unchanged when they fit, and
    otherwise raises an error naming each difference and the option that resolves it. The
    other collections (``params``, ...) must already match ``target``: they are checked and
    copied, never changed.

    A delayed-scaling ``scale_inv`` is a function of its amax history and of the recipe
    (``amax * 2**margin / fp8_max``, amax the history's maximum or newest entry), and the
    checkpoint does not record the recipe: restored into a model of another format (the
    gradients' e5m2 of ``Format.HYBRID`` against e4m3 of ``Format.E4M3``: a factor of 128),
    margin or ``amax_compute_algo``, the saved scales would quantize the first step wrongly.
    So where the model keeps delayed-scaling state, ``recipe`` (the model's) is required, and
    every ``scale_inv`` is recomputed from its (resized) history under it, exactly as the
    recipe's update rule computes it; where that changes a scale a
    ``RecomputedFp8ScalesWarning`` says so (for concrete values; under ``jax.eval_shape``
    nothing is read).

    Args:
      variables: the restored variables, ``{collection: nested mapping of arrays}``.
      target: the variables of the model to resume, or their abstract version
        (``jax.eval_shape(model.init, ...)``, anything with ``shape`` and ``dtype``): only
        structure, shapes and dtypes are read. Logical-partitioning boxes (Linen's
        ``init`` output) are unboxed, in both trees.
      recipe: the model's recipe; required (a ``DelayedScaling`` with the model's
        ``amax_history_len``) where the model keeps delayed-scaling state, whose scales are
        recomputed under it. A state whose history holds no amax keeps its saved scale (it
        was set before the history's window). Current scaling and the block-scaled recipes
        keep no state: for them, and for a model without FP8, it may be left out.
      resize_history: when an ``*_amax_history`` (``[..., L]``, newest entry first) has another
        length than the target's, keep its newest entries; a longer history is padded with
        empty (0) entries at its old end. Default False.
      init_missing: FP8 variables of ``target`` the checkpoint lacks (it was saved without
        FP8, or with a recipe that keeps no state, such as current or block scaling) start as
        a freshly initialised model's do: ``scale_inv = 1`` and an empty (0) history.
        Default False.
      drop_extra: FP8 variables the checkpoint holds but ``target`` does not (the model runs
        without FP8, or with a recipe that keeps no state) are dropped. Default False.

    Returns:
      A new variable tree with ``target``'s structure and shapes.

    Raises:
      ValueError: a difference the options do not allow, or one no option resolves (other
        parameter shapes, another number of scanned layers); a model with delayed-scaling
        state and no ``recipe``, or a ``recipe`` that is not the model's.

    Example usage::

      >>> import jax.numpy as jnp
      >>> from te_flax.convert import migrate_fp8_state
      >>> from te_flax.quantize import DelayedScaling
      >>> saved = {"params": {"kernel": jnp.ones((2, 2))},
      ...          "_overwrite_with_gradient": {"x_amax_history": jnp.array([3.0, 2.0, 1.0]),
      ...                                       "x_scale_inv": jnp.array([0.5])}}
      >>> target = {"params": {"kernel": jnp.zeros((2, 2))},
      ...           "_overwrite_with_gradient": {"x_amax_history": jnp.zeros(2),
      ...                                        "x_scale_inv": jnp.ones(1)}}
      >>> recipe = DelayedScaling(amax_history_len=2)
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as said:  # the saved scale is recomputed
      ...     warnings.simplefilter("always")
      ...     fitted = migrate_fp8_state(saved, target, recipe=recipe, resize_history=True)
      >>> [type(w.message).__name__ for w in said]  # e4m3: the max of the two entries left
      ['RecomputedFp8ScalesWarning']
      >>> fitted["_overwrite_with_gradient"]["x_amax_history"]  # the two newest entries
      Array([3., 2.], dtype=float32)
      >>> round(float(fitted["_overwrite_with_gradient"]["x_scale_inv"][0] * 448.0), 4)
      3.0
    """
    for arg_name, tree in (("variables", variables), ("target", target)):
        if not isinstance(tree, Mapping):
            raise TypeError(
                f"{arg_name} must be a mapping of collections (e.g. {{'params': ...}}), "
                f"got {type(tree).__name__}"
            )
    variables, target = meta.unbox(dict(variables)), meta.unbox(dict(target))
    _check_other_collections(variables, target)
    saved = _flatten(variables.get(OVERWRITE_WITH_GRADIENT))
    wanted = _flatten(target.get(OVERWRITE_WITH_GRADIENT))

    fitted: dict[tuple[str, ...], Any] = {}
    resized, reshaped = [], []
    for path in sorted(saved.keys() & wanted.keys()):
        value, like = saved[path], wanted[path]
        shape, wanted_shape = tuple(value.shape), tuple(like.shape)
        if shape == wanted_shape:
            fitted[path] = value
        elif path[-1].endswith(_HISTORY) and shape[:-1] == wanted_shape[:-1]:
            resized.append(path)
            fitted[path] = _resize_history(value, wanted_shape[-1])
        else:
            reshaped.append(f"{_name(path)} has shape {shape} in the checkpoint, {wanted_shape}")
    missing = sorted(wanted.keys() - saved.keys())
    extra = sorted(saved.keys() - wanted.keys())

    problems = []
    if reshaped:
        problems.append(
            "FP8 state shaped for another model (another number of scanned layers?): "
            + "; ".join(reshaped[:_MAX_LISTED])
            + " in the model; no migration changes that"
        )
    if resized and not resize_history:
        path = resized[0]
        saved_length, wanted_length = saved[path].shape[-1], wanted[path].shape[-1]
        problems.append(
            f"{_name(path)} has length {saved_length} in the checkpoint but the model's recipe "
            f"uses amax_history_len={wanted_length} ({len(resized)} histories differ); "
            f"migrate with {_MIGRATE}(..., resize_history=True), which keeps the newest "
            f"{min(saved_length, wanted_length)} entries"
        )
    if missing and not init_missing:
        problems.append(
            f"the model keeps {len(missing)} FP8 variables the checkpoint lacks "
            f"({_listed(missing)}): it was saved without FP8 or with a recipe that keeps no "
            "state (current or block scaling), while the model's recipe is delayed scaling; "
            f"migrate with {_MIGRATE}(..., init_missing=True), which starts them fresh"
        )
    if (recipe_problem := _check_recipe(recipe, wanted)) is not None:
        problems.append(recipe_problem)
    if extra and not drop_extra:
        problems.append(
            f"the checkpoint holds {len(extra)} FP8 variables the model does not keep "
            f"({_listed(extra)}): it was saved with delayed scaling, while the model runs "
            "without FP8 or with a recipe that keeps no state (current or block scaling); "
            f"migrate with {_MIGRATE}(..., drop_extra=True), which drops them"
        )
    if problems:
        raise ValueError(
            "the checkpoint's FP8 state does not fit the model: " + ". ".join(problems)
        )

    for path in missing:
        fitted[path] = _fresh(path, wanted[path])
    if isinstance(recipe, DelayedScaling) and _delayed_pairs(fitted):
        fitted = _recompute_scales(fitted, recipe)
    out = {name: tree for name, tree in variables.items() if name != OVERWRITE_WITH_GRADIENT}
    if OVERWRITE_WITH_GRADIENT in target:
        out[OVERWRITE_WITH_GRADIENT] = _unflatten(fitted)
    return out
