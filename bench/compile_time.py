"""Trace and compile time of the example GPT's training step, FP8 against BF16, on the host CPU.

The example's default configuration (``configs/lm_small.yaml``) with 12 layers, its ``train_step``
(te_flax's ``value_and_grad`` of the cross-entropy, then AdamW through ``apply_gradients``), the
blocks under ``nn.scan`` (as the example stacks them) and unrolled (a Python loop of the same
blocks). For each recipe (none = BF16, delayed, current): the trace time (``jax.jit(...).trace``
and ``.lower()``), the XLA compile time (``.compile()``), the StableHLO op count of the lowered
program, the fusions of the compiled one (identical fusions share one compiled kernel; the
compile time follows the module's size more than their number, see the RESULTS file) and which
ops the FP8 program adds over BF16.

Command: ``JAX_PLATFORMS=cpu python -m bench.compile_time`` (``--repeats N``: best of N, default
3; ``--layers``). Writes the first section of ``bench/RESULTS_compile_time.md`` and keeps the
sections after it.

``--without PART [PART ...]`` is an experiment, not a configuration: it leaves parts of delayed
scaling's state bookkeeping out of the step (the numerics are then wrong) to measure what each
costs, prints the delayed rows and writes nothing. Parts: ``keep_unused`` (``apply_gradients``
keeping the state no op read), ``check_merged`` (its check that the new state was max-merged)
and ``scale_update`` (each quantizer's history roll and new scale; only this step's amax is
recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_flax
from examples.lm import model_linen
from examples.lm.config import DEFAULT_CONFIG, load_config
from examples.lm.train import make_optimizer, make_recipe, make_train_step
from te_flax import training
from te_flax.quantize import DelayedScaleQuantizer
from te_flax.training import init_optimizer

RESULTS = Path(__file__).with_name("RESULTS_compile_time.md")
RECIPES = ("none", "delayed", "current")
LAYOUTS = ("scan", "unrolled")
_OP = re.compile(r"\b((?:stablehlo|chlo|sdy|mhlo|func|call)\.[a-z_0-9]+|call)\b")
_FUSION = re.compile(r"^\s*(?:ROOT )?%\S+ = .* fusion\(", re.MULTILINE)
PARTS = ("keep_unused", "check_merged", "scale_update")


def _record_amax_only(quantizer: DelayedScaleQuantizer, amax_value):
    return dataclasses.replace(quantizer, amax_history=quantizer.amax_history.at[0].set(amax_value))


@contextlib.contextmanager
def without(parts: tuple[str, ...]) -> Iterator[None]:
    """The step with ``parts`` of the state bookkeeping stubbed out (see the module docstring)."""
    saved = (training.keep_unused, training.check_merged, DelayedScaleQuantizer.update)
    if "keep_unused" in parts:
        training.keep_unused = lambda new, old: new
    if "check_merged" in parts:
        training.check_merged = lambda old, new: None
    if "scale_update" in parts:
        DelayedScaleQuantizer.update = _record_amax_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        training.keep_unused, training.check_merged, DelayedScaleQuantizer.update = saved


class UnrolledGPT(nn.Module):
    """The example's ``GPT`` with its blocks in a Python loop instead of ``nn.scan``."""

    config: model_linen.ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, name="embed")
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (tokens.shape[1], c.d_model)
        )
        x = (embed(tokens) + positions[None]).astype(model_linen.COMPUTE_DTYPE)
        for i in range(c.layers):
            x, _ = model_linen.Block(c, name=f"block_{i}")(x, None)
        x = te_flax.linen.LayerNorm(dtype=jnp.float32, name="final_norm")(x)
        return embed.attend(x)


def step_and_state(recipe: str, layout: str, layers: int):
    """The example's jitted train step and its abstract state and batch, under the recipe."""
    config = load_config(DEFAULT_CONFIG, [f"model.layers={layers}", f"train.recipe={recipe}"])
    model = (model_linen.GPT if layout == "scan" else UnrolledGPT)(config.model)
    frontend = SimpleNamespace(
        apply=lambda variables, tokens: model.apply(variables, tokens, mutable=["intermediates"])
    )
    tx = make_optimizer(config)
    tokens = jax.ShapeDtypeStruct((config.train.batch, config.train.seq_len), jnp.int32)

    train_step = make_train_step(frontend, tx)

    rec = make_recipe(config)
    with te_flax.autocast(enabled=rec is not None, recipe=rec):
        variables = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))
        state = {
            "variables": variables,
            "opt_state": jax.eval_shape(lambda v: init_optimizer(tx, v), variables),
        }
    return jax.jit(train_step), state, tokens, rec


def op_histogram(stablehlo: str) -> Counter:
    """Op names of a lowered module's text, one per op line."""
    ops: Counter = Counter()
    for line in stablehlo.splitlines():
        match = _OP.search(line.split("=", 1)[1] if " = " in line else line)
        if match:
            ops[match.group(1)] += 1
    return ops


def measure(recipe: str, layout: str, layers: int, repeats: int) -> dict:
    """Best-of-``repeats`` trace (trace + lower) and compile seconds, and the op histogram."""
    trace_s, compile_s, compile_cpu_s = [], [], []
    text = ""
    for _ in range(repeats):
        jax.clear_caches()
        step, state, tokens, rec = step_and_state(recipe, layout, layers)
        with te_flax.autocast(enabled=rec is not None, recipe=rec):
            began = time.perf_counter()
            lowered = step.lower(state, tokens, tokens)
            traced, cpu = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            done, cpu_done = time.perf_counter(), time.process_time()
        trace_s.append(traced - began)
        compile_s.append(done - traced)
        compile_cpu_s.append(cpu_done - cpu)
        text = lowered.as_text()
    ops = op_histogram(text)
    return {
        "trace_s": min(trace_s),
        "compile_s": min(compile_s),
        "compile_cpu_s": min(compile_cpu_s),
        "ops": ops,
        "op_count": sum(ops.values()),
        "fusions": len(_FUSION.findall(compiled.as_text())),
        "lines": len(text.splitlines()),
    }


def render(results: dict, layers: int, repeats: int) -> str:
    lines = [
        "# Compile time: the example GPT's training step, FP8 against BF16, host CPU",
        "",
        f"The example's default configuration (`configs/lm_small.yaml`) with {layers} layers, "
        "its `train_step` (te_flax's `value_and_grad` of the cross-entropy, then AdamW through "
        "`apply_gradients`), blocks under `nn.scan` (as the example) and unrolled (a Python "
        "loop). Trace: `jax.jit(step).lower(...)` (trace and lowering to StableHLO); compile: "
        f"`.compile()` (XLA CPU); best of {repeats} after `jax.clear_caches()`, on a shared "
        "2-core host (only the ratios mean something; the process CPU time of the compile is "
        "less sensitive to the other work on the host than its wall time). Ops: the lowered "
        "StableHLO's op lines; fusions: the compiled program's fusion instructions.",
        "",
        "Command: `JAX_PLATFORMS=cpu python -m bench.compile_time"
        + ("`" if repeats == 3 else f" --repeats {repeats}`"),
        "",
        "| layout | recipe | trace (s) | compile (s) | trace+compile (s) | / BF16 | "
        "compile CPU time (s) | / BF16 | StableHLO ops | ops / BF16 | fusions | fusions / BF16 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layout in LAYOUTS:
        base = results[(layout, "none")]
        base_total = base["trace_s"] + base["compile_s"]
        for recipe in RECIPES:
            r = results[(layout, recipe)]
            total = r["trace_s"] + r["compile_s"]
            lines.append(
                f"| {layout} | {'BF16' if recipe == 'none' else recipe} | {r['trace_s']:.2f} | "
                f"{r['compile_s']:.2f} | {total:.2f} | {total / base_total:.2f}x | "
                f"{r['compile_cpu_s']:.2f} | {r['compile_cpu_s'] / base['compile_cpu_s']:.2f}x | "
                f"{r['op_count']} | {r['op_count'] / base['op_count']:.2f}x | "
                f"{r['fusions']} | {r['fusions'] / base['fusions']:.2f}x |"
            )
    for layout in LAYOUTS:
        base = results[(layout, "none")]["ops"]
        for recipe in RECIPES[1:]:
            extra = results[(layout, recipe)]["ops"] - base
            top = ", ".join(f"`{name}` +{n}" for name, n in extra.most_common(15))
            lines += ["", f"Ops the {recipe} FP8 program adds over BF16 ({layout}): {top}."]
    return "\n".join(lines) + "\n"


def _print(label: str, r: dict) -> None:
    print(
        f"{label:30} trace {r['trace_s']:.2f} s compile {r['compile_s']:.2f} s "
        f"(CPU {r['compile_cpu_s']:.2f} s) ops {r['op_count']} fusions {r['fusions']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--without", nargs="+", choices=PARTS, help="an experiment: see the module docstring"
    )
    args = parser.parse_args()
    if args.without:
        for layout in args.layouts:
            for recipe in ("none", "delayed"):
                _print(f"{layout} {recipe}", measure(recipe, layout, args.layers, args.repeats))
            for part in args.without:
                with without((part,)):
                    r = measure("delayed", layout, args.layers, args.repeats)
                _print(f"{layout} delayed without {part}", r)
            if len(args.without) > 1:
                with without(tuple(args.without)):
                    r = measure("delayed", layout, args.layers, args.repeats)
                _print(f"{layout} delayed without all {len(args.without)}", r)
        return
    results = {}
    for layout in args.layouts:
        for recipe in RECIPES:
            results[(layout, recipe)] = r = measure(recipe, layout, args.layers, args.repeats)
            _print(f"{layout} {recipe}", r)
    if set(args.layouts) == set(LAYOUTS):
        text = render(results, args.layers, args.repeats)
        print(text)
        if not args.no_write:
            # The sections after the first are written by hand (history, analysis): kept.
            kept = RESULTS.read_text().partition("\n## ") if RESULTS.exists() else ("", "", "")
            RESULTS.write_text(text + (f"\n## {kept[2]}" if kept[1] else ""))


if __name__ == "__main__":
    main()
