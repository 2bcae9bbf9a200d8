"""Sphinx configuration of te_flax's documentation site (built by ``scripts/docs``).

The API reference is generated at build time from the ``__all__`` of each public module
(``api/*.rst``, not committed), so a new public name appears without editing the docs. The
figure of the FP8-state page is drawn by ``docs/fp8_state_figure.py`` at build time.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # te_flax from this checkout, and bench/ for its results
sys.path.insert(0, str(DOCS))
# The build draws a figure with JAX; it needs no accelerator (and must not try to start one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen  # noqa: E402

import te_flax  # noqa: E402

project = "te_flax"
author = "te_flax authors"
copyright = "te_flax authors"
release = te_flax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "example_results", "README.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"te_flax {release}"

# Google-style docstrings (STYLE.md). "Attributes:" become a field list, not attribute
# entries that would describe a dataclass field a second time.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
napoleon_attr_annotations = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # `zeros`, not `<function zeros at 0x...>`

# Every cross-reference must resolve (the docs test builds with -W -n). References to the
# libraries te_flax builds on cannot resolve offline (no intersphinx), so those are allowed.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|flax|optax|orbax|numpy|np|jnp|ml_dtypes|typing|collections)(\..*)?"),
    (r"py:.*", r"(Array|ArrayLike|DTypeLike|PRNGKey|PartitionSpec|Mesh|Any|Callable|Sequence)"),
    (r"py:.*", r"(Mapping|Iterator|Iterable|Hashable|TypeVar|T|NamedTuple|Enum|Path|pathlib\..*)"),
    (r"py:.*", r"(enum|dataclasses|contextlib|abc|builtins)\..*"),
    # Private aliases and type variables in signatures (``Initializer``, ``T``, ``_layers.*``).
    (r"py:.*", r"(Initializer|LogicalAxes|(te_flax\..*\.)?T|te_flax\.(.*\.)?_.*)"),
    # The attention's callback type, written through the module's import alias.
    (r"py:.*", r"(attn\.)?ScoreMod"),
]

# The public modules whose ``__all__`` the API reference documents, in the reference's order.
API_MODULES = [
    "te_flax",
    "te_flax.linen",
    "te_flax.nnx",
    "te_flax.quantize",
    "te_flax.training",
    "te_flax.accumulate",
    "te_flax.convert",
    "te_flax.sharding",
    "te_flax.layernorm_dense",
    "te_flax.layernorm_mlp",
    "te_flax.dense",
    "te_flax.layernorm",
    "te_flax.attention",
    "te_flax.inject",
    "te_flax.activation",
    "te_flax.collective",
    "te_flax.router",
    "te_flax.permutation",
    "te_flax.moe",
    "te_flax.ep",
]


# Constants shown with their value; others (a quantizer set, a path) only by name.
_LITERALS = (str, int, float, bool, tuple)


def _directive(obj: object) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


def _summary(obj: object) -> str:
    """The first paragraph of an object's own docstring (a constant's is its type's, so none)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)):
        return ""
    paragraph = (inspect.getdoc(obj) or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def module_page(name: str, documented: dict[int, str]) -> str:
    """The reST page of one public module: its docstring, a summary table, every public name.

    ``documented`` maps the id of each object already described on an earlier page to its
    public name there: a name that re-exports it links to that description.
    """
    module = importlib.import_module(name)
    names = list(getattr(module, "__all__", []))
    lines = [name, "=" * len(name), "", f".. automodule:: {name}", "   :no-members:", ""]
    if names:
        lines += [".. list-table::", "   :widths: 30 70", ""]
        for n in names:
            obj = getattr(module, n)
            target = documented.get(id(obj), f"{name}.{n}")
            lines += [f"   * - :py:obj:`{n} <{target}>`", f"     - {_summary(obj)}"]
        lines.append("")
    for n in names:
        obj = getattr(module, n)
        if id(obj) in documented and (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue  # described once, where it is first exported
        if inspect.isclass(obj) or inspect.isroutine(obj):
            documented[id(obj)] = f"{name}.{n}"
        directive = _directive(obj)
        lines.append(f".. {directive}:: {name}.{n}")
        if directive == "autoclass":
            lines.append("   :members:")
            if dataclasses.is_dataclass(obj):  # its fields: the Attributes section has them
                fields = [field.name for field in dataclasses.fields(obj)]
                lines.append(f"   :exclude-members: {', '.join(fields)}")
        if directive == "autodata" and not isinstance(obj, _LITERALS):
            lines += ["   :no-value:", "   :annotation:"]
        lines.append("")
    return "\n".join(lines)


def write_api_pages(app) -> None:
    api = DOCS / "api"
    api.mkdir(exist_ok=True)
    for stale in set(api.glob("*.rst")) - {api / f"{name}.rst" for name in API_MODULES}:
        stale.unlink()  # a module no longer documented
    documented: dict[int, str] = {}
    for name in API_MODULES:
        page = api / f"{name}.rst"
        text = module_page(name, documented)
        if not page.exists() or page.read_text() != text:  # unchanged pages keep Sphinx's cache
            page.write_text(text)


def _attributes_as_definitions(lines: list[str]) -> None:
    """Rewrites a Google-style ``Attributes:`` section into a reST definition list, in place.

    te_flax's modules document several attributes in one entry (``scale_init, scale_axes: ...``)
    and defaults in parentheses, which napoleon would read as types; a definition list keeps the
    text as written.
    """
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "Attributes:":
            out.append(lines[i])
            i += 1
            continue
        base = len(lines[i]) - len(lines[i].lstrip())
        i += 1
        entries: list[list[str]] = []
        entry_indent = None  # the indent of the first entry: each entry starts at it
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            text = lines[i].strip()
            if text and entry_indent is None:
                entry_indent = _indent(lines[i])
            if text and _indent(lines[i]) == entry_indent:
                entries.append([text])
            elif text:
                entries[-1].append(text)
            i += 1
        out += [" " * base + ".. rubric:: Attributes", ""]
        for entry in entries:
            joined = " ".join(entry)
            term, definition = _split_term(joined)
            out += [" " * base + term, " " * (base + 3) + definition, ""]
    lines[:] = out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_term(entry: str) -> tuple[str, str]:
    """``names: description`` split at the first colon outside ````literals````."""
    in_literal = False
    for position, char in enumerate(entry):
        if entry.startswith("``", position):
            in_literal = not in_literal
        if char == ":" and not in_literal and entry[position + 1 : position + 2] in (" ", ""):
            return entry[:position], entry[position + 1 :].strip()
    return entry, ""


def process_docstring(app, what, name, obj, options, lines) -> None:
    type_doc = inspect.getdoc(type(obj)) or ""
    if what == "data" and lines and type_doc and lines[0].strip() == type_doc.splitlines()[0]:
        # A constant has no docstring of its own; autodoc would show its type's.
        lines[:] = [] if isinstance(obj, _LITERALS) else [f"A ``{type(obj).__name__}``."]
    _attributes_as_definitions(lines)


def _default_text(value: object) -> str:
    text = repr(value)
    if text.startswith("<"):  # a function or dtype: its name, so the signature stays Python
        return getattr(value, "__name__", type(value).__name__)
    return text


def process_signature(app, what, name, obj, options, signature, return_annotation):
    """Class signatures without Flax's ``parent``/``name`` fields and ``<function ...>`` reprs.

    A default such as ``<function zeros at 0x...>`` is not Python, and Sphinx would then split
    the signature at every comma, annotations included.
    """
    if what != "class" or signature is None:
        return None
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    parts = []
    for parameter in parameters:
        if parameter.name in ("parent", "name") and issubclass(obj, flax.linen.Module):
            continue  # Flax's own fields of every Linen module
        part = parameter.name
        if parameter.kind is parameter.VAR_KEYWORD:
            part = "**" + part
        elif parameter.kind is parameter.VAR_POSITIONAL:
            part = "*" + part
        if parameter.annotation is not parameter.empty:
            annotation = parameter.annotation
            # An NNX module's signature holds types (``described_by``), a Linen one strings.
            part += ": " + inspect.formatannotation(annotation)
        if parameter.default is not parameter.empty:
            part += " = " + _default_text(parameter.default)
        parts.append(part)
    return "(" + ", ".join(parts) + ")", return_annotation


def draw_figures(app) -> None:
    import fp8_state_figure

    static = DOCS / "_static"
    static.mkdir(exist_ok=True)
    fp8_state_figure.draw(static / "fp8_state_flow.png")


def setup(app):
    app.connect("builder-inited", write_api_pages)
    app.connect("builder-inited", draw_figures)
    # Before napoleon (priority 500), which would otherwise parse the Attributes sections.
    app.connect("autodoc-process-docstring", process_docstring, priority=400)
    app.connect("autodoc-process-signature", process_signature)
    return {"parallel_read_safe": True}
