"""TransformerEngine's import paths served by te_flax on request (``as_transformer_engine``).

Once switched on, ``import transformer_engine.jax`` (``.flax``, ``.quantize``, ``.sharding``,
``.moe``, ... and ``transformer_engine.common.recipe``) gives modules whose names are te_flax's
own objects, so that a framework written against TransformerEngine (MaxText, for one) runs on
te_flax without an edit. A module serves:

- every name docs/porting.md marks ``same``, at TE's path read as te_flax's
  (``transformer_engine.jax`` -> ``te_flax``, ``transformer_engine.jax.flax`` -> ``te_flax.linen``,
  ``transformer_engine.common.recipe`` -> ``te_flax.quantize``);
- the ``different`` names whose te_flax counterpart takes the same arguments and means the same
  (``DROP_INS``: the collective-op sets of ``cpp_extensions``, the axis names of
  ``flax.transformer``, ...), and TE's few names outside its modules' ``__all__`` that frameworks
  call (``EXTRAS``);
- its TransformerEngine submodules, as TE's packages import theirs.

Any other TransformerEngine name raises ``TransformerEngineNameError`` (an ``ImportError``, so
that ``from ... import name`` shows it), which names the name's row in docs/porting.md with its
status and note, read from the copy of that table this package ships
(``transformer_engine_names.tsv``, checked against the document by the tests).

How: an importlib meta-path finder, first on ``sys.meta_path``, answers every module under
``transformer_engine`` with a ``TransformerEngineModule``. It never shadows TransformerEngine
without saying so: it refuses to switch on where ``transformer_engine`` is already imported, and
where it is installed unless asked to (``shadow_installed=True``, which warns).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.resources
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "DROP_INS",
    "ENVIRONMENT_VARIABLE",
    "EXTRAS",
    "ShadowedTransformerEngineWarning",
    "TransformerEngineModule",
    "TransformerEngineNameError",
    "as_transformer_engine",
    "from_environment",
    "te_flax_path",
    "transformer_engine_served",
]

TOP = "transformer_engine"
ENVIRONMENT_VARIABLE = "TE_FLAX_AS_TRANSFORMER_ENGINE"
TABLE = "transformer_engine_names.tsv"
SECTION = "docs/porting.md, 'Every TransformerEngine JAX name'"
# TE's module prefixes and te_flax's, most specific first (docs/porting.md's reading of "same").
PATHS = (
    ("transformer_engine.jax.flax", "te_flax.linen"),
    ("transformer_engine.common.recipe", "te_flax.quantize"),
    ("transformer_engine.jax", "te_flax"),
)
_AXES = ("BATCH", "SEQLEN", "SEQLEN_TP", "HEAD", "HIDDEN", "HIDDEN_TP", "JOINED")
_W_AXES = ("W_NO_SHARD", "W_FSDP", "W_TP", "W_JOINED")
_COLLECTIVES = ("CollectiveOp", "CollectiveOpSet", "noop_collective_op_set")
_COLLECTION = "te_flax.training.OVERWRITE_WITH_GRADIENT"
# "different" rows whose te_flax object takes TE's arguments and means the same: served there.
DROP_INS: dict[str, str] = {
    **{f"transformer_engine.jax.{module}NVTE_FP8_COLLECTION_NAME": _COLLECTION
       for module in ("", "quantize.", "quantize.helper.")},
    **{f"transformer_engine.jax.cpp_extensions.{module}{name}": f"te_flax.collective.{name}"
       for module in ("", "gemm.") for name in _COLLECTIVES},
    **{f"transformer_engine.jax.flax.transformer.{axes}_AXES": f"te_flax.sharding.{axes}_AXES"
       for axes in _AXES + _W_AXES},
    "transformer_engine.jax.flax.transformer.extend_logical_axis_rules":
        "te_flax.linen.extend_logical_axis_rules",
    "transformer_engine.jax.flax.transformer.rotary_pos_emb": "te_flax.attention.rotary_pos_emb",
    "transformer_engine.jax.quantize.fp8_autocast": "te_flax.fp8_autocast",
    "transformer_engine.jax.quantize.helper.fp8_autocast": "te_flax.fp8_autocast",
    "transformer_engine.jax.quantize.helper.autocast": "te_flax.autocast",
    "transformer_engine.jax.quantize.get_global_quantize_recipe":
        "te_flax.quantize.get_autocast_recipe",
    "transformer_engine.jax.quantize.helper.get_global_quantize_recipe":
        "te_flax.quantize.get_autocast_recipe",
    "transformer_engine.jax.quantize.metadata.QuantizeMeta": "te_flax.quantize.QuantizeMeta",
    "transformer_engine.jax.quantize.metadata.QuantizeMetaSet": "te_flax.quantize.QuantizeMetaSet",
    "transformer_engine.jax.quantize.misc.QuantizeLayout": "te_flax.quantize.QuantizeLayout",
}  # fmt: skip
# TransformerEngine names outside its modules' ``__all__`` (so without a row) that frameworks
# call: MaxText's te_moe_block records its bootstrap with this one.
EXTRAS: dict[str, str] = {
    "transformer_engine.jax.moe.record_ep_bootstrap_signature_for_moe": (
        "te_flax.moe.record_ep_bootstrap_signature_for_moe"
    ),
}


class Row(NamedTuple):
    """A row of docs/porting.md's table of TransformerEngine names."""

    name: str  # a TE name, or ``module.*`` for the names of a module without a row
    status: str  # same, different, refused or missing
    note: str


class TransformerEngineNameError(ImportError):
    """A TransformerEngine name te_flax does not serve at TE's path; names its porting row."""


class ShadowedTransformerEngineWarning(UserWarning):
    """te_flax stands in for an installed TransformerEngine (``shadow_installed=True``)."""


@functools.cache
def rows() -> dict[str, Row]:
    """docs/porting.md's table, as this package ships it: name -> row."""
    text = importlib.resources.files("te_flax").joinpath(TABLE).read_text(encoding="utf-8")
    table = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, status, note = line.split("\t")
            table[name] = Row(name, status, note)
    return table


@functools.cache
def _modules() -> tuple[frozenset[str], tuple[str, ...]]:
    """TransformerEngine's modules (every prefix of a name), and those a ``module.*`` row covers."""
    modules: set[str] = set()
    covered: list[str] = []
    for name in (*rows(), *EXTRAS):
        parts = name.split(".")
        modules.update(".".join(parts[:end]) for end in range(1, len(parts)))
        if parts[-1] == "*":
            covered.append(".".join(parts[:-1]))
    return frozenset(modules), tuple(covered)


def is_module(name: str) -> bool:
    """Whether ``name`` is one of TransformerEngine's modules (or inside a ``module.*`` row's)."""
    modules, covered = _modules()
    return name in modules or any(name.startswith(module + ".") for module in covered)


def te_flax_path(te_name: str) -> str:
    """``te_name``'s path in te_flax as docs/porting.md reads "same" (``transformer_engine.jax`` as
    ``te_flax``, ``transformer_engine.jax.flax`` as ``te_flax.linen``, TE's recipes as
    ``te_flax.quantize``)."""
    for theirs, ours in PATHS:
        if te_name == theirs or te_name.startswith(theirs + "."):
            return ours + te_name[len(theirs) :]
    raise ValueError(f"{te_name} is not a TransformerEngine JAX name")


def served_path(te_name: str) -> str | None:
    """The te_flax object serving ``te_name`` at TE's path (a dotted path), or None."""
    if te_name in DROP_INS:
        return DROP_INS[te_name]
    if te_name in EXTRAS:
        return EXTRAS[te_name]
    row = rows().get(te_name)
    return te_flax_path(te_name) if row is not None and row.status == "same" else None


def row_of(te_name: str) -> Row | None:
    """``te_name``'s own row, else the row of the innermost ``module.*`` that covers it."""
    if te_name in rows():
        return rows()[te_name]
    module = te_name
    while "." in module:
        module = module.rpartition(".")[0]
        if f"{module}.*" in rows():
            return rows()[f"{module}.*"]
    return None


def _resolve(path: str) -> Any:
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _refusal(te_name: str, row: Row) -> str:
    status = {
        "different": "te_flax does this another way",
        "refused": "te_flax refuses it",
        "missing": "te_flax does not have it yet",
        "same": "te_flax has it",
    }[row.status]
    return (
        f"{te_name} is not served at TransformerEngine's path by te_flax.as_transformer_engine(): "
        f"{status} ({SECTION}, row `{row.name}`: {row.status}{'; ' + row.note if row.note else ''})"
    )


class TransformerEngineModule(types.ModuleType):
    """A module at a TransformerEngine path whose names are te_flax's objects."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        te_name = f"{self.__name__}.{name}"
        path = served_path(te_name)
        if path is not None:
            value = _resolve(path)
            setattr(self, name, value)
            return value
        if te_name in _modules()[0]:  # a submodule, as TE's packages import theirs
            return importlib.import_module(te_name)
        row = row_of(te_name)
        if row is not None:
            raise TransformerEngineNameError(_refusal(te_name, row), name=self.__name__)
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {name!r}: TransformerEngine 2.20.2's "
            f"public JAX names ({SECTION}) do not include {te_name}"
        )

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.served_names(), *self.submodules()})

    def served_names(self) -> list[str]:
        """The names this module serves (its ``__all__``)."""
        names = [*rows(), *DROP_INS, *EXTRAS]
        return sorted(
            {n.rpartition(".")[2] for n in names if n.rpartition(".")[0] == self.__name__} - {"*"}
        )

    def submodules(self) -> list[str]:
        modules, _ = _modules()
        prefix = self.__name__ + "."
        return sorted({m[len(prefix) :] for m in modules if m.startswith(prefix)} - {""})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every TransformerEngine module name with a ``TransformerEngineModule``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TOP and not fullname.startswith(TOP + "."):
            return None
        if not is_module(fullname):
            return None  # "No module named ...": TE 2.20.2's JAX API has no such module
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return TransformerEngineModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        assert isinstance(module, TransformerEngineModule)
        module.__path__ = []  # a package: its submodules come from this finder only
        served = [name for name in module.served_names() if _is_served(module, name)]
        module.__dict__["__all__"] = served


def _is_served(module: types.ModuleType, name: str) -> bool:
    return served_path(f"{module.__name__}.{name}") is not None


_FINDER = _Finder()


def transformer_engine_served() -> bool:
    """Whether te_flax serves TransformerEngine's import paths in this process."""
    return _FINDER in sys.meta_path


def _imported_transformer_engine() -> list[str]:
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if (name == TOP or name.startswith(TOP + "."))
        and not isinstance(module, TransformerEngineModule)
    )


def as_transformer_engine(enabled: bool = True, *, shadow_installed: bool = False) -> None:
    """Serves TransformerEngine's JAX import paths from te_flax in this process (opt-in).

    Call it before the framework imports ``transformer_engine``; after it, ``import
    transformer_engine.jax.flax as te_flax_linen`` and the like give te_flax's objects: every
    name docs/porting.md maps, at TE's path; any other TransformerEngine name raises
    ``TransformerEngineNameError`` naming its porting row. The same switch:
    ``TE_FLAX_AS_TRANSFORMER_ENGINE=1`` before ``import te_flax``, or ``python -m te_flax run``.

    Args:
      enabled: True (default) switches on; False switches off and forgets the modules served
        (objects already imported from them stay what they are).
      shadow_installed: where TransformerEngine itself is installed, te_flax refuses to hide it
        unless this is True (default False); then it warns
        (``ShadowedTransformerEngineWarning``) and serves the paths anyway.

    Raises:
      RuntimeError: ``transformer_engine`` is already imported (a process cannot hold both), or
        installed and ``shadow_installed`` is False.

    Example usage::

      >>> import te_flax
      >>> te_flax.as_transformer_engine()
      >>> import transformer_engine.jax.flax as te_nn
      >>> te_nn.DenseGeneral is te_flax.linen.DenseGeneral
      True
      >>> te_flax.as_transformer_engine(False)
    """
    if not enabled:
        while _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        for name, module in list(sys.modules.items()):
            if isinstance(module, TransformerEngineModule):
                del sys.modules[name]
        return
    if transformer_engine_served():
        return
    imported = _imported_transformer_engine()
    if imported:
        origin = getattr(sys.modules[imported[0]], "__file__", None)
        raise RuntimeError(
            f"TransformerEngine is already imported ({imported[0]} from {origin}): te_flax "
            "cannot stand in for it in this process; switch te_flax on before anything imports "
            f"transformer_engine (te_flax.as_transformer_engine() first, {ENVIRONMENT_VARIABLE}=1 "
            "before import te_flax, or python -m te_flax run ...)"
        )
    installed = importlib.util.find_spec(TOP)
    if installed is not None:
        where = installed.origin or list(installed.submodule_search_locations or [])
        if not shadow_installed:
            raise RuntimeError(
                f"TransformerEngine is installed here ({where}): te_flax.as_transformer_engine() "
                "would hide it; pass shadow_installed=True to serve TE's import paths from te_flax "
                "anyway (python -m te_flax run --shadow-installed), or use an environment "
                "without TransformerEngine"
            )
        warnings.warn(
            f"te_flax serves TransformerEngine's import paths in this process: the "
            f"TransformerEngine installed at {where} is hidden (shadow_installed=True)",
            ShadowedTransformerEngineWarning,
            stacklevel=2,
        )
    sys.meta_path.insert(0, _FINDER)


def from_environment() -> None:
    """Switches on when ``TE_FLAX_AS_TRANSFORMER_ENGINE`` is ``1`` (``import te_flax`` calls it)."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={value!r}: set it to 1 to serve TransformerEngine's import "
            "paths from te_flax, or unset it (0 or empty: off)"
        )
    as_transformer_engine()
