"""TransformerEngine's public JAX names as TE 2.20.2 has them: the list in
``tests/data/te_public_names.txt`` (which the tests without TE check docs/porting.md against) is
TE's, and every name docs/porting.md calls "same" takes TE's arguments.

Regenerate the list with TE installed: ``python -m tests.parity.test_te_names``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

pytest.importorskip(
    "transformer_engine.jax.flax", reason="needs TransformerEngine (scripts/parity)"
)

import transformer_engine.common.recipe as te_recipe
import transformer_engine.jax as te_jax

from tests.test_te_names import NAMES_FILE, read_names, resolve, status_rows, te_flax_path


def _module_names(module_name: str) -> list[str]:
    """A module's public names: its ``__all__``; else, for a package, every public attribute
    (its re-exports), and for a module, the public names it defines."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        names = list(module.__all__)
    else:
        package = hasattr(module, "__path__")
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (package or getattr(value, "__module__", module_name) == module_name)
        ]
    return [
        f"{module_name}.{name}"
        for name in names
        if not inspect.ismodule(getattr(module, name, None))
    ]


def public_names() -> list[str]:
    """Every public name of ``transformer_engine.jax`` and its importable public modules (a
    module that does not import here, such as the Triton extensions without Triton, is left
    out), then the recipes of ``transformer_engine.common.recipe``."""
    submodules = pkgutil.walk_packages(te_jax.__path__, "transformer_engine.jax.")
    modules = ["transformer_engine.jax", *sorted(info.name for info in submodules)]
    names: list[str] = []
    for module_name in modules:
        if any(part.startswith("_") for part in module_name.split(".")):
            continue
        try:
            importlib.import_module(module_name)
        except Exception:  # an optional extension (setup, Triton)
            continue
        names += _module_names(module_name)
    recipes = te_recipe.__name__
    return names + [
        f"{recipes}.{name}"
        for name, value in vars(te_recipe).items()
        if not name.startswith("_") and getattr(value, "__module__", "") == recipes
    ]


def test_the_list_is_tes_public_names():
    assert read_names() == public_names(), f"regenerate {NAMES_FILE.name}: see this module"


def _te_object(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _parameters(function) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


def test_same_names_take_tes_arguments():
    """A "same" function takes TE's parameters by name, in TE's order; te_flax may add
    parameters after them, with defaults."""
    wrong = {}
    for name, (status, _) in status_rows().items():
        theirs = _te_object(name) if status == "same" else None
        if not inspect.isfunction(theirs):
            continue
        ours = resolve(te_flax_path(name))
        expected = [p.name for p in _parameters(theirs)]
        got = _parameters(ours)
        extra_without_default = [p.name for p in got[len(expected) :] if p.default is p.empty]
        if [p.name for p in got[: len(expected)]] != expected or extra_without_default:
            wrong[name] = (expected, [p.name for p in got])
    assert not wrong, wrong


def _same_default(theirs: object, ours: object) -> bool:
    """Two defaults that mean the same: equal values, or TE's and te_flax's objects of the same
    kind (enums by name, collective-op sets by their ops, no-op quantizer sets)."""
    if theirs is inspect.Parameter.empty or ours is inspect.Parameter.empty:
        return theirs is ours
    if isinstance(theirs, tuple) and isinstance(ours, tuple):
        return len(theirs) == len(ours) and all(map(_same_default, theirs, ours))
    if hasattr(theirs, "forward") and hasattr(theirs, "backward"):  # CollectiveOpSet
        return (theirs.forward.name, theirs.backward.name) == (
            ours.forward.name,
            ours.backward.name,
        )
    if hasattr(theirs, "dgrad") and hasattr(theirs, "kernel"):  # QuantizerSet
        fields = ("x", "kernel", "dgrad")
        return all(getattr(theirs, f) is None and getattr(ours, f) is None for f in fields)
    if hasattr(theirs, "name") and hasattr(ours, "name"):
        return theirs.name == ours.name
    return bool(theirs == ours)


def _signature_differences(theirs, ours) -> list[str]:
    """TE's parameters missing from ours, out of order, of another kind or default; te_flax
    may add parameters after TE's, with defaults, and give a default to one TE requires (every
    call TE accepts is accepted the same)."""
    te_params, our_params = _parameters(theirs), _parameters(ours)
    problems = []
    for index, te_param in enumerate(te_params):
        if index >= len(our_params) or our_params[index].name != te_param.name:
            return [f"parameters {[p.name for p in our_params]}, TE {[p.name for p in te_params]}"]
        ours_param = our_params[index]
        if ours_param.kind != te_param.kind:
            problems.append(f"{te_param.name}: {ours_param.kind} (TE {te_param.kind})")
        required_by_te = te_param.default is inspect.Parameter.empty
        if not required_by_te and not _same_default(te_param.default, ours_param.default):
            problems.append(f"{te_param.name}={ours_param.default!r} (TE {te_param.default!r})")
    extra = [p.name for p in our_params[len(te_params) :] if p.default is p.empty]
    return problems + ([f"extra parameters without defaults: {extra}"] if extra else [])


def test_same_names_take_tes_defaults_and_calls():
    """Every "same" function has TE's defaults too, and every "same" Flax module's
    ``__call__`` TE's parameters, in TE's order, with TE's defaults."""
    wrong = {}
    for name, (status, _) in status_rows().items():
        if status != "same":
            continue
        theirs = _te_object(name)
        ours = resolve(te_flax_path(name))
        if inspect.isfunction(theirs):
            problems = _signature_differences(theirs, ours)
        elif inspect.isclass(theirs) and name.startswith("transformer_engine.jax.flax."):
            problems = _signature_differences(theirs.__call__, ours.__call__)
        else:
            continue
        if problems:
            wrong[name] = problems
    assert not wrong, wrong


if __name__ == "__main__":
    header = [
        "# TransformerEngine 2.20.2's public JAX names (and its recipes), one per line,",
        "# generated by `python -m tests.parity.test_te_names` with TransformerEngine installed.",
    ]
    Path(NAMES_FILE).write_text("\n".join(header + public_names()) + "\n")
