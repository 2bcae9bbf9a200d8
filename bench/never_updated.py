"""What scaling a never-updated delayed-scaling state just in time costs, and what it fixes.

Where a layer's new FP8 state cannot leave the step (evaluation, a frozen layer under a
gradient of something else, a gradient of the inputs or of the parameters alone), its ops
quantize each tensor with the scale of its own amax while the state is still fresh
(``te_flax._ops.custom_op``); the step that differentiates the state keeps the stored scale.
Each layer (``DenseGeneral`` 1024 -> 1024, ``LayerNormDenseGeneral`` 1024 -> 3072,
``LayerNormMLP`` 1024 -> 2 x 4096 SwiGLU -> 1024; bfloat16, 8 x 512 tokens,
``DelayedScaling()``) is compiled deviceless for an H100 in three programs: the training step
(``te_flax.training.value_and_grad`` over the whole variable dict), evaluation, and the gradient
of the input alone. Each program is compiled with just-in-time scaling (te_flax now), with the
stored scale everywhere (the program before), and under ``Float8CurrentScaling()`` for
reference; bytes are ``bench.h100.cost``'s (XLA's cost analysis of the optimized H100 module,
GEMMs and Pallas kernels counted from the HLO), with te_flax's kernels as a GPU process takes
them (``auto``) and with the XLA stages (``TE_FLAX_PALLAS=0``).

And the error it fixes: a fresh ``DenseGeneral`` (64 -> 64) applied to inputs near 1e3, the
normwise relative error of its output against the unquantized layer, on the CPU.

Run ``python -m bench.never_updated``; it writes ``bench/RESULTS_never_updated.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import contextlib  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench.h100 import _sharding, available, cost  # noqa: E402
from te_flax._ops import custom_op  # noqa: E402
from te_flax._ops.kernels import pallas_kernels  # noqa: E402
from te_flax.quantize import DelayedScaling, Float8CurrentScaling, Recipe  # noqa: E402
from te_flax.training import value_and_grad  # noqa: E402

TOKENS, HIDDEN, INTERMEDIATE = (8, 512), 1024, 4096
MODES = ("just in time", "stored scale", "current scaling")
PROGRAMS = ("training step", "evaluation", "input gradient")


def _layer(kind: str, recipe: Recipe) -> nn.Module:
    dtype = jnp.bfloat16
    if kind == "DenseGeneral":
        return te_nn.DenseGeneral(features=HIDDEN, recipe=recipe, dtype=dtype)
    if kind == "LayerNormDenseGeneral":
        return te_nn.LayerNormDenseGeneral(features=3 * HIDDEN, recipe=recipe, dtype=dtype)
    return te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE, activations=("silu", "linear"), recipe=recipe, dtype=dtype
    )


def _output(y: Any) -> jax.Array:
    return y[0] if isinstance(y, tuple) else y


@contextlib.contextmanager
def _stored_scales() -> Iterator[None]:
    """Every delayed-scaling quantizer as it comes in: the programs before just-in-time
    scaling."""
    original = custom_op._in_mode
    custom_op._in_mode = lambda quantizer, just_in_time: quantizer
    try:
        yield
    finally:
        custom_op._in_mode = original


def _program(layer: nn.Module, program: str) -> Callable[..., Any]:
    def loss(variables: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(_output(layer.apply(variables, x)).astype(jnp.float32))

    if program == "training step":
        return value_and_grad(loss)
    if program == "evaluation":
        return lambda variables, x: _output(layer.apply(variables, x))
    return jax.grad(loss, argnums=1)


def _bytes(kind: str, program: str, mode: str, kernels: str) -> float:
    recipe = Float8CurrentScaling() if mode == "current scaling" else DelayedScaling()
    layer = _layer(kind, recipe)
    sharding = _sharding()
    x = jax.ShapeDtypeStruct((*TOKENS, HIDDEN), jnp.bfloat16, sharding=sharding)
    shapes = jax.eval_shape(lambda: nn.unbox(layer.init(jax.random.key(0), jnp.zeros(x.shape))))
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), shapes
    )
    stored = _stored_scales() if mode == "stored scale" else contextlib.nullcontext()
    # The deviceless compile runs on a CPU host: "auto" traces as a GPU process would.
    with stored, pallas_kernels(kernels, assume_gpu=True):
        lowered = jax.jit(_program(layer, program)).lower(variables, x)
    return cost(lowered.compile())["bytes"]


def _error(stored: bool) -> float:
    """The output error of a fresh DenseGeneral on inputs near 1e3 (CPU)."""
    x = 1e3 * jax.random.normal(jax.random.key(1), (4, 16, 64))
    layer = te_nn.DenseGeneral(features=64, recipe=DelayedScaling())
    variables = layer.init(jax.random.key(0), x)
    exact = te_nn.DenseGeneral(features=64).apply({"params": variables["params"]}, x)
    with _stored_scales() if stored else contextlib.nullcontext():
        y = jax.jit(layer.apply)(variables, x)
    return float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))


def _table(kernels: str) -> list[str]:
    lines = [
        f"### te_flax's kernels: `{kernels}`",
        "",
        "| layer | program | just in time (MB) | stored scale (MB) | ratio "
        "| current scaling (MB) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for kind in ("DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"):
        for program in PROGRAMS:
            row = {
                mode: _bytes(kind, program, mode, kernels)
                for mode in MODES
                if not (mode == "current scaling" and program == "training step")
            }
            current = row.get("current scaling")
            lines.append(
                f"| {kind} | {program} | {row['just in time'] / 1e6:.1f} | "
                f"{row['stored scale'] / 1e6:.1f} | "
                f"{row['just in time'] / row['stored scale']:.3f} | "
                f"{'-' if current is None else f'{current / 1e6:.1f}'} |"
            )
            print(lines[-1], flush=True)
    return [*lines, ""]


def main() -> Path:
    problem = available()
    if problem is not None:
        raise SystemExit(f"the deviceless H100 compile is not available: {problem}")
    lines = [
        "# Scaling a never-updated state just in time",
        "",
        " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " ").replace("``", "`"),
        "",
        f"JAX {jax.__version__}. A fresh DenseGeneral on inputs near 1e3: output error "
        f"{_error(stored=True):.3f} with the stored scale (1), {_error(stored=False):.3f} "
        "just in time.",
        "",
        *_table("auto"),
        *_table("0"),
        "Reproduce with `python -m bench.never_updated`.",
    ]
    path = Path(__file__).parent / "RESULTS_never_updated.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


if __name__ == "__main__":
    main()
