"""The one switch of te_flax's Pallas kernels, and the dispatch between a kernel and XLA.

``TE_FLAX_PALLAS`` (environment variable, read when a function is traced) or
``pallas_kernels(mode)`` (a context manager, which wins over the variable, and whose mode is
part of ``jax.jit``'s cache key: a function jitted outside it is traced again inside it):

- ``"auto"`` (default): on CUDA GPUs the kernels that save memory traffic (``AUTO``), the XLA
  stages everywhere else. From jax 0.11 on every kernel of ``AUTO`` is a Pallas Mosaic GPU
  program (``MOSAIC``; the backend JAX keeps); with jax 0.10 they are Pallas Triton programs,
  but for the grouped GEMMs, which are Mosaic GPU's at every JAX of the range. A Triton kernel
  is never used under ``"auto"`` where JAX deprecates that backend (jax 0.12); the normalize-
  quantize kernel, which only ``"1"`` runs, is Triton's everywhere. In a process
  without a CUDA GPU the XLA stages are traced directly, so CPU programs are exactly those
  without kernels; with one, the choice is made per platform when the program is lowered
  (``lax.platform_dependent``). A program compiled for a GPU from a CPU host (a deviceless
  compile) gets the kernels under ``pallas_kernels("auto", assume_gpu=True)``.
- ``"1"``: every kernel, everywhere; on platforms other than CUDA they run in Pallas interpret
  mode (slow, for tests; the Mosaic GPU kernels from jax 0.11 on, which has their interpreter).
- ``"0"``: the XLA stages everywhere.

Programs partitioned over the mesh set with ``jax.set_mesh`` run each kernel on every device's
block (``partition.per_shard``: a ``custom_partitioning`` rule, the reductions combined over the
mesh), so ``"auto"`` keeps the kernels there; inside ``shard_map`` they work on each device's
block as they are. Under ``"auto"`` only programs that may be partitioned without such a mesh
(sharded arrays under ``jit`` in a process that sees more than one GPU, or a partly manual
``shard_map``) keep the XLA stages: XLA's SPMD partitioner has no rule for a kernel's custom
call and would gather its operands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import jax
from jax import lax

from te_flax._base.explicit_sharding import vary_as_operands
from te_flax._base.jax_compat import (
    is_batch_tracer,
    mosaic_gpu_interpreted,
    pallas_triton_kept,
    traced_for_scan,
)
from te_flax._base.settings import ScopedSetting
from te_flax._ops.kernels.first_use import MODES, Probe, active_mode, agrees, parsed_mode
from te_flax._ops.kernels.partition import mesh_partitioned
from te_flax._ops.kernels.probes import PROBES
from te_flax.quantize.statistics import recording_active

__all__ = [
    "AUTO",
    "ENV_VAR",
    "MODES",
    "MOSAIC",
    "dispatch",
    "gpu_host",
    "mode",
    "pallas_kernels",
    "takes_kernel",
    "traced_in_scan",
]

ENV_VAR = "TE_FLAX_PALLAS"
T = TypeVar("T")
# The kernels "auto" uses (see ``dispatch``); "1" uses every kernel. The norm-quantize kernel
# is left out: it moves as many bytes as the XLA fusion it replaces (XLA already fuses
# normalize, quantize and amax), so it buys nothing (bench/RESULTS.md, "Deviceless H100
# compile of the same steps"). The others each save a pass over a tensor:
# the quantize kernel (a GEMM kernel's float8 layouts and its amax), the activation and its
# backward each with its quantization, and the norm backward.
# The blockwise FP8 GEMM kernel keeps its float32 partial products in registers, where XLA's
# exact form writes K / 128 of them per output element.
# The grouped GEMM kernels (Pallas Mosaic GPU) replace XLA's ragged_dot, which XLA:GPU expands
# over every group (docs/moe.md); the experts' activation gradient with its quantization saves
# the pass XLA adds between them.
AUTO = frozenset(
    {
        "activation_grad",
        "activation_grad_rows",
        "activation_quantize",
        "blockwise_gemm",
        "grouped_gemm",
        "norm_backward",
        "quantize",
    }
)
# The kernels that quantize a tensor they compute (a norm or activation output, an activation
# gradient) or read: none of them while an op records its statistics
# (``te_flax.inspect_fp8()``), which need the tensor in high precision beside its operand.
QUANTIZING = frozenset(
    {"activation_grad", "activation_grad_rows", "activation_quantize", "norm_quantize", "quantize"}
)
# The kernels written in Pallas Mosaic GPU, the backend JAX keeps; the others are Pallas Triton.
# Every kernel of AUTO has both versions (the grouped GEMMs only Mosaic GPU's): Mosaic GPU from
# jax 0.11 on (where its interpret mode tests them), Triton before.
_PORTED = ("quantize", "activation_quantize", "activation_grad", "blockwise_gemm", "norm_backward")
# The experts' activation gradient with per-group scales (MoEBlock) is Mosaic GPU's alone, from
# jax 0.11 on; jax 0.10 keeps the XLA stage there.
MOSAIC = frozenset(
    {"grouped_gemm", *(("activation_grad_rows", *_PORTED) if mosaic_gpu_interpreted() else ())}
)
# The innermost ``pallas_kernels(mode, assume_gpu)``; None: ``TE_FLAX_PALLAS``, no GPU assumed.
_SELECTED: ScopedSetting[tuple[str, bool] | None] = ScopedSetting("pallas_kernels", None)


_MEANING = "Pallas kernels on GPUs, everywhere, or nowhere"


def mode() -> str:
    """The active mode: the innermost ``pallas_kernels`` context, else ``TE_FLAX_PALLAS``."""
    selected = _SELECTED.value
    return active_mode(None if selected is None else selected[0], ENV_VAR, _MEANING)


@contextlib.contextmanager
def pallas_kernels(value: str, assume_gpu: bool = False) -> Iterator[None]:
    """Within the context, functions traced use the Pallas kernels per ``value``.

    The mode is part of ``jax.jit``'s cache key: a function jitted outside the context (or
    inside another mode) is traced again when called inside it.

    Args:
      value: ``"auto"`` (CUDA GPUs only), ``"1"`` (everywhere, interpret mode off GPUs) or
        ``"0"`` (never).
      assume_gpu: under ``"auto"``, trace as a process with one CUDA GPU does (for deviceless
        compiles for a GPU from a CPU host; default False).
    """
    if not isinstance(assume_gpu, bool):
        raise TypeError(
            f"pallas_kernels(assume_gpu=...) must be a bool, got {assume_gpu!r}; pass True only "
            "for a deviceless compile for a GPU from a CPU host"
        )
    with _SELECTED.scope((parsed_mode(value, "pallas_kernels(value)", _MEANING), assume_gpu)):
        yield


def _cuda_devices() -> int:
    try:
        return len(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend (a CPU host, or a deviceless compile)
        return 0


def _partitioned_without_rule() -> bool:
    """True where XLA's SPMD partitioner could partition a kernel that has no rule for it: a
    partly manual mesh, or no mesh in a process that sees more than one GPU (sharded arrays
    under ``jit`` need no mesh context). A mesh of several devices with no manual axis has the
    kernels' rules (``partition.per_shard``); a wholly manual one (``shard_map``) local blocks."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh_partitioned():
        return False
    if not mesh.empty and set(mesh.manual_axes) == set(mesh.axis_names):
        return False  # per-device blocks: the kernels see local arrays
    if not mesh.empty and mesh.size > 1:
        return True
    return _cuda_devices() > 1


def _batched(args: tuple[Any, ...]) -> bool:
    """Whether an operand is being batched by ``vmap``."""
    return any(is_batch_tracer(leaf) for leaf in jax.tree.leaves(args))


def _batched_on_mesh(args: tuple[Any, ...]) -> bool:
    """True for operands batched by ``vmap`` in a program partitioned over a mesh: the kernels'
    partitioning rule (``custom_partitioning``) has no batching rule, so the XLA stage runs."""
    return _batched(args) and mesh_partitioned()


def traced_in_scan(x: Any) -> bool:
    """True for an array traced in the body of a ``lax.scan`` (``nn.scan``, ``nnx.scan``, a
    static ``fori_loop``), or in a transform (``remat``, ``vmap``) inside one.

    A layer stacked over a scan gets its kernel as a ``dynamic-slice`` of the stacked
    parameter in each iteration. XLA reads such a slice inside the fusions that consume it,
    but a kernel's custom call takes a buffer, so the slice is first copied out: for a float32
    kernel 8 bytes per element before the quantize kernel reads its 4 (``bench/RESULTS_model.md``,
    "Reading the figures").
    The XLA stage reads the slice in its cast instead, so the ops quantize such kernels there.
    A kernel closed over by a scan from outside it (a decoding loop's weights) is traced
    outside the body and keeps the kernel. (JAX has no public query for this:
    ``te_flax._base.jax_compat.traced_for_scan``.)
    """
    return traced_for_scan(x)


def gpu_host() -> bool:
    """Whether the program being traced is for a CUDA GPU: this process sees one, or a
    deviceless compile asks for the kernels with ``pallas_kernels(..., assume_gpu=True)``."""
    selected = _SELECTED.value
    return (selected is not None and selected[1]) or _cuda_devices() > 0


def takes_kernel(name: str, *args: Any, supported: bool = True) -> bool:
    """Whether ``dispatch(name, ...)`` on these operands runs the kernel on a CUDA GPU."""
    selected = mode()
    if selected == "0" or not supported or _batched_on_mesh(args):
        return False
    if name in QUANTIZING and recording_active():
        return False  # te_flax.inspect_fp8() measures the XLA stage's tensors
    if selected == "1":
        return True
    if not gpu_host() or name not in AUTO or _partitioned_without_rule():
        return False
    # The Triton kernels only where JAX keeps that backend without a deprecation warning
    # (docs/versions.md, "Kernel backends"); the Mosaic GPU ones everywhere.
    return name in MOSAIC or pallas_triton_kept()


def dispatch(
    name: str,
    kernel: Callable[..., T],
    fallback: Callable[..., T],
    *args: Any,
    supported: bool = True,
    as_kernel_result: Callable[[T], T] | None = None,
    probe: Probe | None = None,
) -> T:
    """``kernel(*args, interpret=...)`` where the switch selects it, else ``fallback(*args)``.

    Both return the same values. Where both are branches of one program (chosen per platform),
    they must be the same pytree: ``as_kernel_result`` then gives the fallback's result the
    kernel's structure (a layout the kernel writes besides, say); the fallback alone, as the
    switch's ``"0"`` traces it, is left as it is. ``supported`` is False where the kernel
    cannot take these operands (shapes, dtypes); the fallback runs then whatever the switch
    says. Under ``"auto"`` only the kernels named in ``AUTO`` are used: those that move fewer bytes
    than the XLA fusions they replace in a whole training step.

    ``probe``: the small problem that checks this kernel configuration on its first use on a
    GPU (``first_use``; without one, the kernel's entry in ``probes.PROBES`` makes it from
    ``kernel``, ``fallback`` and ``args``). A configuration that disagrees with its XLA stage
    gets ``fallback`` for the rest of the process.
    """
    if not takes_kernel(name, *args, supported=supported) or _has_empty_operand(args):
        return fallback(*args)
    if not _checked_on_first_use(name, kernel, fallback, args, probe):
        return fallback(*args)
    on_gpu = _varying_as_operands(partial(kernel, interpret=False))
    elsewhere: Callable[..., T] = fallback
    if mode() == "1" and (name not in MOSAIC or _mosaic_interpretable(args)):
        elsewhere = _varying_as_operands(partial(kernel, interpret=True))
    elif as_kernel_result is not None:
        elsewhere = _composed(as_kernel_result, fallback)
    return lax.platform_dependent(*args, cuda=on_gpu, default=elsewhere)


def _checked_on_first_use(
    name: str,
    kernel: Callable[..., Any],
    fallback: Callable[..., Any],
    args: tuple[Any, ...],
    probe: Probe | None,
) -> bool:
    """Whether this configuration of kernel ``name`` agrees with its XLA stage, checked on
    its first use (``first_use.agrees``): on this process's GPU, or off one where ``"1"`` runs
    the kernel in interpret mode."""
    on_gpu = _cuda_devices() > 0
    if not on_gpu and not (mode() == "1" and (name not in MOSAIC or _mosaic_interpretable(args))):
        return True  # a program for another host's GPU (a deviceless compile): nothing to run
    if probe is None and name in PROBES:
        probe = PROBES[name](kernel, fallback, args)
    return agrees(name, probe, on_gpu)


def _has_empty_operand(args: tuple[Any, ...]) -> bool:
    """An empty tensor (a batch of 0 tokens) needs no kernel, and a GPU cannot launch a grid of
    0 blocks (the blockwise GEMM kernel refuses K = 0 outright): the XLA stage gives the empty
    or zero result."""
    return any(getattr(leaf, "size", 1) == 0 for leaf in jax.tree.leaves(args))


def _mosaic_interpretable(args: tuple[Any, ...]) -> bool:
    """Whether ``"1"`` runs a Mosaic GPU kernel in its interpreter off a GPU: this JAX has it,
    the program is for this host (no CUDA GPU seen or assumed: a program lowered for a GPU may
    not carry the interpreter's ordered host callbacks in its other branch), and no operand is
    batched by ``vmap`` (those callbacks cannot be batched inside ``platform_dependent``).
    Elsewhere ``"1"`` runs the XLA stage off a GPU."""
    return mosaic_gpu_interpreted() and not _batched(args) and not gpu_host()


def _varying_as_operands(kernel: Callable[..., T]) -> Callable[..., T]:
    """``kernel`` whose results vary over the ``shard_map`` axes its operands vary over, as the
    XLA stage's do: a Pallas kernel's ``out_shape`` carries no varying axes, and a backward
    rule's cotangents must have their primals' (``check_vma``)."""

    def varying(*args: Any) -> T:
        return vary_as_operands(args, kernel(*args))

    return varying


def _composed(outer: Callable[[T], T], inner: Callable[..., T]) -> Callable[..., T]:
    def composed(*args: Any) -> T:
        return outer(inner(*args))

    return composed
