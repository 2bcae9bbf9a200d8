"""Matrix products of models written with stock Flax layers, run as te_flax FP8 GEMMs.

One mechanism serves ``make_dot_general_cls`` (Linen), ``te_flax.nnx.DotGeneral`` and
``te_flax.quantize_model``: a product (``lax.dot_general``, ``jnp.einsum``, ``jnp.dot``,
``jnp.matmul``) is planned as ``dense`` of a transposed pair of operands (x's contracted axes
last, the kernel's first), run through ``dense``'s custom_vjp with a quantizer set built from
FP8 state that the caller keeps, and transposed back to the product's own output layout. The
quantizers, the FP8 state and its max-merge rule are those of te_flax's layers.

For ``quantize_model``, a ``Session`` is one trace of a model: the front ends' hooks (Flax's
method interceptor for Linen, the layers' product attributes for NNX) hand it each layer's
product with the running module (a ``Frame``), and it decides whether and how the product is
quantized. ``intercepting`` is the fallback for products written as bare ``jnp`` / ``lax``
calls in a module's ``__call__``, which no Flax hook sees: it replaces the four public product
functions for the whole process while a model runs, and hands each call to the innermost
running module's session.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from te_flax.dense import dense
from te_flax.quantize import (
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerSet,
    Recipe,
)
from te_flax.quantize.block_scaling import MXFP8_BLOCK, NVFP4_BLOCK

__all__ = [
    "LAYER",
    "OPS",
    "Frame",
    "Plan",
    "QuantizeModelNote",
    "Record",
    "Selection",
    "Session",
    "bare_fallback",
    "fp8_reason",
    "innermost",
    "intercepting",
    "layer_product",
    "note_once",
    "original",
    "plan_product",
    "postfix",
    "run_plan",
    "running",
]

T = TypeVar("T")

# The product functions a model's code may call, by the name rules use.
OPS = ("dot_general", "einsum", "dot", "matmul")

# cuBLASLt's FP8 GEMMs take sizes in multiples of 16.
_FP8_ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    """A product as ``dense``: operand permutations, contracted axes, output permutation."""

    lhs_perm: tuple[int, ...]  # lhs's free axes, then its contracted ones in order
    rhs_perm: tuple[int, ...]  # rhs's contracted axes in order, then its free ones
    n_contract: int
    out_perm: tuple[int, ...] | None  # dense's [lhs free..., rhs free...] -> the op's layout
    rows: int  # M: the product of lhs's free sizes
    contract: int  # K
    features: int  # N: the product of rhs's free sizes


def postfix(index: int) -> str:
    """The FP8 variable postfix of a module's ``index``-th product: ``""``, ``"_1"``, ..."""
    return "" if index == 0 else f"_{index}"


def _plan_dot_general(
    lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers: Any
) -> Plan | str:
    try:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        lhs_contract = tuple(int(d) % len(lhs_shape) for d in lhs_contract)
        rhs_contract = tuple(int(d) % len(rhs_shape) for d in rhs_contract)
    except (TypeError, ValueError, ZeroDivisionError):
        return f"dimension numbers {dimension_numbers!r} are not ((contract), (batch)) pairs"
    if len(lhs_batch) or len(rhs_batch):
        return "it has batch dimensions (a batched product, e.g. attention scores)"
    lhs_free = tuple(d for d in range(len(lhs_shape)) if d not in lhs_contract)
    rhs_free = tuple(d for d in range(len(rhs_shape)) if d not in rhs_contract)
    if not lhs_contract:
        return "it contracts no axis (an outer product)"
    if not rhs_free:
        return "the right operand has no free axis (a matrix-vector product)"
    return Plan(
        lhs_perm=lhs_free + lhs_contract,
        rhs_perm=rhs_contract + rhs_free,
        n_contract=len(lhs_contract),
        out_perm=None,
        rows=math.prod(lhs_shape[d] for d in lhs_free),
        contract=math.prod(lhs_shape[d] for d in lhs_contract),
        features=math.prod(rhs_shape[d] for d in rhs_free),
    )


def _expand_ellipsis(term: str, ndim: int, letters: str) -> str | None:
    if "..." not in term:
        return term
    n = ndim - (len(term) - 3)
    return None if n < 0 else term.replace("...", letters[len(letters) - n :])


def _plan_einsum(subscripts: Any, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> Plan | str:
    if not isinstance(subscripts, str):
        return "the einsum is not given as a subscripts string"
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return f"the einsum has {len(terms)} operands, not two"
    # The broadcast axes of "..." get letters no subscript uses.
    ellipsis = "".join(chr(0x100 + i) for i in range(max(len(lhs_shape), len(rhs_shape))))
    lhs_term = _expand_ellipsis(terms[0], len(lhs_shape), ellipsis)
    rhs_term = _expand_ellipsis(terms[1], len(rhs_shape), ellipsis)
    if lhs_term is None or rhs_term is None:
        return "its subscripts do not match the operands' ranks"
    if not arrow:
        once = [c for c in sorted(set(lhs_term + rhs_term)) if (lhs_term + rhs_term).count(c) == 1]
        output = "".join(c for c in ellipsis if c in once) + "".join(
            c for c in once if c not in ellipsis
        )
    else:
        broadcast = "".join(c for c in ellipsis if c in lhs_term + rhs_term)
        output = output.replace("...", broadcast)
    if len(lhs_term) != len(lhs_shape) or len(rhs_term) != len(rhs_shape):
        return "its subscripts do not match the operands' ranks"
    if len(set(lhs_term)) != len(lhs_term) or len(set(rhs_term)) != len(rhs_term):
        return "an operand repeats a subscript (a diagonal)"
    if any(c not in lhs_term + rhs_term for c in output) or len(set(output)) != len(output):
        return "its output subscripts are not those of the operands"
    shared = [c for c in lhs_term if c in rhs_term]
    if any(c not in shared and c not in output for c in lhs_term + rhs_term):
        return "it sums an axis of one operand only"
    if any(lhs_shape[lhs_term.index(c)] != rhs_shape[rhs_term.index(c)] for c in shared):
        return "it broadcasts an axis of size 1"
    contract = [c for c in shared if c not in output]
    batch = [c for c in shared if c in output]
    plan = _plan_dot_general(
        lhs_shape,
        rhs_shape,
        (
            (
                tuple(lhs_term.index(c) for c in contract),
                tuple(rhs_term.index(c) for c in contract),
            ),
            (tuple(lhs_term.index(c) for c in batch), tuple(rhs_term.index(c) for c in batch)),
        ),
    )
    if isinstance(plan, str):
        return plan
    produced = [c for c in lhs_term if c not in shared] + [c for c in rhs_term if c not in shared]
    perm = tuple(produced.index(c) for c in output)
    return dataclasses.replace(plan, out_perm=None if perm == tuple(range(len(perm))) else perm)


def plan_product(op: str, lhs: Any, rhs: Any, spec: Any = None) -> Plan | str:
    """How ``op`` on ``lhs`` and ``rhs`` runs as ``dense``, or why it cannot (a sentence).

    ``spec`` is the dimension numbers of ``dot_general`` and the subscripts of ``einsum``.
    """
    lhs_shape, rhs_shape = tuple(np.shape(lhs)), tuple(np.shape(rhs))
    if op == "einsum":
        return _plan_einsum(spec, lhs_shape, rhs_shape)
    if op == "dot_general":
        return _plan_dot_general(lhs_shape, rhs_shape, spec)
    if len(lhs_shape) < 1 or len(rhs_shape) < 2:
        return "an operand is a scalar or a vector"
    if op == "matmul" and len(rhs_shape) > 2:
        return "the right operand of the matmul has batch axes"
    # dot and matmul: lhs's last axis with rhs's second to last.
    contract = (((len(lhs_shape) - 1,), (len(rhs_shape) - 2,)), ((), ()))
    return _plan_dot_general(lhs_shape, rhs_shape, contract)


def _block(recipe: Recipe) -> int:
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8_BLOCK
    if isinstance(recipe, NVFP4BlockScaling):
        return NVFP4_BLOCK
    return _FP8_ALIGNMENT


def fp8_reason(plan: Plan | str, lhs: Any, rhs: Any, recipe: Recipe) -> str | None:
    """Why the planned product cannot run in FP8 under ``recipe`` (None: it can)."""
    if isinstance(plan, str):
        return plan
    for name, operand in (("left", lhs), ("right", rhs)):
        dtype = getattr(operand, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return f"the {name} operand is not floating point ({dtype})"
        if jnp.finfo(dtype).bits < 16:
            return f"the {name} operand is already {jnp.dtype(dtype).name}"
    block = _block(recipe)
    sizes = {"contracting size": plan.contract, "output features": plan.features}
    if block != _FP8_ALIGNMENT:  # block scaling also blocks the tokens (the wgrad's K)
        sizes["rows"] = plan.rows
    for what, size in sizes.items():
        if size % block:
            return f"its {what} {size} is not a multiple of {block}"
    return None


def run_plan(
    plan: Plan,
    lhs: Array,
    rhs: Array,
    quantizer_set: QuantizerSet,
    out_dtype: Any = None,
) -> Array:
    """The product through ``dense`` with ``quantizer_set``, in the product's output layout."""
    x = lhs if plan.lhs_perm == tuple(range(lhs.ndim)) else jnp.transpose(lhs, plan.lhs_perm)
    kernel = rhs if plan.rhs_perm == tuple(range(rhs.ndim)) else jnp.transpose(rhs, plan.rhs_perm)
    n = plan.n_contract
    # [M..., K...] x [K..., N...] -> [M..., N...]
    with _quiet():
        out = dense(
            x,
            kernel,
            contracting_dims=(tuple(range(x.ndim - n, x.ndim)), tuple(range(n))),
            quantizer_set=quantizer_set,
        )
    if plan.out_perm is not None:
        out = jnp.transpose(out, plan.out_perm)
    return out if out_dtype is None else out.astype(out_dtype)


# ----------------------------------------------------------------------------- interception
# (the fallback for bare products)

# (op, lhs, rhs, spec, original_call) -> the result, or None to run the original product.
Handler = Callable[[str, Any, Any, Any, Callable[[], Any]], Any]

# What a quantized model's call keeps while it runs is context-local (``contextvars``: per
# thread, and per task where one thread runs several): the handlers of nested
# ``intercepting`` blocks, whether te_flax's own products are running (never intercepted), and
# the running modules (``running``). The patched functions themselves are the process's: their
# count of open blocks (``_PATCH_DEPTH``) is the one process-wide state, under a lock.
_HANDLERS: contextvars.ContextVar[tuple[Handler, ...]] = contextvars.ContextVar(
    "te_flax_product_handlers", default=()
)
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("te_flax_own_products", default=False)


@contextlib.contextmanager
def _scoped(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """Runs the block with ``variable`` set to ``value``."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def _quiet() -> contextlib.AbstractContextManager[None]:
    """te_flax's own products (inside ``dense``) are never intercepted."""
    return _scoped(_QUIET, True)


def _dispatch(op: str, lhs: Any, rhs: Any, spec: Any, original: Callable[[], Any]) -> Any:
    handlers = _HANDLERS.get()
    if not handlers or _QUIET.get():
        return original()
    result = handlers[-1](op, lhs, rhs, spec, original)
    return original() if result is None else result


_ORIGINALS: dict[str, Callable[..., Any]] = {
    "dot_general": jax.lax.dot_general,
    "einsum": jnp.einsum,
    "dot": jnp.dot,
    "matmul": jnp.matmul,
}


def _dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINALS["dot_general"]
    return _dispatch(
        "dot_general",
        lhs,
        rhs,
        dimension_numbers,
        lambda: original(lhs, rhs, dimension_numbers, *args, **kwargs),
    )


def _einsum(subscripts: Any, *operands: Any, **kwargs: Any) -> Any:
    original = _ORIGINALS["einsum"]

    def call() -> Any:
        return original(subscripts, *operands, **kwargs)

    # A custom _dot_general (someone else's injection) is left to do its work.
    if len(operands) != 2 or kwargs.get("_dot_general") not in (None, _ORIGINALS["dot_general"]):
        return call()
    return _dispatch("einsum", operands[0], operands[1], subscripts, call)


def _binary(op: str) -> Callable[..., Any]:
    def product(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        original = _ORIGINALS[op]
        return _dispatch(op, a, b, None, lambda: original(a, b, *args, **kwargs))

    product.__name__ = op
    return product


_REPLACEMENTS = {
    "dot_general": (jax.lax, _dot_general),
    "einsum": (jnp, _einsum),
    "dot": (jnp, _binary("dot")),
    "matmul": (jnp, _binary("matmul")),
}
_PATCH_LOCK = threading.Lock()  # the one process-wide state, see _HANDLERS
_PATCH_DEPTH = [0]


@contextlib.contextmanager
def intercepting(handler: Handler) -> Iterator[None]:
    """Runs the block with ``jax.lax.dot_general``, ``jnp.einsum``, ``jnp.dot`` and
    ``jnp.matmul`` handed to ``handler`` (the innermost one when nested).

    ``quantize_model``'s fallback for bare products (``bare_products=True``): the four
    functions are replaced for the whole process while any block runs; calls from threads
    with no block running go to JAX's own functions."""
    with _PATCH_LOCK:
        if _PATCH_DEPTH[0] == 0:
            for name, (module, replacement) in _REPLACEMENTS.items():
                setattr(module, name, replacement)
        _PATCH_DEPTH[0] += 1
    try:
        with _scoped(_HANDLERS, (*_HANDLERS.get(), handler)):
            yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH[0] -= 1
            if _PATCH_DEPTH[0] == 0:
                for name, (module, _) in _REPLACEMENTS.items():
                    setattr(module, name, _ORIGINALS[name])


def original(op: str) -> Callable[..., Any]:
    """The product function ``op`` as JAX defines it (never intercepted)."""
    function: Callable[..., Any] = _ORIGINALS[op]
    return function


# ----------------------------------------------------------------------------- model calls


class QuantizeModelNote(UserWarning):
    """Products ``quantize_model`` leaves in high precision although a rule selects them."""


_NOTED: set[Any] = set()


def note_once(key: Any, message: str) -> None:
    """Warns ``message`` (a ``QuantizeModelNote``) the first time ``key`` is seen."""
    if key not in _NOTED:
        _NOTED.add(key)
        warnings.warn(message, QuantizeModelNote, stacklevel=3)


class Selection(Protocol):
    """Which products run in FP8: ``quantize_model``'s recipe and rules."""

    @property
    def bare_products(self) -> bool:
        """Whether bare ``jnp`` / ``lax`` products are seen too (the fallback)."""

    def recipe_for(self, path: str, op: str) -> Recipe | None: ...


# The site of a Flax layer's own product (its dot_general or einsum): the module's first product.
LAYER = "layer"

# (recipe, index) -> the quantizer set of the module's index-th product (None: not available).
QuantizerSetOf = Callable[[Recipe, int], QuantizerSet | None]


@dataclasses.dataclass
class Frame:
    """A module while its method runs: whose products are whose, and in which order."""

    module: Any
    path: str
    session: Session | None  # None: te_flax's own module, whose products are its own
    quantizer_set: QuantizerSetOf
    bare_offset: int = 0  # 1 for a Flax layer: its own product comes first
    bare_calls: int = 0
    bare_fp8: int = 0

    def index(self, site: Any, fp8: bool) -> int | None:
        """The FP8 state index of the product at ``site`` (None: high precision)."""
        if not fp8:
            return None
        if site == LAYER:
            return 0
        self.bare_fp8 += 1
        return self.bare_offset + self.bare_fp8 - 1


_FRAMES: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    "te_flax_running_modules", default=()
)


def innermost() -> Frame | None:
    """The innermost running module's frame (None: no quantized model is running)."""
    frames = _FRAMES.get()
    return frames[-1] if frames else None


def running(frame: Frame) -> contextlib.AbstractContextManager[None]:
    """Runs the block as ``frame``'s module (the owner of the bare products it calls)."""
    return _scoped(_FRAMES, (*_FRAMES.get(), frame))


@dataclasses.dataclass
class Record:
    """A product of the model, as one trace saw it."""

    op: str
    recipe: Recipe | None
    reason: str | None  # why FP8 cannot take it (None: it can, or no rule selects it)
    index: int | None  # its FP8 state postfix index in its module (FP8 only)


class Session:
    """One trace of a quantized model: plans each product, records it, runs it in FP8."""

    def __init__(self, selection: Selection, discovering: bool = False) -> None:
        self.selection = selection
        self.discovering = discovering  # only record: the FP8 state does not exist yet
        self.records: dict[tuple[str, Any], Record] = {}
        self.owners: dict[str, Any] = {}  # path -> the module as seen in the call
        self.own_modules: set[str] = set()  # paths of te_flax's modules: their products are theirs

    def product(
        self,
        frame: Frame,
        site: Any,
        op: str,
        operands: tuple[Any, Any, Any],
        call: Callable[[], Any],
    ) -> Any:
        """The product in FP8, or None to run ``call`` (the product as written) instead."""
        lhs, rhs, spec = operands
        recipe = self.selection.recipe_for(frame.path, op)
        plan = plan_product(op, lhs, rhs, spec)
        reason = None if recipe is None else fp8_reason(plan, lhs, rhs, recipe)
        index = frame.index(site, recipe is not None and reason is None)
        self.records.setdefault((frame.path, site), Record(op, recipe, reason, index))
        self.owners.setdefault(frame.path, frame.module)
        if index is None or self.discovering or isinstance(plan, str):
            return None
        assert recipe is not None
        quantizers = frame.quantizer_set(recipe, index)
        if quantizers is None:
            return None
        out = jax.eval_shape(call)  # the product's own output dtype
        return run_plan(plan, lhs, rhs, quantizers, out.dtype)


def _operands(op: str, args: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """(lhs, rhs, spec) of ``dot_general(lhs, rhs, dimension_numbers, ...)`` or
    ``einsum(subscripts, lhs, rhs, ...)``."""
    return (args[1], args[2], args[0]) if op == "einsum" else (args[0], args[1], args[2])


def layer_product(
    frame: Frame, op: str, function: Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    """A Flax layer's product (``function(*args, **kwargs)``, its ``dot_general`` or
    ``einsum``; None: JAX's own ``op``), in FP8 where ``frame``'s session selects it."""
    product = original(op) if function is None else function

    def call() -> Any:
        return product(*args, **kwargs)

    session = frame.session
    result = (
        None if session is None else session.product(frame, LAYER, op, _operands(op, args), call)
    )
    return call() if result is None else result


def bare_fallback() -> contextlib.AbstractContextManager[None]:
    """Runs the block with the bare products of running modules handed to their sessions."""
    return intercepting(_bare_product)


def _bare_product(op: str, lhs: Any, rhs: Any, spec: Any, call: Callable[[], Any]) -> Any:
    """The fallback's handler: a bare product belongs to the innermost running module, and
    takes the next index after those its module has called so far in this call."""
    frame = innermost()
    if frame is None or frame.session is None:
        return None
    frame.bare_calls += 1
    return frame.session.product(frame, ("bare", frame.bare_calls), op, (lhs, rhs, spec), call)
