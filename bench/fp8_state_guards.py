"""What the FP8-state guards of the training helpers cost: step time on CPU and program bytes.

A small model (four ``LayerNormMLP`` blocks, hidden 128, intermediate 512, a batch of 4 x 64
tokens, ``DelayedScaling()``: amax histories of 1024 entries, 24 states) takes training steps
through te_flax's helpers, Linen (``value_and_grad`` + ``apply_gradients``) and NNX
(``te_flax.nnx.train_step``), in these variants:

* ``no guard``: ``drop_amax_spikes=False``, the helpers before the guard was their default;
* ``step guard``: the helpers' default, ``drop_step_amax_spikes`` (one maximum over each
  history: a new amax above 1e3 times it is left out);
* ``drop_amax_spikes()``: the opt-in guard the docs gave before, ``drop_amax_spikes(state,
  recipe)`` on the whole state after each step (a median of each history: a sort);
* ``read-time check``: what a layer would have to do to notice a raw restore of another
  format (a checkpoint restored straight into the model, bypassing ``migrate_fp8_state``):
  recompute every ``scale_inv`` from its history under the model's recipe before the step and
  flag a mismatch (the flag is returned, so XLA keeps the work).

Each variant's jitted step is timed interleaved with the others (``bench.timing``: rounds in a
rotating order, ratios to ``no guard`` taken round by round); the compiled program's
``cost_analysis()`` gives its bytes accessed and flops.

And what each restore path gives across recipes: a ``DenseGeneral`` (128 -> 128, no bias)
trains 3 steps under one delayed-scaling recipe, and its variables are restored into a model
of another; the first step's input gradient is compared with the unquantized gradient
(normwise relative error) for a raw restore (the tree as saved), for
``migrate_fp8_state(..., recipe=model's)``, and for the raw restore one step later.

Run ``JAX_PLATFORMS=cpu python -m bench.fp8_state_guards``; it writes
``bench/RESULTS_fp8_state_guards.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from bench.timing import interleaved, paired_ratio, stats
from te_flax.convert import RecomputedFp8ScalesWarning, migrate_fp8_state
from te_flax.quantize import DelayedScaling, Format
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    drop_amax_spikes,
    drop_step_amax_spikes,
    init_optimizer,
    scale_inv_from_history,
    value_and_grad,
)

RECIPE = DelayedScaling()  # amax_history_len=1024, the default
HIDDEN, INTERMEDIATE, LAYERS, BATCH, SEQ = 128, 512, 4, 4, 64
REPEATS, WARMUP, STEPS_PER_CALL = 30, 3, 5


class Blocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        for index in range(LAYERS):
            y, _ = te_nn.LayerNormMLP(intermediate_dim=INTERMEDIATE, recipe=RECIPE,
                                      name=f"mlp_{index}")(x)  # fmt: skip
            x = x + y
        return x


class NnxBlocks(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List(
            [
                te_nnx.LayerNormMLP(HIDDEN, intermediate_dim=INTERMEDIATE, recipe=RECIPE, rngs=rngs)
                for _ in range(LAYERS)
            ]
        )

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)[0]
        return x


def _format_mismatches(state: Any) -> jax.Array:
    """How many states' ``scale_inv`` differ from the recipe's scale of their history."""
    flat = flax.traverse_util.flatten_dict(state)
    count = jnp.zeros((), jnp.int32)
    for path, history in flat.items():
        if not path[-1].endswith("_amax_history"):
            continue
        scale_path = (*path[:-1], path[-1].removesuffix("_amax_history") + "_scale_inv")
        saved = flat[scale_path]
        expected = scale_inv_from_history(scale_path[-1], history, saved, RECIPE)
        differs = jnp.any(jnp.abs(expected / saved - 1.0) > 2.0**-20)
        count = count + differs.astype(jnp.int32)
    return count


def linen_steps() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    model = Blocks()
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN))
    variables = nn.unbox(model.init(jax.random.key(1), x))
    tx = optax.adamw(1e-3)
    opt_state = init_optimizer(tx, variables)

    def loss_fn(variables, x):
        return jnp.mean(jnp.square(model.apply(variables, x)))

    def make(variant: str) -> Callable[..., Any]:
        def one_step(variables, opt_state, x):
            flags = jnp.zeros((), jnp.int32)
            if variant == "read-time check":
                flags = _format_mismatches(variables[OVERWRITE_WITH_GRADIENT])
            _, grads = value_and_grad(loss_fn)(variables, x)
            guard = variant == "step guard"
            variables, opt_state = apply_gradients(
                tx, variables, grads, opt_state, drop_amax_spikes=guard
            )
            if variant == "drop_amax_spikes()":
                state = drop_amax_spikes(variables[OVERWRITE_WITH_GRADIENT], RECIPE)
                variables = {**variables, OVERWRITE_WITH_GRADIENT: state}
            return variables, opt_state, flags

        def steps(variables, opt_state, x):
            flags = jnp.zeros((), jnp.int32)
            for _ in range(STEPS_PER_CALL):
                variables, opt_state, flag = one_step(variables, opt_state, x)
                flags = flags + flag
            return variables, opt_state, flags

        return steps

    variants = ("no guard", "step guard", "drop_amax_spikes()", "read-time check")
    return {name: (make(name), (variables, opt_state, x)) for name in variants}


def nnx_steps() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    model = NnxBlocks(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN))
    graphdef, state = nnx.split((model, optimizer))

    def loss_fn(model, x):
        return jnp.mean(jnp.square(model(x)))

    def make(guard: bool) -> Callable[..., Any]:
        def steps(state, x):
            model, optimizer = nnx.merge(graphdef, state)
            for _ in range(STEPS_PER_CALL):
                te_nnx.train_step(model, optimizer, loss_fn, x, drop_amax_spikes=guard)
            return nnx.state((model, optimizer))

        return steps

    return {"no guard": (make(False), (state, x)), "step guard": (make(True), (state, x))}


PAIRS = {
    "HYBRID -> E4M3": (DelayedScaling(amax_history_len=16),
                       DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3)),
    "E4M3 -> HYBRID": (DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3),
                       DelayedScaling(amax_history_len=16)),
    "margin 0 -> 4": (DelayedScaling(amax_history_len=16),
                      DelayedScaling(amax_history_len=16, margin=4)),
    "max -> most_recent": (DelayedScaling(amax_history_len=16),
                           DelayedScaling(amax_history_len=16, amax_compute_algo="most_recent")),
}  # fmt: skip


def _dense_step(recipe: DelayedScaling) -> tuple[nn.Module, Callable[..., Any]]:
    layer = te_nn.DenseGeneral(features=HIDDEN, use_bias=False, recipe=recipe)
    tx = optax.sgd(1e-2)

    @jax.jit
    def step(variables, x):
        def loss(variables):
            return jnp.mean(jnp.square(layer.apply(variables, x)))

        _, grads = value_and_grad(loss)(variables)
        return apply_gradients(tx, variables, grads, init_optimizer(tx, variables))[0]

    return layer, step


def _input_grad_error(layer: nn.Module, variables: Any, x: jax.Array) -> float:
    def input_grad(module, variables):
        return jax.grad(lambda x: jnp.mean(jnp.square(module.apply(variables, x))))(x)

    exact_layer = te_nn.DenseGeneral(features=HIDDEN, use_bias=False)
    exact = input_grad(exact_layer, {"params": variables["params"]})
    quantized = input_grad(layer, variables)
    return float(jnp.linalg.norm(quantized - exact) / jnp.linalg.norm(exact))


def restore_paths() -> list[dict[str, Any]]:
    xs = jax.random.normal(jax.random.key(2), (6, BATCH, SEQ, HIDDEN))
    rows = []
    for pair, (saved_recipe, model_recipe) in PAIRS.items():
        saving, saving_step = _dense_step(saved_recipe)
        variables = nn.unbox(saving.init(jax.random.key(3), xs[0]))
        for index in range(3):
            variables = saving_step(variables, xs[index])
        model, model_step = _dense_step(model_recipe)
        target = jax.eval_shape(model.init, jax.random.key(3), xs[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecomputedFp8ScalesWarning)
            migrated = migrate_fp8_state(variables, target, recipe=model_recipe)
        after_one = model_step(variables, xs[3])
        rows.append(
            {
                "pair": pair,
                "raw": _input_grad_error(model, variables, xs[4]),
                "migrated": _input_grad_error(model, migrated, xs[4]),
                "raw, next step": _input_grad_error(model, after_one, xs[4]),
            }
        )
    return rows


def guard_alone() -> dict[str, float]:
    """Microseconds of the step guard by itself on the Linen model's FP8 state (24 states of
    1024 entries), jitted alone, where it fuses with nothing: an upper bound of its share of a
    step. A spike in every state, so that every select takes the other branch."""
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN))
    state = nn.unbox(Blocks().init(jax.random.key(1), x))[OVERWRITE_WITH_GRADIENT]
    old = jax.tree.map(lambda leaf: jnp.full_like(leaf, 1.0), state)
    new = jax.tree.map(lambda leaf: leaf.at[..., 0].set(1e9) + 1.0, old)
    guard = jax.jit(drop_step_amax_spikes)
    copy = jax.jit(lambda new, old: jax.tree.map(lambda a: a + 0.0, new))
    times = interleaved(
        {"guard": lambda: guard(new, old), "copy": lambda: copy(new, old)}, REPEATS, WARMUP
    )
    return {name: 1e6 * stats(samples)["median"] for name, samples in times.items()}


def _cost(compiled: Any) -> dict[str, float]:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per program
        analysis = analysis[0]
    return {key: float(analysis.get(key, 0.0)) for key in ("bytes accessed", "flops")}


def measure(
    steps: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]],
) -> list[dict[str, Any]]:
    compiled, runners = {}, {}
    for name, (function, args) in steps.items():
        compiled[name] = jax.jit(function).lower(*args).compile()
        runners[name] = lambda name=name, args=args: compiled[name](*args)
    times = interleaved(runners, REPEATS, WARMUP)
    rows = []
    for name in steps:
        cost = _cost(compiled[name])
        rows.append(
            {
                "variant": name,
                "ms": 1e3 * stats(times[name])["median"] / STEPS_PER_CALL,
                "ratio": paired_ratio(times[name], times["no guard"]),
                **cost,
            }
        )
    return rows


def _table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]
    lines = [
        f"### {title}",
        "",
        "| variant | ms / step (median) | time / no guard (median, min-max of rounds) | "
        "bytes accessed | bytes / no guard | flops / no guard |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ratio = row["ratio"]
        lines.append(
            f"| {row['variant']} | {row['ms']:.2f} | {ratio['median']:.3f} "
            f"({ratio['min']:.3f}-{ratio['max']:.3f}) | {row['bytes accessed']:.4g} | "
            f"{row['bytes accessed'] / base['bytes accessed']:.4f} | "
            f"{row['flops'] / base['flops']:.4f} |"
        )
    return [*lines, ""]


def main() -> Path:
    paths = restore_paths()
    alone = guard_alone()
    linen, nnx_rows = measure(linen_steps()), measure(nnx_steps())
    lines = [
        "# The cost of the FP8-state guards in the training helpers",
        "",
        __doc__.split("\n\n")[1].replace("\n", " ").replace("``", "`"),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), JAX {jax.__version__}, "
        f"Flax {flax.__version__}; {STEPS_PER_CALL} steps per jitted call, {REPEATS} rounds "
        f"after {WARMUP} warm-up rounds. Bytes and flops are XLA's estimates for the "
        f"{STEPS_PER_CALL}-step program.",
        "",
        *_table("Linen: value_and_grad + apply_gradients", linen),
        *_table("NNX: te_flax.nnx.train_step", nnx_rows),
        "### The step guard alone",
        "",
        f"`drop_step_amax_spikes` jitted by itself on the Linen model's FP8 state (24 states of "
        f"1024 entries, a spike in each): {alone['guard']:.0f} us per call, against "
        f"{alone['copy']:.0f} us for a jitted copy of the same state (the cost of a call), and "
        f"{linen[0]['ms'] * 1e3:.0f} us for the model's training step above.",
        "",
        "### Restoring across recipes: the first step's input-gradient error",
        "",
        "| saved -> model recipe | raw restore | migrate_fp8_state | raw restore, one step later |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {row['pair']} | {row['raw']:.3f} | {row['migrated']:.3f} | "
            f"{row['raw, next step']:.3f} |"
            for row in paths
        ),
        "",
        "Reproduce with `JAX_PLATFORMS=cpu python -m bench.fp8_state_guards`.",
    ]
    path = Path(__file__).parent / "RESULTS_fp8_state_guards.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


if __name__ == "__main__":
    main()
