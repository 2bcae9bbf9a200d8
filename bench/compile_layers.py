"""Compile time of scanned TransformerLayers: te_flax, TransformerEngine and plain Flax layers.

One training step (the loss and the gradients of the variables: the parameters and, where a
library keeps FP8 state, that state as its own training step gets it back through the gradient)
of L TransformerLayers stacked under ``nn.scan``, compiled deviceless for the H100 of
``tests/data`` (``bench.te_peer``'s target and its set-up of TE's CUDA custom calls), without FP8
(``bf16``) and with delayed scaling (``fp8``):

* ``te_flax``: ``te_flax.linen.TransformerLayer`` with its Pallas kernels (``auto``, its H100
  default), ``te_flax.training.value_and_grad``;
* ``TE``: TransformerEngine's ``transformer_engine.jax.flax.TransformerLayer`` under
  ``te.autocast`` (where it imports);
* ``Flax``: ``FlaxBlock`` below, the same pre-norm block (RMSNorm, fused QKV projection, causal
  unfused softmax attention, SwiGLU MLP, no biases) from ``flax.linen``; its FP8 is Flax's
  ``nn.Fp8DotGeneral`` (delayed scaling) in every ``Dense``.

Attention is the unfused softmax path everywhere (``bench.te_peer --attention unfused``: TE's
``NVTE_FUSED_ATTN=0``, te_flax's ``implementation="xla"``). Every measurement runs in a fresh
process; the figures are the best of ``--repeats`` such processes, stage by stage. Per variant:
``jit(step).trace`` (tracing), ``.lower()`` (lowering to StableHLO, the Pallas kernels' lowering
to Triton or Mosaic GPU within it), ``.compile()`` (XLA) and, from a ``jax.profiler`` trace of
the compile, XLA's HLO passes, its LLVM IR emission, LLVM's PTX generation and ``ptxas`` (one
call per compiled module); StableHLO ops by kind, jaxpr equations by source function, and from the
optimized HLO its fusions (all, and distinct: identical bodies compile once) by XLA's name (after
the root op) and by the module scope of their ``op_name``. ``--variants`` also takes the
experiments of ``EXPERIMENTS``.

Command (run with each interpreter to compare; TE's environment as in ``bench.te_peer``)::

    python -m bench.compile_layers [--layers 4 32] [--repeats 3] [--out results.json]
    python -m bench.compile_layers --report a.json b.json   # writes RESULTS_compile_layers.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# JAX reads the platform when it is imported; bench.te_peer sets both again (setdefault).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_gpu_enable_triton_gemm=false" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_triton_gemm=false".strip()
    )

import flax.linen as nn
import jax
import jax.numpy as jnp

from bench import te_peer
from te_flax._tools.hlo import MOSAIC_CALL, TRITON_CALL, custom_call_targets

RESULTS = Path(__file__).with_name("RESULTS_compile_layers.md")
SHAPE = te_peer.Shape(tokens=1024, seq=512, hidden=1024, mlp=4096, heads=16)  # batch 2
VARIANTS = ("te_flax", "TE", "Flax")
# Experiments, not configurations: te_flax's step differentiated with jax.value_and_grad (no
# max-merge mark on its FP8 state: right here, where every state has one use), te_flax with its
# XLA stages instead of its Pallas kernels, and each library with XLA's GPU autotuning off (all of
# it; or, on XLA versions that have it, only the autotuner of fusions' emitters).
XLA_EXPERIMENTS = {
    "no_autotune": "--xla_gpu_autotune_level=0",
    "no_fusion_autotune": "--xla_gpu_experimental_enable_fusion_autotuner=false",
}
EXPERIMENTS = (
    "te_flax:jax_grad",
    "te_flax:xla_stages",
    *(f"{variant}:{experiment}" for experiment in XLA_EXPERIMENTS for variant in VARIANTS),
)
RECIPES = ("bf16", "fp8")
FP8_COLLECTIONS = ("_overwrite_with_gradient", "fp8_metas")  # te_flax and Flax; TE
_OP = re.compile(r"\b((?:stablehlo|chlo|sdy|mhlo|func)\.[a-z_0-9]+)\b")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_FUSION = re.compile(r"\sfusion\(.*kind=(k\w+).*calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DEDUPLICATED = re.compile(r'deduplicated_name="([^"]*)"')
# op_name parts that are transformations or control flow, not a module or a function.
_TRANSFORM = re.compile(
    r"[\w\-]+\(.*\)|while|body|cond|eval_jaxpr|checkpoint|rematted_computation|closed_call"
    r"|branch_\d+_fun"
)
_METADATA = re.compile(r", metadata=\{[^}]*\}|, backend_config=.*$|, frontend_attributes=\{[^}]*\}")
_NAME = re.compile(r"%[\w.\-]+")
_INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT )?%([\w\-]+?)(?:\.\d+)? = ")
# XLA's compile stages as the profiler names them; "PTX->CUBIN" is one ptxas call.
ASSIGNER = "config-assigner"
STAGES = {
    "hlo_passes": "OptimizeHloModule",
    "assigner": ASSIGNER,
    "backend": "CompileToBackendResult",
    "schedule": "ScheduleGpuModule",
    "llvm_ir": "CompileModuleToLlvmIr",
    "llvm_ptx": "CompileSingleModule",
    "ptxas": "PTX->CUBIN",
    "mlir_llvm": "Compiling IR:LLVMDialectModule",
}


# ----------------------------------------------------------------------------- the layers


class FlaxBlock(nn.Module):
    """A pre-norm TransformerLayer from ``flax.linen`` alone, the shape of the others'."""

    hidden: int
    heads: int
    mlp: int
    fp8: bool

    @nn.compact
    def __call__(self, x):
        dense = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        if self.fp8:
            dense["dot_general_cls"] = nn.Fp8DotGeneral
        norm = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        b, s, _ = x.shape
        head_dim = self.hidden // self.heads
        h = nn.RMSNorm(**norm, name="attn_norm")(x)
        qkv = nn.Dense(3 * self.hidden, **dense, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * self.heads, head_dim), 3, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.bfloat16(head_dim**-0.5)
        causal = jnp.tril(jnp.ones((s, s), bool))
        logits = jnp.where(causal, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, self.hidden)
        x = x + nn.Dense(self.hidden, **dense, name="out")(attn)
        h = nn.RMSNorm(**norm, name="mlp_norm")(x)
        gate, up = jnp.split(nn.Dense(2 * self.mlp, **dense, name="wi")(h), 2, axis=-1)
        return x + nn.Dense(self.hidden, **dense, name="wo")(nn.silu(gate) * up)


class Body(nn.Module):
    """One layer as ``nn.scan`` calls it: ``(x, _) -> (layer(x), None)``."""

    variant: str
    fp8: bool

    @nn.compact
    def __call__(self, x, _):
        s = SHAPE
        name = self.variant.split(":")[0]
        if name == "Flax":
            return FlaxBlock(s.hidden, s.heads, s.mlp, self.fp8, name="layer")(x), None
        if name == "TE":
            import transformer_engine.jax.flax as library

            recipe = None
        else:
            import te_flax.linen as library
            from te_flax.quantize import DelayedScaling

            recipe = DelayedScaling() if self.fp8 else None
        layer = te_peer.peer_layer(library, "TransformerLayer", s, recipe, fused_attention=False)
        return te_peer._output(layer(x, deterministic=True)), None


def stack(variant: str, fp8: bool, layers: int) -> nn.Module:
    scanned = nn.scan(
        Body,
        variable_axes={"params": 0, **{c: 0 for c in FP8_COLLECTIONS}},
        split_rngs={"params": True},
        length=layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(variant, fp8, name="layers")


def context(variant: str, fp8: bool):
    """TE's autocast; te_flax's Pallas kernel switch as on a GPU (its recipe is the layer's)."""
    if variant.split(":")[0] == "TE":
        import transformer_engine.jax as te
        from transformer_engine.common import recipe

        return te.autocast(enabled=fp8, recipe=recipe.DelayedScaling() if fp8 else None)
    if variant.startswith("te_flax"):
        from te_flax._ops.kernels import pallas_kernels

        return pallas_kernels("0" if variant.endswith("xla_stages") else "auto", assume_gpu=True)
    return contextlib.nullcontext()


def step_and_inputs(variant: str, fp8: bool, layers: int):
    """The training step (loss, gradients of every variable) and its abstract inputs."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=te_peer.TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    sharding = jax.sharding.NamedSharding(
        topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec()
    )
    s = SHAPE
    x = jax.ShapeDtypeStruct((s.batch, s.seq, s.hidden), jnp.bfloat16, sharding=sharding)
    model = stack(variant, fp8, layers)
    variables = jax.eval_shape(lambda x: nn.meta.unbox(model.init(jax.random.key(0), x, None)), x)
    variables = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), variables
    )

    def loss(variables, x):
        y, _ = model.apply(variables, x, None)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    if variant.startswith("te_flax") and variant != "te_flax:jax_grad":
        from te_flax.training import value_and_grad

        return value_and_grad(loss), variables, x
    return jax.value_and_grad(loss), variables, x


# ----------------------------------------------------------------------------- one measurement


def _timed(function, seconds: list[float]):
    """``function``, adding the seconds of each call to ``seconds``."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return timed


def _timed_pallas_lowering(seconds: list[float]) -> None:
    """Adds each Pallas kernel's lowering seconds to ``seconds``: ``pallas_call``'s (to Triton)
    and Mosaic GPU's (to its MLIR module; XLA compiles both)."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.pallas_call import pallas_call_p

    entry = mlir._lowerings[pallas_call_p]
    if hasattr(entry, "rule"):  # jax 0.10 keeps the rule in an entry
        mlir._lowerings[pallas_call_p] = dataclasses.replace(
            entry, rule=_timed(entry.rule, seconds)
        )
    else:
        mlir._lowerings[pallas_call_p] = _timed(entry, seconds)
    try:  # Mosaic GPU kernels (plgpu.kernel) reach their lowering without pallas_call's rule
        from jax._src.pallas.mosaic_gpu import lowering as mosaic_gpu
    except ImportError:  # no Mosaic GPU lowering in this JAX
        return
    # The entry point its pallas_call registration calls: renamed after jax 0.10.
    for name in ("lower_unpipelined_jaxpr_to_module", "lower_pipelined_jaxpr_to_module"):
        if hasattr(mosaic_gpu, name):
            setattr(mosaic_gpu, name, _timed(getattr(mosaic_gpu, name), seconds))
            return


def _profile_stages(log_dir: str) -> dict:
    """Seconds (summed over XLA's threads) and counts of XLA's compile stages and passes; of
    each stage also the part inside the ``config-assigner`` pass, which compiles fusions one
    by one to pick their emitters."""
    from jax._src.lib import _profile_data

    (path,) = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    events = [
        (event.name, event.start_ns, event.duration_ns)
        for plane in _profile_data.ProfileData.from_file(path).planes
        for line in plane.lines
        for event in line.events
    ]
    assigner = [(start, start + length) for name, start, length in events if name == ASSIGNER]
    seconds: Counter = Counter()
    counts: Counter = Counter()
    for name, start, length in events:
        inside = any(a <= start <= b for a, b in assigner)
        for key in (name, f"{name} in {ASSIGNER}")[: 1 + inside]:
            seconds[key] += length / 1e9
            counts[key] += 1
    stages = {}
    for key, name in STAGES.items():
        stages[key] = seconds[name]
        stages[f"{key}_n"] = counts[name]
        stages[f"{key}_in_assigner"] = seconds[f"{name} in {ASSIGNER}"]
        stages[f"{key}_in_assigner_n"] = counts[f"{name} in {ASSIGNER}"]
    passes = {n: t for n, t in seconds.items() if re.fullmatch(r"[a-z0-9][a-z0-9\-_]*", n)}
    stages["passes"] = dict(Counter(passes).most_common(12))
    return stages


def _jaxpr_by_file(jaxpr) -> Counter:
    """Jaxpr equations (recursively) by the file and function of their innermost non-JAX
    frame."""
    from jax._src import core, source_info_util

    counts: Counter = Counter()
    for eqn in jaxpr.eqns:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        counts[f"{_short(frame.file_name)}:{frame.function_name}" if frame else "?"] += 1
        for sub in core.jaxprs_in_params(eqn.params):
            counts += _jaxpr_by_file(sub)
    return counts


def _short(path: str) -> str:
    for root in ("te_flax/", "transformer_engine/", "flax/", "bench/", "optax/"):
        if root in path:
            return root + path.rsplit(root, 1)[1]
    return Path(path).name


def _scope(line: str) -> str:
    """The module path and function of an instruction's ``op_name``, its last three parts
    without the transformations, the primitive and the scanned layer's name."""
    match = _OP_NAME.search(line)
    if not match:
        return "?"
    parts = [p for p in match.group(1).split("/")[1:-1] if not _TRANSFORM.fullmatch(p)]
    parts = [p for p in parts if p not in ("layers", "layer") and not p.startswith("Transformer")]
    return "/".join(parts[-3:]) or "?"


def hlo_summary(hlo: str) -> dict:
    """Fusions of the optimized program: all, distinct bodies, by kind and by source file."""
    bodies: dict[str, str] = {}
    name, body = None, []
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            name, body = match.group(1), []
        elif line.startswith("}") and name:
            bodies[name], name = "\n".join(body), None
        elif name:
            body.append(_NAME.sub("%", _METADATA.sub("", line.strip())))
    fusions = [(m, line) for line in hlo.splitlines() if (m := _FUSION.search(line))]
    seen: set[str] = set()
    xla_kernels: set[str] = set()
    kinds: Counter = Counter()
    by_file: Counter = Counter()
    distinct_by_file: Counter = Counter()
    distinct_by_name: Counter = Counter()  # XLA names a fusion after its root op
    for match, line in fusions:
        kind, called = match.groups()
        where = _scope(line)
        by_file[where] += 1
        kinds[kind] += 1
        deduplicated = _DEDUPLICATED.search(line)
        xla_kernels.add(deduplicated.group(1) if deduplicated else called)
        key = bodies.get(called, called)
        if key not in seen:
            seen.add(key)
            distinct_by_file[where] += 1
            named = _INSTRUCTION_NAME.match(line)
            distinct_by_name[named.group(1) if named else "?"] += 1
    targets = Counter(custom_call_targets(hlo))
    return {
        "fusions": len(fusions),
        "distinct_fusions": len(seen),
        "xla_deduplicated_fusions": len(xla_kernels),
        "fusion_kinds": dict(kinds),
        "fusions_by_file": dict(by_file.most_common()),
        "distinct_by_file": dict(distinct_by_file.most_common()),
        "distinct_by_name": dict(distinct_by_name.most_common()),
        "custom_calls": dict(targets),
        "hlo_lines": len(hlo.splitlines()),
    }


def measure(variant: str, recipe: str, layers: int) -> dict:
    """One fresh-process measurement: stage times, sizes and the compile profile."""
    fp8 = recipe == "fp8"
    events: Counter = Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kwargs: events.update({event: seconds})
    )
    pallas: list[float] = []
    _timed_pallas_lowering(pallas)
    with context(variant, fp8):
        step, variables, x = step_and_inputs(variant, fp8, layers)
        jitted = jax.jit(step)
        began = time.perf_counter()
        traced = jitted.trace(variables, x)
        trace_s = time.perf_counter() - began
        began = time.perf_counter()
        lowered = traced.lower()
        lower_s = time.perf_counter() - began
        with tempfile.TemporaryDirectory() as log_dir:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(log_dir, profiler_options=options)
            began, cpu = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            compile_s = time.perf_counter() - began
            compile_cpu_s = time.process_time() - cpu
            jax.profiler.stop_trace()
            stages = _profile_stages(log_dir)
    ops = Counter(m.group(1) for m in map(_OP.search, lowered.as_text().splitlines()) if m)
    return {
        "variant": variant,
        "recipe": recipe,
        "layers": layers,
        "jax": jax.__version__,
        "trace_s": trace_s,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "pallas_lowering_s": sum(pallas),
        "pallas_lowerings": len(pallas),
        "events": {k.rsplit("/", 1)[1]: v for k, v in events.items()},
        "xla": stages,
        "stablehlo_ops": sum(ops.values()),
        "stablehlo_top": dict(ops.most_common(12)),
        "jaxpr_eqns_by_file": dict(_jaxpr_by_file(traced.jaxpr.jaxpr).most_common()),
        **hlo_summary(compiled.as_text()),
    }


# ----------------------------------------------------------------------------- the runs


def available_variants() -> list[str]:
    try:
        te_peer._te_deviceless(fused_attention=False)
    except ImportError:  # TE's environment only
        return [v for v in VARIANTS if v != "TE"]
    return list(VARIANTS)


def run_one(variant: str, recipe: str, layers: int, timeout: int) -> dict:
    """``measure`` in a fresh interpreter (this one), its JSON back."""
    command = [sys.executable, "-m", "bench.compile_layers", "--one", variant, recipe, str(layers)]
    env = dict(os.environ)
    if flag := XLA_EXPERIMENTS.get(variant.partition(":")[2]):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parents[1],
        env=env,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def best_of(runs: list[dict]) -> dict:
    """The first run's sizes, each stage's least time over the runs."""
    best = dict(runs[0])
    for key in ("trace_s", "lower_s", "compile_s", "compile_cpu_s", "pallas_lowering_s"):
        best[key] = min(r[key] for r in runs)
    best["xla"] = {
        key: min(r["xla"][key] for r in runs) if key != "passes" else runs[0]["xla"][key]
        for key in runs[0]["xla"]
    }
    best["totals"] = [r["trace_s"] + r["lower_s"] + r["compile_s"] for r in runs]
    return best


def merged(invocations: list[list[dict]]) -> list[dict]:
    """One row per (jax, variant, recipe, L): the last invocation's, each stage's time the
    least of every invocation's (the best of all their processes)."""
    rows: dict[tuple, dict] = {}
    for results in invocations:
        for r in results:
            key = (r["jax"], r["variant"], r["recipe"], r["layers"])
            old = rows.get(key)
            rows[key] = r = dict(r)
            if old:
                for stage in ("trace_s", "lower_s", "compile_s", "compile_cpu_s"):
                    r[stage] = min(x[stage] for x in (old, r) if stage in x)
                r["totals"] = old["totals"] + r["totals"]
    return list(rows.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXPERIMENTS
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per process")
    parser.add_argument("--out", type=Path, help="JSON file for the results (for --report)")
    parser.add_argument("--one", nargs=3, metavar=("VARIANT", "RECIPE", "LAYERS"))
    parser.add_argument("--report", type=Path, nargs="+", help="JSON files to write the report")
    args = parser.parse_args(argv)
    if args.one:
        variant, recipe, layers = args.one
        if variant.split(":")[0] == "TE":
            te_peer._te_deviceless(fused_attention=False)
        print(json.dumps(measure(variant, recipe, int(layers))), flush=True)
        return
    if args.report:
        results = merged([json.loads(path.read_text()) for path in args.report])
        RESULTS.write_text(report(results, [path.name for path in args.report]))
        return
    variants = [v for v in args.variants if v.split(":")[0] in available_variants()]
    results = []
    for layers in args.layers:
        for variant in variants:
            for recipe in args.recipes:
                runs = [run_one(variant, recipe, layers, args.timeout) for _ in range(args.repeats)]
                errors = [r["error"] for r in runs if "error" in r]
                if errors:
                    print(variant, recipe, layers, "failed:", errors[0], flush=True)
                    continue
                r = best_of(runs)
                results.append(r)
                print(
                    f"L={layers} {variant} {recipe} jax {r['jax']}: trace {r['trace_s']:.2f} "
                    f"lower {r['lower_s']:.2f} compile {r['compile_s']:.2f} s; "
                    f"ops {r['stablehlo_ops']} fusions {r['fusions']} "
                    f"({r['distinct_fusions']} distinct) ptxas {r['xla']['ptxas_n']}",
                    flush=True,
                )
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))


# ----------------------------------------------------------------------------- the report

ANALYSIS = "## Where te_flax's excess goes"  # written by hand, kept by every run
GOALS = (  # (label, numerator, denominator, goal)
    ("te_flax BF16 / Flax BF16", ("te_flax", "bf16"), ("Flax", "bf16"), 1.1),
    ("te_flax BF16 / TE BF16", ("te_flax", "bf16"), ("TE", "bf16"), 2.0),
    ("te_flax FP8 / TE FP8", ("te_flax", "fp8"), ("TE", "fp8"), 2.0),
    ("te_flax FP8 / te_flax BF16", ("te_flax", "fp8"), ("te_flax", "bf16"), 1.3),
    ("TE FP8 / TE BF16", ("TE", "fp8"), ("TE", "bf16"), None),
    ("Flax FP8 / Flax BF16", ("Flax", "fp8"), ("Flax", "bf16"), None),
    *(
        (f"{v} FP8 / {v} BF16, {x}", (f"{v}:{x}", "fp8"), (f"{v}:{x}", "bf16"), None)
        for x in XLA_EXPERIMENTS
        for v in VARIANTS
    ),
    *(
        (f"{v} {r.upper()}: {x} / default", (f"{v}:{x}", r), (v, r), None)
        for x in XLA_EXPERIMENTS
        for v in VARIANTS
        for r in RECIPES
    ),
)


def _total(r: dict) -> float:
    return r["trace_s"] + r["lower_s"] + r["compile_s"]


def _calls(r: dict) -> str:
    gemms = sum(n for t, n in r["custom_calls"].items() if "cublas" in t or "gemm" in t)
    pallas = sum(r["custom_calls"].get(t, 0) for t in (TRITON_CALL, MOSAIC_CALL))
    return f"{gemms} / {pallas} / {sum(r['custom_calls'].values()) - gemms - pallas}"


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| L | variant | recipe | trace s | lower s | compile s | total s | compile CPU s | "
        "StableHLO ops | "
        "fusions (distinct) | custom calls: GEMM / Pallas / other | Pallas lowering s (calls) "
        "| config-assigner s (fusion compiles) | ptxas s (calls) | LLVM IR s | HLO passes s |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for r in rows:
        x = r["xla"]
        lines.append(
            f"| {r['layers']} | {r['variant']} | {r['recipe']} | {r['trace_s']:.2f} | "
            f"{r['lower_s']:.2f} | {r['compile_s']:.2f} | **{_total(r):.2f}** | "
            f"{r.get('compile_cpu_s', float('nan')):.2f} | "
            f"{r['stablehlo_ops']} | {r['fusions']} ({r['distinct_fusions']}) | {_calls(r)} | "
            f"{r['pallas_lowering_s']:.2f} ({r['pallas_lowerings']}) | {x['assigner']:.2f} "
            f"({x['backend_in_assigner_n']}) | {x['ptxas']:.2f} ({x['ptxas_n']}) | "
            f"{x['llvm_ir']:.2f} | {x['hlo_passes']:.2f} |"
        )
    return lines


def _goals(rows: list[dict]) -> list[str]:
    by = {(r["layers"], r["variant"], r["recipe"]): r for r in rows}
    lines = [
        "| L | ratio (trace + lower + compile) | value | goal | met | compile only | "
        "compile CPU | "
        "fusions | distinct fusions | StableHLO ops |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layers in sorted({r["layers"] for r in rows}):
        for label, top, bottom, goal in GOALS:
            a, b = by.get((layers, *top)), by.get((layers, *bottom))
            if not a or not b:
                continue
            value = _total(a) / _total(b)
            met = "" if goal is None else ("yes" if value <= goal else "**no**")
            lines.append(
                f"| {layers} | {label} | {value:.2f}x | {goal or ''} | {met} | "
                f"{a['compile_s'] / b['compile_s']:.2f}x | "
                f"{a.get('compile_cpu_s', 0) / b.get('compile_cpu_s', 1):.2f}x | "
                f"{a['fusions'] / b['fusions']:.2f}x | "
                f"{a['distinct_fusions'] / b['distinct_fusions']:.2f}x | "
                f"{a['stablehlo_ops'] / b['stablehlo_ops']:.2f}x |"
            )
    return lines


def _sources(rows: list[dict], layers: int) -> list[str]:
    lines = []
    for r in rows:
        if r["layers"] != layers:
            continue
        top = ", ".join(f"`{k}` {n}" for k, n in list(r["distinct_by_file"].items())[:8])
        eqns = ", ".join(f"`{k}` {n}" for k, n in list(r["jaxpr_eqns_by_file"].items())[:6])
        ops = ", ".join(f"`{k.split('.')[-1]}` {n}" for k, n in r["stablehlo_top"].items())
        names = ", ".join(f"`{k}` {n}" for k, n in r.get("distinct_by_name", {}).items())
        lines.append(
            f"- {r['variant']} {r['recipe']}: distinct fusions by XLA's name (its root op): "
            f"{names}; by op_name scope ('?': none): {top}; jaxpr equations by source file "
            f"({sum(r['jaxpr_eqns_by_file'].values())}): {eqns}; StableHLO ops by kind: {ops}"
        )
    return lines


def report(results: list[dict], files: list[str]) -> str:
    s = SHAPE
    lines = [
        "# Compile time of scanned TransformerLayers: te_flax, TransformerEngine, Flax",
        "",
        f"One training step (loss, gradients of every variable) of L TransformerLayers under "
        f"`nn.scan`, compiled deviceless for the H100 target of `tests/data` (a compile for a "
        f"model of the GPU, nothing runs): hidden {s.hidden}, {s.heads} heads, SwiGLU MLP "
        f"{s.mlp}, sequence {s.seq}, batch {s.batch}, RMSNorm, causal unfused softmax "
        "attention, no biases, bf16 parameters and activations. FP8: delayed scaling "
        "(te_flax's and TE's `DelayedScaling()`, Flax's `nn.Fp8DotGeneral` in every Dense). "
        "te_flax's Pallas kernel switch is `auto` as on a GPU: its Triton kernels on jax 0.10, "
        "its Mosaic GPU kernels from jax 0.11 on. Each figure is the best of 3 "
        "fresh processes, stage by stage, on a shared 2-core host: only the ratios mean "
        "something. Seconds of XLA's stages are summed over its compile threads (a `jax."
        "profiler` trace of `.compile()`); `config-assigner` is the XLA pass that compiles "
        "the fusions one by one (its count) to choose their emitters; ptxas: one call per "
        "compiled module, inside that pass and in the final compile. Distinct fusions: "
        "identical fused computations counted once (as XLA's `deduplicated_name` shows, one "
        "kernel each).",
        "",
        "Commands, from the repository root (TE's environment as for `bench.te_peer`), each "
        "run once per JSON file of the last command; the report takes each stage's best over "
        "all those runs' processes, the other figures from the last run:",
        "",
        "    NVTE_JAX_CUSTOM_CALLS=true PYTHONPATH=. te-python -m bench.compile_layers \\",
        "        --out te_1.json    # jax 0.10.2; then te_2.json",
        "    python -m bench.compile_layers --out jax012_1.json    # jax 0.12; then jax012_2.json",
        "    python -m bench.compile_layers --variants te_flax --out jax012_3.json    # and _4",
        "    NVTE_JAX_CUSTOM_CALLS=true PYTHONPATH=. te-python -m bench.compile_layers \\",
        "        --variants te_flax:no_autotune TE:no_autotune Flax:no_autotune --layers 4 \\",
        "        --out te_exp.json",
        "    python -m bench.compile_layers --variants te_flax:no_autotune Flax:no_autotune \\",
        "        te_flax:xla_stages --layers 4 --out jax012_exp.json",
        "    python -m bench.compile_layers --variants te_flax:no_fusion_autotune \\",
        "        Flax:no_fusion_autotune --layers 4 --out jax012_exp2.json",
        "    python -m bench.compile_layers --variants te_flax:no_autotune \\",
        "        te_flax:no_fusion_autotune te_flax:xla_stages --layers 4 --out jax012_exp3.json",
        f"    python -m bench.compile_layers --report {' '.join(files)}",
        "",
        "The rows named `variant:experiment` are experiments (best of 3 per run): "
        "`te_flax:xla_stages`, te_flax with its XLA stages instead of its Pallas kernels "
        "(`pallas_kernels('0')`); `:no_autotune`, the same step compiled with XLA's GPU "
        f"autotuning off (`XLA_FLAGS={XLA_EXPERIMENTS['no_autotune']}`); `:no_fusion_autotune`, "
        "with only the autotuner of the fusions' emitters off (`XLA_FLAGS="
        f"{XLA_EXPERIMENTS['no_fusion_autotune']}`, a flag of XLA from jax 0.12); "
        "`te_flax:jax_grad` (not run here), te_flax's "
        "step differentiated with `jax.value_and_grad` instead of "
        "`te_flax.training.value_and_grad`.",
    ]
    for version in sorted({r["jax"] for r in results}):
        rows = sorted(
            (r for r in results if r["jax"] == version),
            key=lambda r: (r["layers"], (VARIANTS + EXPERIMENTS).index(r["variant"]), r["recipe"]),
        )
        lines += ["", f"## jax {version}", "", *_table(rows), "", "Against the goals:", ""]
        lines += [*_goals(rows), "", "Where the fusions and the jaxpr come from (L = 4):", ""]
        lines += _sources(rows, min(r["layers"] for r in rows))
    old = RESULTS.read_text() if RESULTS.exists() else ""
    kept = f"\n{ANALYSIS}" + old.split(f"\n{ANALYSIS}", 1)[1] if f"\n{ANALYSIS}" in old else ""
    return "\n".join(lines) + "\n" + kept


if __name__ == "__main__":
    main()
