"""TransformerEngine as a peer: te_flax's and TE's layers compiled for the same H100, side by side.

Runs in the environment ``scripts/parity`` builds (TransformerEngine 2.20.2's JAX package and its
CUDA extension on a CPU host), with TE's CUDA custom calls on::

    NVTE_JAX_CUSTOM_CALLS=true XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        PYTHONPATH=. .venv-te/bin/te-python -m bench.te_peer [--hidden 2048 ...]

Each layer's training step (loss, gradients of the variables and the input) is compiled
deviceless for the H100 of ``tests/data`` by both libraries, without FP8 and with delayed
scaling; te_flax with its Pallas kernels (``auto``) and with the XLA stages. From the optimized
HLO it reads every entry instruction's bytes (operands read once, results written once, as
``te_flax._tools.hlo`` counts them), the GEMMs and the other kernels. The step time is a MODEL,
not a measurement: every non-GEMM kernel ``bytes / HBM bandwidth + 2 us``, the GEMMs together
``max(flops / peak, GEMM bytes / HBM bandwidth) + 2 us`` each, with the layer's GEMM flops
(the same GEMMs in both libraries). Also the wall time to trace and lower, and to compile.
Writes ``bench/RESULTS_te_peer.md``. Not part of the test suite.

``--model``: two TransformerLayers (TE's too where it imports) on one H100 and on eight under
te_flax's FSDP, TP and TP+SP rule sets, TE's logical axes mapped onto the same mesh; a table
per ``--tokens`` count, ``--rotary`` for rotary position embeddings in both libraries.

TransformerLayer's attention is each library's H100 default, cuDNN's fused kernel (TE's
``NVTE_FUSED_ATTN=1``; te_flax's ``implementation="cudnn"``, which it picks on a GPU), or with
``--attention unfused`` both libraries' unfused softmax paths. The fused kernels' flops are in
the GEMM term of the model (at the BF16 peak) and their bytes among the other kernels'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

RESULTS = Path(__file__).with_name("RESULTS_te_peer.md")
TARGET_CONFIG = Path(__file__).parents[1] / "tests" / "data" / "h100_sxm.gpu_target_config.txtpb"
# H100 SXM: dense tensor-core peaks and HBM3 bandwidth (NVIDIA's datasheet), a launch cost.
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}
HBM_BYTES_PER_S = 3.35e12
LAUNCH_S = 2e-6
ATTENTION = {
    "fused": "cuDNN's fused kernel in both libraries (their H100 default)",
    "unfused": "each library's unfused softmax path (TE: NVTE_FUSED_ATTN=0; te_flax: 'xla')",
}
LAYERS = ("DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP", "TransformerLayer")
VARIANTS = ("TE", "te_flax kernels", "te_flax XLA stages")


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int  # batch x seq
    seq: int
    hidden: int
    mlp: int
    heads: int

    @property
    def batch(self) -> int:
        return self.tokens // self.seq


def gemm_flops(layer: str, s: Shape) -> tuple[float, float]:
    """(projection, attention) GEMM flops of a training step: forward, dgrad and wgrad.

    The projections are the layer's dense GEMMs (FP8 under a recipe); the attention's batched
    score and value products stay in bf16 in both libraries."""
    dense = {
        "DenseGeneral": s.hidden * s.mlp,
        "LayerNormDenseGeneral": s.hidden * s.mlp,
        "LayerNormMLP": 3 * s.hidden * s.mlp,  # gated wi (2 x) and wo
        "TransformerLayer": 4 * s.hidden * s.hidden + 3 * s.hidden * s.mlp,
    }[layer]
    attention = 4 * s.tokens * s.seq * s.hidden if layer == "TransformerLayer" else 0
    return 3 * 2 * s.tokens * dense, 3 * attention


# ----------------------------------------------------------------------------- the two libraries


def _te_deviceless(fused_attention: bool) -> None:
    """Lets TE's CUDA primitives be traced without a driver: its few runtime queries answered
    here (compute capability 90, four streams, one-byte workspaces: a workspace is scratch memory
    and changes no operand; with ``fused_attention`` cuDNN's arbitrary-sequence-length backend,
    the one TE picks on an H100 for these shapes, else none). TE's CUDA custom calls are switched
    on (the environment's interpreter wrapper switches them off for the parity suite)."""
    os.environ["NVTE_JAX_CUSTOM_CALLS"] = "true"
    os.environ["NVTE_FUSED_ATTN"] = "1" if fused_attention else "0"
    import transformer_engine.jax  # noqa: F401
    import transformer_engine_jax as tej

    backends = tej.NVTE_Fused_Attn_Backend
    backend = backends.NVTE_F16_arbitrary_seqlen if fused_attention else backends.NVTE_No_Backend
    tej.get_device_compute_capability = lambda gpu_id=0: 90
    tej.get_fused_attn_backend = lambda *a, **k: (backend, "deviceless")
    tej.get_num_compute_streams = lambda *a, **k: 4
    # The attention queries answer one (shape, dtype) pair, the norm queries a list of them.
    attention_queries = ["get_fused_attn_fwd_workspace_sizes", "get_fused_attn_bwd_workspace_sizes"]
    for query in attention_queries:
        setattr(tej, query, lambda *a, **k: ((1,), tej.DType.kByte))
    queries = [
        "get_norm_fwd_workspace_sizes",
        "get_norm_bwd_workspace_sizes",
        "get_dbias_quantize_workspace_sizes",
        "get_dact_dbias_quantize_workspace_sizes",
    ]
    for query in queries:
        setattr(tej, query, lambda *a, **k: (((1,), tej.DType.kByte),))
    names = [*queries, *attention_queries, "get_device_compute_capability"]
    names += ["get_fused_attn_backend", "get_num_compute_streams"]
    for module_name, module in list(sys.modules.items()):
        if (
            module_name.startswith("transformer_engine")
            and module is not None
            and module is not tej
        ):
            for name in names:
                bound = getattr(module, name, None)
                if callable(bound) and getattr(bound, "__module__", None) in (
                    "transformer_engine_jax",
                    None,
                ):
                    setattr(module, name, getattr(tej, name))


def peer_layer(
    library,
    layer: str,
    s: Shape,
    fp8_recipe,
    fused_attention: bool = True,
    sequence_parallel: bool = False,
    rotary: bool = False,
):
    """The layer from ``library`` (TE's ``transformer_engine.jax.flax`` or ``te_flax.linen``).

    ``fused_attention``: each library's attention on an H100, cuDNN's fused kernel (TE:
    ``NVTE_FUSED_ATTN``, set by ``_te_deviceless``), or its unfused softmax path.
    ``sequence_parallel``: TransformerLayer's ``enable_sequence_parallel`` (the norm inputs
    split over the sequence, under the ``tp_sp`` rule set). ``rotary``: its
    ``enable_rotary_pos_emb`` (rotary position embeddings on the queries and keys).
    """
    common = dict(dtype=jnp.bfloat16)  # TE: the parameters' and the computation's dtype
    if library.__name__.startswith("te_flax"):  # the same bf16 parameters
        common.update(recipe=fp8_recipe, param_dtype=jnp.bfloat16)
        if layer == "TransformerLayer":
            common["implementation"] = "cudnn" if fused_attention else "xla"
    if layer == "DenseGeneral":
        return library.DenseGeneral(features=s.mlp, **common)
    if layer == "LayerNormDenseGeneral":
        return library.LayerNormDenseGeneral(features=s.mlp, layernorm_type="rmsnorm", **common)
    if layer == "LayerNormMLP":
        return library.LayerNormMLP(
            intermediate_dim=s.mlp,
            activations=("silu", "linear"),
            layernorm_type="rmsnorm",
            **common,
        )
    return library.TransformerLayer(
        hidden_size=s.hidden,
        mlp_hidden_size=s.mlp,
        num_attention_heads=s.heads,
        layernorm_type="rmsnorm",
        mlp_activations=("silu", "linear"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        enable_relative_embedding=False,
        enable_rotary_pos_emb=rotary,
        enable_sequence_parallel=sequence_parallel,
        **common,
    )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Apply:
    model: object
    layer: str

    def __call__(self, variables, x):
        kwargs = {"deterministic": True} if self.layer == "TransformerLayer" else {}
        out = self.model.apply(variables, x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def compile_step(
    variant: str, layer: str, s: Shape, recipe: str, fused_attention: bool = True
) -> dict:
    """Trace, lower and compile one training step for the H100; its HLO and timings."""
    import contextlib

    import flax.linen as nn
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1"
    )
    sharding = jax.sharding.NamedSharding(
        topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec()
    )
    if variant == "TE":
        import transformer_engine.jax as te
        import transformer_engine.jax.flax as library
        from transformer_engine.common import recipe as te_recipes

        fp8 = te_recipes.DelayedScaling() if recipe == "delayed" else None
        context = te.autocast(enabled=fp8 is not None, recipe=fp8)
        model = peer_layer(library, layer, s, None)
    else:
        import te_flax.linen as library
        from te_flax._ops.kernels import pallas_kernels
        from te_flax.quantize import DelayedScaling

        fp8_recipe = DelayedScaling() if recipe == "delayed" else None
        model = peer_layer(library, layer, s, fp8_recipe, fused_attention)
        switch = "auto" if variant == "te_flax kernels" else "0"
        context = pallas_kernels(switch, assume_gpu=True)
    x = jax.ShapeDtypeStruct((s.batch, s.seq, s.hidden), jnp.bfloat16, sharding=sharding)
    apply = _Apply(model, layer)

    def loss(variables, x):
        return jnp.mean(jnp.square(apply(variables, x).astype(jnp.float32)))

    with context if context is not None else contextlib.nullcontext():
        start = time.perf_counter()
        variables = jax.eval_shape(lambda x: nn.meta.unbox(model.init(jax.random.key(0), x)), x)
        variables = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            variables,
        )
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    return {"hlo": compiled.as_text(), "trace_s": traced, "compile_s": compile_s}


# ----------------------------------------------------------------------------- reading the HLO


def _is_gemm(instruction: str) -> bool:
    """cuBLAS GEMMs (te_flax's, and TE's in XLA) and TE's own GEMM custom call; every other
    custom call (TE's norm, activation and quantize kernels) is described as ``GEMM <target>``
    by ``te_flax._tools.hlo``."""
    if instruction == "FP8 GEMM":
        return True
    target = instruction.removeprefix("GEMM ").lower()
    return instruction.startswith("GEMM ") and ("gemm" in target or "matmul" in target)


def summarize(hlo_text: str, layer: str, s: Shape, recipe: str) -> dict:
    """Bytes of the GEMMs and of every other kernel, the kernel count and the modelled time."""
    from te_flax._tools.hlo import entry_rows, shape_bytes

    rows = entry_rows(hlo_text)
    for row in rows:  # without a GEMM's workspace (TE's GEMM returns its own, as a byte array)
        if _is_gemm(row["instruction"]):
            row["bytes"] -= sum(
                shape_bytes(w) for w in re.findall(r"[su]8\[[0-9,]*\]", row["result"])
            )
    gemms = [r for r in rows if _is_gemm(r["instruction"])]
    others = [r for r in rows if not _is_gemm(r["instruction"])]
    projection, attention = gemm_flops(layer, s)
    peak = PEAK_FLOPS["fp8" if recipe == "delayed" else "bf16"]
    gemm_bytes = sum(r["bytes"] for r in gemms)
    gemm_s = max(projection / peak + attention / PEAK_FLOPS["bf16"], gemm_bytes / HBM_BYTES_PER_S)
    other_s = sum(r["bytes"] / HBM_BYTES_PER_S + LAUNCH_S for r in others)
    top = sorted(others, key=lambda r: -r["bytes"])[:5]
    return {
        "gemms": len(gemms),
        "kernels": len(others),
        "gemm_bytes": gemm_bytes,
        "other_bytes": sum(r["bytes"] for r in others),
        "model_s": gemm_s + LAUNCH_S * len(gemms) + other_s,
        "top": [(r["instruction"], r["result"], r["bytes"]) for r in top],
        "all": [
            (r["instruction"], r["result"], r["bytes"])
            for r in sorted(others, key=lambda r: -r["bytes"])
        ],
    }


# ----------------------------------------------------------------------------- model level


MODEL_HEADING = "## Model level"
HISTORY_HEADING = "## Before and after"  # written by hand, kept by every run
MODEL_LAYOUTS = {
    "1 GPU": ("dp", {}),
    "8 GPUs fsdp": ("fsdp", {"fsdp": 8}),
    "8 GPUs tp": ("tp", {"tensor": 8}),
    "8 GPUs tp+sp": ("tp_sp", {"tensor": 8}),  # TransformerLayer(enable_sequence_parallel=True)
}


def _te_mesh_resource(rule_set: str):
    """TE's names for te_flax's mesh axes under one of te_flax's rule sets: the batch over
    ``data`` (and ``fsdp``), the weights over ``fsdp``, the tensor-parallel axis ``tensor`` as
    TE's ``tp_resource``, or its ``tpsp_resource`` where the sequence is split too."""
    from transformer_engine.jax.sharding import MeshResource

    tensor = {"tp": {"tp_resource": "tensor"}, "tp_sp": {"tpsp_resource": "tensor"}}
    return MeshResource(dp_resource="data", fsdp_resource="fsdp", **tensor.get(rule_set, {}))


def model_step(
    s: Shape, layout: str, variant: str, recipe: str, fused_attention: bool, rotary: bool = False
) -> dict:
    """Two TransformerLayers of ``variant`` (TE's, or te_flax's with its kernels or its XLA
    stages), one training step on 1 or 8 deviceless H100s: the same mesh, input sharding and
    layout in both libraries (TE's logical axes mapped by ``_te_mesh_resource``)."""
    import flax.linen as nn
    from jax.experimental import topologies

    from te_flax.sharding import load_axis_rules, make_mesh

    rule_set, mesh_shape = MODEL_LAYOUTS[layout]
    devices = 8 if mesh_shape else 1
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET_CONFIG.read_text(), topology=f"1x1x{devices}"
    )
    mesh = make_mesh(mesh_shape, devices=topology.devices)
    ours = load_axis_rules(rule_set)
    if variant == "TE":
        import transformer_engine.jax as te
        import transformer_engine.jax.flax as library
        from transformer_engine.common import recipe as te_recipes

        fp8 = te_recipes.DelayedScaling() if recipe == "delayed" else None
        context = te.autocast(
            enabled=fp8 is not None, recipe=fp8, mesh_resource=_te_mesh_resource(rule_set)
        )
        fp8_recipe = None
    else:
        import te_flax.linen as library
        from te_flax._ops.kernels import pallas_kernels
        from te_flax.quantize import DelayedScaling

        switch = "auto" if variant == "te_flax kernels" else "0"
        context = pallas_kernels(switch, assume_gpu=True)
        fp8_recipe = DelayedScaling() if recipe == "delayed" else None

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                layer = peer_layer(
                    library,
                    "TransformerLayer",
                    s,
                    fp8_recipe,
                    fused_attention,
                    sequence_parallel=rule_set == "tp_sp",
                    rotary=rotary,
                )
                x = _output(layer(x, deterministic=True))
            return x

    model = Two()
    shape = jax.ShapeDtypeStruct((s.batch, s.seq, s.hidden), jnp.bfloat16)
    with jax.set_mesh(mesh), context:
        # TE's rules map its own logical axis names once its mesh resource is set.
        rules = library.extend_logical_axis_rules(()) if variant == "TE" else ours
        with nn.logical_axis_rules(rules):
            boxed = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), shape)
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
            variables = jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=sharding
                ),
                jax.tree.map(
                    lambda leaf: leaf.value if isinstance(leaf, nn.Partitioned) else leaf,
                    boxed,
                    is_leaf=lambda leaf: isinstance(leaf, nn.Partitioned),
                ),
                shardings,
            )
            x_sharding = jax.sharding.NamedSharding(
                mesh, nn.logical_to_mesh_axes(("batch", None, None), ours)
            )
            x = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=x_sharding)

            def loss(variables, x):
                return jnp.mean(jnp.square(_output(model.apply(variables, x)).astype(jnp.float32)))

            start = time.perf_counter()
            lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(variables, x)
            compiled = lowered.compile()
            elapsed = time.perf_counter() - start
    hlo_text = compiled.as_text()
    # Every Pallas kernel call: in a partitioned program a kernel's call does not carry its name
    # in the op_name that te_flax._tools.hlo.kernel_names reads.
    pallas = sum('"__gpu$xla.gpu.triton"' in line for line in hlo_text.splitlines())

    summary = summarize(hlo_text, "TransformerLayer", s, recipe)  # bytes per device
    # Each device runs 1/devices of the GEMM flops (tokens or features split).
    projection, attention = gemm_flops("TransformerLayer", s)
    peak = PEAK_FLOPS["fp8" if recipe == "delayed" else "bf16"]
    gemm_s = 2 * (projection / peak + attention / PEAK_FLOPS["bf16"]) / devices
    other_s = summary["other_bytes"] / HBM_BYTES_PER_S + LAUNCH_S * summary["kernels"]
    return {
        **summary,
        "pallas": pallas,
        "model_s": max(gemm_s, summary["gemm_bytes"] / HBM_BYTES_PER_S)
        + LAUNCH_S * summary["gemms"]
        + other_s,
        "compile_s": elapsed,
    }


def _output(result):
    return result[0] if isinstance(result, tuple) else result


# ----------------------------------------------------------------------------- the report


def _gb(value: float) -> str:
    return f"{value / 1e9:.3f}"


def _ratios(te: dict, ours: list[dict], key: str) -> str:
    return "; ".join(f"{o[key] / te[key]:.2f}" for o in ours)


def report(results: dict, shapes: list[Shape], command: str, attention: str) -> str:
    lines = [
        "# te_flax beside TransformerEngine 2.20.2: deviceless H100 training steps",
        "",
        f"Command: `{command}`",
        "",
        "Bytes are read from the optimized H100 programs (every entry instruction's operands",
        "read once and results written once). The time is a MODEL, not a GPU measurement:",
        f"non-GEMM kernels bytes / {HBM_BYTES_PER_S / 1e12:.2f} TB/s + 2 us each; the GEMMs",
        "max(flops / peak, bytes / bandwidth) + 2 us each (peaks: BF16 989, FP8 1979 TFLOP/s,",
        "dense), with the layer's analytic GEMM flops. SwiGLU MLPs, RMSNorm, bf16 activations",
        "and parameters; delayed scaling is each library's DelayedScaling().",
        f"TransformerLayer's attention: {ATTENTION[attention]}.",
        "",
    ]
    for s in shapes:
        lines += [
            f"## tokens {s.tokens} (seq {s.seq}), hidden {s.hidden}, MLP {s.mlp}, heads {s.heads}",
            "",
            "| layer | recipe | variant | kernels (non-GEMM) | GEMMs | non-GEMM GB | GEMM GB | "
            "model ms | trace s | compile s |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for (shape, layer, recipe, variant), r in results.items():
            if shape != s or "error" in r:
                continue
            lines.append(
                f"| {layer} | {recipe} | {variant} | {r['kernels']} | {r['gemms']} | "
                f"{_gb(r['other_bytes'])} | {_gb(r['gemm_bytes'])} | {r['model_s'] * 1e3:.3f} | "
                f"{r['trace_s']:.2f} | {r['compile_s']:.2f} |"
            )
        lines += ["", "te_flax / TE (kernels; XLA stages):", ""]
        lines += ["| layer | recipe | non-GEMM bytes | model time | trace+compile |"]
        lines += ["| --- | --- | ---: | ---: | ---: |"]
        for layer in LAYERS:
            for recipe in ("none", "delayed"):
                te = results.get((s, layer, recipe, "TE"))
                ours = [results.get((s, layer, recipe, v)) for v in VARIANTS[1:]]
                if not te or "error" in te or any(not o or "error" in o for o in ours):
                    continue
                ratio = partial(_ratios, te, ours)
                total = "; ".join(
                    f"{(o['trace_s'] + o['compile_s']) / (te['trace_s'] + te['compile_s']):.2f}"
                    for o in ours
                )
                lines.append(
                    f"| {layer} | {recipe} | {ratio('other_bytes')} | {ratio('model_s')} | "
                    f"{total} |"
                )
        lines += ["", "Largest non-GEMM instructions (FP8, delayed):", ""]
        for (shape, layer, recipe, variant), r in results.items():
            if shape != s or recipe != "delayed" or "error" in r:
                continue
            tops = ", ".join(f"{name} {result} {b / 1e6:.0f} MB" for name, result, b in r["top"])
            lines.append(f"- {layer}, {variant}: {tops}")
        errors = [
            f"- {layer} {recipe} {variant}: {r['error']}"
            for (shape, layer, recipe, variant), r in results.items()
            if shape == s and "error" in r
        ]
        if errors:
            lines += ["", "Not compiled:", "", *errors]
        lines.append("")
    return "\n".join(lines)


def model_report(
    shapes: list[Shape],
    command: str,
    fused_attention: bool,
    variants: list[str],
    rotary: bool = False,
) -> str:
    """The model-level section: per token count, every layout, variant and recipe."""
    attention = "cuDNN's fused kernel" if fused_attention else "each library's unfused softmax"
    lines = [
        MODEL_HEADING + ": two TransformerLayers, one step, per device",
        "",
        f"Command: `{command}`",
        "",
        "FP8 (delayed) and BF16; te_flax with its kernels (auto) and its XLA stages (0); "
        f"attention: {attention}"
        f"{', rotary position embeddings' if rotary else ''}. Time: the MODEL above, the "
        "GEMM flops split over the devices; collectives are not modelled. FP8/BF16: the BF16 "
        "step's time over the FP8 step's (a speed-up) and the FP8 step's bytes over the BF16 "
        "step's.",
    ]
    for s in shapes:
        lines += ["", *_model_table(s, fused_attention, variants, rotary)]
    return "\n".join([*lines, ""])


def _model_table(s: Shape, fused_attention: bool, variants: list[str], rotary: bool) -> list[str]:
    lines = [
        f"### tokens {s.tokens} (seq {s.seq}), hidden {s.hidden}, MLP {s.mlp}, heads {s.heads}",
        "",
        "| layout | recipe | variant | Pallas kernels | non-GEMM kernels | non-GEMM GB | all GB "
        "| model ms | FP8/BF16 time | FP8/BF16 bytes | compile s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    results = {}
    for layout in MODEL_LAYOUTS:
        for variant in variants:
            for recipe in ("none", "delayed"):
                r = results[layout, variant, recipe] = model_step(
                    s, layout, variant, recipe, fused_attention, rotary
                )
                r["all_bytes"] = r["other_bytes"] + r["gemm_bytes"]
                bf16 = results[layout, variant, "none"]
                lines.append(
                    f"| {layout} | {recipe} | {variant} | {r['pallas']} | {r['kernels']} | "
                    f"{_gb(r['other_bytes'])} | {_gb(r['all_bytes'])} | "
                    f"{r['model_s'] * 1e3:.3f} | {bf16['model_s'] / r['model_s']:.2f}x | "
                    f"{r['all_bytes'] / bf16['all_bytes']:.2f} | {r['compile_s']:.1f} |"
                )
                print(lines[-1], flush=True)
    if "TE" in variants and len(variants) > 1:
        ours = [v for v in variants if v != "TE"]
        lines += [
            "",
            f"te_flax / TE ({'; '.join(ours)}):",
            "",
            "| layout | recipe | all bytes | model time |",
            "| --- | --- | ---: | ---: |",
        ]
        for layout in MODEL_LAYOUTS:
            for recipe in ("none", "delayed"):
                te = results[layout, "TE", recipe]
                mine = [results[layout, v, recipe] for v in ours]
                lines.append(
                    f"| {layout} | {recipe} | {_ratios(te, mine, 'all_bytes')} | "
                    f"{_ratios(te, mine, 'model_s')} |"
                )
    return lines


def _before(text: str, heading: str) -> str:
    """``text`` up to the line that starts with ``heading`` (a level-two heading; a deeper one
    that contains it is not it)."""
    return text.split(f"\n{heading}", 1)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS))
    parser.add_argument("--recipes", nargs="+", default=["none", "delayed"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        default="fused",
        help="TransformerLayer's attention in both libraries: cuDNN's fused kernel (each "
        "library's H100 default) or the unfused softmax path",
    )
    parser.add_argument(
        "--list", action="store_true", help="print every non-GEMM instruction, largest first"
    )
    parser.add_argument(
        "--no-write", action="store_true", help=f"print only; leave {RESULTS.name} as it is"
    )
    parser.add_argument(
        "--rotary",
        action="store_true",
        help="--model: TransformerLayer with rotary position embeddings (enable_rotary_pos_emb)",
    )
    parser.add_argument(
        "--model",
        action="store_true",
        help="two TransformerLayers on 1 and 8 GPUs (TE's beside te_flax's where TE imports)",
    )
    args = parser.parse_args(argv)
    if args.rotary and not args.model:
        parser.error("--rotary applies to --model only")
    command = "python -m bench.te_peer " + " ".join(argv if argv is not None else sys.argv[1:])
    fused = args.attention == "fused"
    variants = list(args.variants)
    try:
        _te_deviceless(fused)
    except ImportError:  # te_flax alone, outside TE's environment
        variants = [v for v in variants if v != "TE"]
    if args.model:
        hidden = args.hidden[0]
        shapes = [
            Shape(tokens, args.seq, hidden, 4 * hidden, hidden // 128) for tokens in args.tokens
        ]
        text = RESULTS.read_text() if RESULTS.exists() else ""
        text = _before(text, MODEL_HEADING).rstrip() + "\n\n" if text else ""
        model = model_report(shapes, command.strip(), fused, variants, args.rotary)
        if args.no_write:
            print(model)
        else:
            RESULTS.write_text(text + model)
        return
    shapes = [
        Shape(tokens, args.seq, hidden, 4 * hidden, max(hidden // 128, 1))
        for hidden in args.hidden
        for tokens in args.tokens
    ]
    results = {}
    for s in shapes:
        for layer in args.layers:
            for recipe in args.recipes:
                for variant in variants:
                    key = (s, layer, recipe, variant)
                    try:
                        compiled = compile_step(variant, layer, s, recipe, fused)
                    except Exception as error:  # a layer one library cannot compile: reported
                        results[key] = {"error": f"{type(error).__name__}: {error}"[:300]}
                        print(layer, recipe, variant, results[key]["error"], flush=True)
                        continue
                    results[key] = {
                        **summarize(compiled["hlo"], layer, s, recipe),
                        "trace_s": compiled["trace_s"],
                        "compile_s": compiled["compile_s"],
                    }
                    r = results[key]
                    print(
                        f"{layer} {recipe} {variant}: {_gb(r['other_bytes'])} GB non-GEMM, "
                        f"{r['model_s'] * 1e3:.3f} ms model, "
                        f"{r['trace_s']:.1f}+{r['compile_s']:.1f} s",
                        flush=True,
                    )
                    if args.list:
                        for name, result, size in r["all"]:
                            print(f"    {size / 1e6:9.1f} MB  {name}  {result}", flush=True)
    if args.no_write:
        return
    text = report(results, shapes, command.strip(), args.attention)
    # The sections written otherwise (by hand, by --model) are kept.
    old = RESULTS.read_text() if RESULTS.exists() else ""
    for heading in (HISTORY_HEADING, MODEL_HEADING):  # in this order in the file
        if f"\n{heading}" in old:
            section = heading + old.split(f"\n{heading}", 1)[1]
            if heading == HISTORY_HEADING:
                section = _before(section, MODEL_HEADING)
            text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
