"""Model-level figures: a TransformerLayer and the example GPT's training step, deviceless H100.

``JAX_PLATFORMS=cpu python -m bench.model`` compiles training steps with XLA's real GPU compiler
for the H100 SXM target of the test suite (te_flax's Pallas kernels and cuDNN attention as a GPU
process chooses them) and writes ``bench/RESULTS_model.md``: the FP8 GEMMs among all GEMMs, the
cuDNN attention calls, the bytes the program moves and a **modelled** step time, in BF16, te_flax
FP8 (delayed scaling) and Flax FP8 (the same model written with Flax's FP8 ops,
``bench/flax_model.py``), at hidden 4096 and 8192:

* ``--section layer``: ``value_and_grad`` of one Linen ``TransformerLayer`` (bf16 compute,
  float32 parameters, causal self-attention; ``--attention xla`` for XLA's attention);
* ``--section gpt``: the example GPT's ``train_step`` (``examples/lm``), its blocks under
  ``nn.scan`` (``--layers``), ``--remat on|off|dots``, ``--batch``.

Each configuration's figures are kept in ``bench/results_model.json`` (``--hidden`` and
``--variants`` pick configurations, ``--render`` only rewrites the results file). A scanned
body's instructions count once per iteration (``program_rows``).

The model, not a measurement: each instruction of the compiled program costs
``max(FLOPs / peak, bytes / bandwidth)`` with H100 SXM's public peaks (989 TFLOP/s dense BF16,
1979 TFLOP/s dense FP8, 3.35 TB/s HBM3), the GEMMs' FLOPs from their shapes, every other
instruction's bytes as XLA's cost analysis counts a fusion's (operands read once, result written
once); the sum is the modelled step time. It ignores launch overheads, overlap and the GEMMs'
real efficiency, so it says where the time would go, not what a GPU measures.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench.flax_model import FlaxBlock, ScannedLM  # noqa: E402
from bench.h100 import _sharding, available  # noqa: E402
from bench.models import AMAX_HISTORY_LEN  # noqa: E402
from te_flax import attention as te_attention  # noqa: E402
from te_flax._ops.kernels import pallas_kernels  # noqa: E402
from te_flax._tools.hlo import (  # noqa: E402
    _INDEX_COMMENT,
    _INSTRUCTION,
    _OPERAND_NAME,
    FP8_GEMM,
    computation_rows,
    parse_gemms,
    shape_bytes,
)
from te_flax.quantize import DelayedScaling  # noqa: E402
from te_flax.training import merge_fp8_state  # noqa: E402

# H100 SXM public peaks (dense, no sparsity).
PEAK_BF16 = 989e12  # FLOP/s
PEAK_FP8 = 1979e12  # FLOP/s
BANDWIDTH = 3.35e12  # bytes/s
OUT = Path(__file__).parent / "RESULTS_model.md"
STORE = Path(__file__).parent / "results_model.json"
HIDDEN_SIZES = (4096, 8192)
BATCH, SEQ = 2, 2048  # 4096 tokens per step
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) ")
_WHILE = re.compile(r"\swhile\(.*\bbody=%([^\s,]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_FUSION_CALL = re.compile(r"\sfusion\(.*\bcalls=%([^\s,]+)")
# An instruction of the step outside ``value_and_grad`` (outside every ``jvp``): the update.
_OPTIMIZER = re.compile(r"jit\([^)]*\)/(?!.*jvp\()")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALL = re.compile(r"\scall\(.*\bto_apply=%([^\s,]+)")
# GEMMs XLA did not give cuBLAS: Triton and cuDNN GEMM fusions (and plain dots).
_GEMM_FUSIONS = ("__triton_gemm", "__cudnn$fusion")


def _layer(hidden: int, fp8: bool, implementation: str | None) -> te_nn.TransformerLayer:
    return te_nn.TransformerLayer(
        hidden_size=hidden,
        mlp_hidden_size=4 * hidden,
        num_attention_heads=hidden // 128,
        self_attn_mask_type="causal",
        enable_relative_embedding=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        dtype=jnp.bfloat16,
        recipe=DelayedScaling() if fp8 else None,
        implementation=implementation,
    )


def _abstract(tree):
    sharding = _sharding()
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        nn.meta.unbox(tree),
    )


def _compile(step, *args) -> tuple[str, float]:
    """The optimized H100 HLO of ``jit(step)(*args)`` (abstract arguments), and its trace +
    compile seconds. The deviceless compile runs on a CPU host: te_flax's kernels and attention
    are chosen as a GPU process chooses them (Pallas kernels, cuDNN attention)."""
    start = time.perf_counter()
    with (
        pallas_kernels("auto", assume_gpu=True),
        mock.patch.object(te_attention, "_fused_implementation", lambda query: "cudnn"),
    ):
        lowered = jax.jit(step).lower(*args)
    hlo_text = lowered.compile().as_text()
    return hlo_text, time.perf_counter() - start


def compile_step(
    hidden: int, fp8: bool, implementation: str | None = "xla", impl: str = "te_flax"
) -> tuple[str, float]:
    """The optimized H100 HLO of one TransformerLayer training step (``value_and_grad`` of the
    mean square of its output), and its trace + compile seconds. ``impl="flax"``: the same
    block written with Flax's layers and FP8 ops (``bench.flax_model.FlaxBlock``)."""
    x = jax.ShapeDtypeStruct((BATCH, SEQ, hidden), jnp.bfloat16, sharding=_sharding())
    if impl == "flax":
        block = FlaxBlock(
            heads=hidden // 128,
            head_dim=128,
            mlp_dim=4 * hidden,
            fp8=fp8,
            attention=implementation or "cudnn",
        )
        apply = lambda variables, x: block.apply(variables, x)[0]  # noqa: E731
        init = lambda x: block.init(jax.random.key(0), x)  # noqa: E731
    else:
        layer = _layer(hidden, fp8, implementation)
        apply = lambda variables, x: layer.apply(  # noqa: E731
            merge_fp8_state(variables), x, deterministic=True
        )
        init = lambda x: layer.init(jax.random.key(0), x, deterministic=True)  # noqa: E731

    def loss(variables, x):
        return jnp.mean(jnp.square(apply(variables, x).astype(jnp.float32)))

    variables = _abstract(jax.eval_shape(init, x))
    return _compile(jax.value_and_grad(loss, argnums=(0, 1)), variables, x)


def gpt_config(hidden: int, layers: int, fp8: bool, batch: int = BATCH, seq: int = SEQ):
    """The example's configuration (configs/lm_small.yaml) at ``hidden`` (128-wide heads, MLP 4
    x hidden), ``layers`` layers, batch x sequence of this bench, delayed scaling with the
    Flax peer's amax history."""
    from examples.lm.config import DEFAULT_CONFIG, load_config

    overrides = [
        f"model.d_model={hidden}",
        f"model.heads={hidden // 128}",
        "model.head_dim=128",
        f"model.mlp_dim={4 * hidden}",
        f"model.layers={layers}",
        f"train.batch={batch}",
        f"train.seq_len={seq}",
        f"train.recipe={'delayed' if fp8 else 'none'}",
        f"train.amax_history_len={AMAX_HISTORY_LEN}",
    ]
    return load_config(DEFAULT_CONFIG, overrides)


def compile_gpt_step(
    hidden: int,
    fp8: bool,
    impl: str = "te_flax",
    layers: int = 2,
    remat: str = "on",
    batch: int = BATCH,
    seq: int = SEQ,
) -> tuple[str, float]:
    """The optimized H100 HLO of the example GPT's training step (``train_step`` of
    ``examples/lm/train.py``: te_flax's ``value_and_grad`` of the cross-entropy, then AdamW
    through ``apply_gradients``), the blocks under ``nn.scan``, each under ``nn.remat`` as
    ``remat`` says (``ScannedLM``); ``impl="flax"``: the blocks written with Flax's layers and
    FP8 ops."""
    from types import SimpleNamespace

    import te_flax
    from examples.lm import model_linen
    from examples.lm.train import make_optimizer, make_recipe, make_train_step
    from te_flax.training import init_optimizer

    config = gpt_config(hidden, layers, fp8, batch, seq)
    c = config.model
    if impl == "flax":
        block, attributes = FlaxBlock, dict(heads=c.heads, head_dim=c.head_dim, mlp_dim=c.mlp_dim)
        attributes["fp8"] = fp8
    else:
        block, attributes = model_linen.Block, {"config": c}
    model = ScannedLM(
        block, attributes, c.vocab_size, c.d_model, c.layers, remat, te_final_norm=impl != "flax"
    )
    frontend = SimpleNamespace(
        apply=lambda variables, tokens: model.apply(variables, tokens, mutable=["intermediates"])
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=_sharding())
    tx = make_optimizer(config)
    recipe = make_recipe(config) if impl != "flax" else None

    train_step = make_train_step(frontend, tx)

    with te_flax.autocast(enabled=recipe is not None, recipe=recipe):
        variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
        variables = nn.meta.unbox(variables)
        state = {
            "variables": variables,
            "opt_state": jax.eval_shape(lambda v: init_optimizer(tx, v), variables),
        }
        return _compile(train_step, _abstract(state), tokens, tokens)


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines by name, and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry = ""
    current: list[str] | None = None
    # without the ``/*index=5*/`` comments of long tuples, whose "=" ends an instruction's type
    for line in _INDEX_COMMENT.sub("", hlo_text).splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return computations, entry


def _fusion_bytes(line: str, fused: list[str], results: dict[str, str]) -> float | None:
    """The bytes of a fusion that slices or updates in place: an operand read only through
    ``dynamic-slice`` (directly or through bitcasts) counts the slices, the buffer a root
    ``dynamic-update-slice`` updates in place is not read and only the update is written (as
    XLA's cost analysis counts them). None for any other fusion (the plain count applies)."""
    parsed = [match.groups() for text in fused if (match := _INSTRUCTION.match(text))]
    if not any(opcode in ("dynamic-slice", "dynamic-update-slice") for *_, opcode, _ in parsed):
        return None
    parameters: dict[str, int] = {}
    users: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    root = ""
    for text, (name, result, opcode, operands) in zip(
        [t for t in fused if _INSTRUCTION.match(t)], parsed, strict=True
    ):
        results[name] = result
        if opcode == "parameter":
            parameters[name] = int(text.split("parameter(")[1].split(")")[0])
        for position, operand in enumerate(_OPERAND_NAME.findall(operands)):
            users[operand].append((opcode, position, name))
        if text.lstrip().startswith("ROOT"):
            root = name
    outer = _INSTRUCTION.match(line)
    assert outer is not None, line
    operand_names = _OPERAND_NAME.findall(outer.group(4))

    def through_bitcasts(name: str) -> list[tuple[str, int, str]]:
        """The uses of ``name``, a bitcast's (a view of the same bytes) replaced by its own."""
        uses = []
        for opcode, position, user in users[name]:
            uses += through_bitcasts(user) if opcode == "bitcast" else [(opcode, position, user)]
        return uses

    read: dict[str, float] = {}
    for parameter, index in parameters.items():
        uses = through_bitcasts(parameter)
        if uses and all(op == "dynamic-slice" and pos == 0 for op, pos, _ in uses):
            size = sum(shape_bytes(results[user]) for *_, user in uses)
        elif uses and all(op == "dynamic-update-slice" and pos == 0 for op, pos, _ in uses):
            size = 0.0
        else:
            size = shape_bytes(results.get(operand_names[index], ""))
        read[operand_names[index]] = max(read.get(operand_names[index], 0.0), size)
    root_line = next(t for t in fused if t.lstrip().startswith("ROOT"))
    outputs = [root]
    if " tuple(" in root_line:
        outputs = _OPERAND_NAME.findall(root_line.split(" tuple(")[1].split(")")[0])
    written = 0.0
    for output in outputs:
        definition = next(
            (t for t in fused if re.match(rf"\s*(?:ROOT\s+)?%{re.escape(output)} =", t)), ""
        )
        if " dynamic-update-slice(" in definition:
            update = _OPERAND_NAME.findall(definition.split(" dynamic-update-slice(")[1])[1]
            written += shape_bytes(results[update])
        else:
            written += shape_bytes(results[output])
    return sum(read.values()) + written


def program_rows(hlo_text: str) -> list[dict]:
    """``computation_rows`` of every instruction the step executes: the entry computation's,
    and those of the computations it calls (``call``) and loops over (``while``: the body's
    rows repeated its known trip count, the condition's left out); a fusion that slices its
    operands or updates one in place counts the slices and the update (``_fusion_bytes``)."""
    computations, entry = _computations(hlo_text)
    results: dict[str, str] = {}
    op_names: dict[str, str] = {}
    for lines in computations.values():
        for line in lines:
            if match := _INSTRUCTION.match(line):
                results[match.group(1)] = match.group(2)
                op_name = _OP_NAME.search(line)
                op_names[match.group(1)] = op_name.group(1) if op_name else ""
    fusion_bytes = {}
    for lines in computations.values():
        for line in lines:
            if (fusion := _FUSION_CALL.search(line)) and (match := _INSTRUCTION.match(line)):
                size = _fusion_bytes(line, computations[fusion.group(1)], results)
                if size is not None:
                    fusion_bytes[match.group(1)] = size

    def rows(name: str, times: int) -> list[dict]:
        out = []
        for row in computation_rows(computations[name]):
            row = {**row, "op_name": op_names.get(row["name"], "")}
            if row["name"] in fusion_bytes:
                row["bytes"] = fusion_bytes[row["name"]]
            out += [row] * times
        for line in computations[name]:
            if (loop := _WHILE.search(line)) and (trips := _TRIPS.search(line)):
                out += rows(loop.group(1), times * int(trips.group(1)))
            elif (loop := _WHILE.search(line)) is not None:
                raise ValueError(f"a while loop without a known trip count: {line[:200]}")
            elif (call := _CALL.search(line)) is not None:
                out += rows(call.group(1), times)
        return out

    return rows(entry, 1)


def attention_flops(hidden: int, backward: bool, batch: int = BATCH) -> float:
    """FLOPs of cuDNN's causal flash attention in this step: ``Q.K^T`` and ``P.V`` forward (2
    GEMMs); the backward recomputes the scores and adds dV, dP, dQ, dK (5 GEMMs); each
    ``2 * batch * seq^2 * hidden``, halved by the causal mask."""
    gemms = 5 if backward else 2
    return gemms * 2 * batch * SEQ * SEQ * hidden * 0.5


def modelled(hlo_text: str, hidden: int, batch: int = BATCH) -> dict:
    """GEMM counts, bytes and the modelled time of one compiled step (see the module doc)."""
    gemms = {gemm.name: gemm for gemm in parse_gemms(hlo_text)}
    rows = program_rows(hlo_text)
    by_kind: dict[str, float] = defaultdict(float)
    total = 0.0
    for row in rows:
        gemm = gemms.get(row["name"])
        flops = gemm.flops if gemm else 0
        if row["instruction"].startswith("GEMM __cudnn$fmha"):
            flops = attention_flops(hidden, "Backward" in row["instruction"], batch)
        peak = PEAK_FP8 if gemm and gemm.target == FP8_GEMM else PEAK_BF16
        seconds = max(flops / peak, row["bytes"] / BANDWIDTH)
        total += seconds
        kind = row["instruction"] if gemm is None else ("FP8 GEMM" if gemm.fp8 else "BF16 GEMM")
        kind = kind.replace("GEMM __cudnn$", "cuDNN ")
        if gemm is None and _OPTIMIZER.match(row["op_name"]):
            kind = "optimizer update"
        by_kind[kind.split(" kLoop")[0].split(" kInput")[0]] += seconds
    executed = [gemms[row["name"]] for row in rows if row["name"] in gemms]
    fusion_gemms = [
        row
        for row in rows
        if row["instruction"] == "dot" or any(kind in row["instruction"] for kind in _GEMM_FUSIONS)
    ]
    return {
        "fp8_gemms": sum(g.fp8 for g in executed),
        "gemms": len(executed) + len(fusion_gemms),
        "attention_calls": sum(row["instruction"].startswith("GEMM __cudnn$fmha") for row in rows),
        "kernels": sum(row["instruction"].startswith("Pallas kernel") for row in rows),
        "bytes": sum(row["bytes"] for row in rows),
        "gemm_flops": sum(g.flops for g in executed),
        "seconds": total,
        "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
    }


VARIANTS = {  # name: (impl, fp8)
    "bf16": ("te_flax", False),
    "fp8": ("te_flax", True),
    "flax_fp8": ("flax", True),
}
LABELS = {"bf16": "BF16", "fp8": "te_flax FP8", "flax_fp8": "Flax FP8"}
SECTIONS = ("layer", "gpt")


def measure(
    section: str, hidden: int, variant: str, attention: str, layers: int, batch: int, remat: str
) -> dict:
    """Compile one configuration and return its figures (``modelled``) and compile seconds."""
    impl, fp8 = VARIANTS[variant]
    if section == "layer":
        hlo_text, seconds = compile_step(hidden, fp8, attention, impl)
    else:
        hlo_text, seconds = compile_gpt_step(hidden, fp8, impl, layers, remat, batch)
    return {**modelled(hlo_text, hidden, batch), "compile": seconds}


REMAT_NAMES = {"on": "remat", "off": "no-remat", "dots": "remat-dots"}
REMAT_TITLES = {"remat": "remat on", "no-remat": "no remat", "remat-dots": "remat saving GEMMs"}
REMAT_TEXT = {
    "remat": "each wrapped in `nn.remat` (nothing saved; the example itself trains without "
    "remat, `--remat off`). ",
    "no-remat": "without remat, as the example trains (`--remat off`). ",
    "remat-dots": "each wrapped in `nn.remat` with the policy "
    "`jax.checkpoint_policies.dots_with_no_batch_dims_saveable` (GEMM outputs saved, the rest "
    "recomputed; `--remat dots`). ",
}


def _gpt(layers: int, batch: int, remat: str) -> str:
    return f"gpt {layers} layers batch {batch} {REMAT_NAMES[remat]}"


def _key(section: str, hidden: int, variant: str, args: argparse.Namespace) -> str:
    where = (
        f"{section} {args.attention}"
        if section == "layer"
        else _gpt(args.layers, args.batch, args.remat)
    )
    return f"{where} {hidden} {variant}"


def _table(store: dict, where: str) -> list[str]:
    lines = [
        "| hidden | model | FP8 GEMMs / all GEMMs | cuDNN attention calls | Pallas kernels | "
        "HBM bytes (GiB) | bytes / BF16 | bytes / Flax FP8 | modelled step (ms, model) | "
        "modelled speed-up over BF16 (model) | compile (s) | top modelled ops (ms, model) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    hiddens = sorted({int(key.split()[-2]) for key in store if key.startswith(where + " ")})
    for hidden in hiddens:
        rows = {v: store.get(f"{where} {hidden} {v}") for v in VARIANTS}
        for variant, r in rows.items():
            if r is None:
                continue
            bf16, flax_fp8 = rows["bf16"], rows["flax_fp8"]
            ratio = {
                other: f"{r['bytes'] / o['bytes']:.3f}" if o else "-"
                for other, o in (("bf16", bf16), ("flax_fp8", flax_fp8))
            }
            speedup = f"{bf16['seconds'] / r['seconds']:.2f}" if bf16 else "-"
            ranked = sorted(r["by_kind"].items(), key=lambda item: -item[1])
            top = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in ranked[:3])
            lines.append(
                f"| {hidden} | {LABELS[variant]} | {r['fp8_gemms']} / {r['gemms']} | "
                f"{r['attention_calls']} | {r['kernels']} | {r['bytes'] / 2**30:.2f} | "
                f"{ratio['bf16']} | {ratio['flax_fp8']} | {1e3 * r['seconds']:.2f} | "
                f"{speedup} | {r['compile']:.0f} | {top} |"
            )
    return lines


def render(store: dict) -> str:
    """RESULTS_model.md from every stored configuration."""
    lines = [
        "# Model level: a TransformerLayer and the example GPT's training step, deviceless H100",
        "",
        f"Batch {BATCH} x sequence {SEQ}, MLP 4 x hidden, 128-wide heads, causal, bf16 "
        "compute, float32 parameters, compiled for the H100 SXM target with XLA's GPU compiler "
        "on a CPU host, te_flax's Pallas kernels and cuDNN attention as chosen on a GPU. "
        "te_flax FP8: delayed scaling (amax history 1024). Flax FP8: the same model written "
        "with `nn.LayerNorm`, `nn.DenseGeneral` and Flax's "
        "`flax.linen.fp8_ops.Fp8DirectDotGeneralOp` (delayed scaling, amax history 1024), "
        "attention through `jax.nn.dot_product_attention(implementation='cudnn')` "
        "(`bench/flax_model.py`). Command: `JAX_PLATFORMS=cpu python -m bench.model` "
        "(`--section`, `--hidden`, `--variants`, `--attention` pick configurations; each run "
        "adds to `bench/results_model.json`, from which this file is written).",
        "",
        "**Modelled step time: a model, not a measurement** (per executed compiled instruction "
        "max(FLOPs / peak, bytes / bandwidth), H100 SXM peaks 989 TFLOP/s BF16, 1979 TFLOP/s "
        "FP8, 3.35 TB/s, summed; a scanned body counts once per layer; see `bench/model.py`). "
        "GEMM counts, bytes and kernels are per executed step (a scanned body times its trip "
        "count). Compile time: trace + compile on a shared 2-core host, only ratios mean "
        "something.",
    ]
    sections = [
        (
            "layer cudnn",
            "TransformerLayer training step, cuDNN attention",
            "`value_and_grad` of the mean square of one Linen `TransformerLayer`'s output "
            "(LayerNorm, fused QKV, causal self-attention, output projection, LayerNorm MLP with "
            "gelu, no bias, no dropout), with respect to the parameters and the input; no "
            "optimizer.",
        ),
        (
            "layer xla",
            "TransformerLayer training step, XLA attention",
            "The same step with `--attention xla`: the attention core as XLA GEMMs and fusions.",
        ),
    ]
    for where in _gpt_sections(store):
        _, layers, _, _, batch, remat = where.split()
        sections.append(
            (
                where,
                f"The example GPT's training step ({layers} scanned layers, "
                f"{REMAT_TITLES[remat]}, batch {batch} x {SEQ})",
                "`train_step` of `examples/lm/train.py` (te_flax's `value_and_grad` of the "
                "cross-entropy, then AdamW through `apply_gradients`, the example's optimizer) "
                f"on the example's GPT (`configs/lm_small.yaml` with d_model = hidden, {layers} "
                "layers, byte vocabulary 256, tied embedding): its `Block`s stacked with "
                "`nn.scan` as the example stacks them, "
                + REMAT_TEXT[remat]
                + "The Flax FP8 peer: the same shell (`bench.flax_model.ScannedLM`) around the "
                "Flax block.",
            )
        )
    for where, title, text in sections:
        if any(key.startswith(where + " ") for key in store):
            lines += ["", f"## {title}", "", text, "", *_table(store, where)]
    lines += ["", "## The goals", "", *_goals(store), "", *NOTES, ""]
    return "\n".join(lines)


def _gpt_sections(store: dict) -> list[str]:
    """The GPT configurations in the store (``_gpt``), the default batch and remat first."""
    found = {key.rsplit(" ", 2)[0] for key in store if key.startswith("gpt ")}
    names = list(REMAT_TEXT)
    return sorted(found, key=lambda where: (int(where.split()[4]), names.index(where.split()[5])))


def _goals(store: dict) -> list[str]:
    """One line per goal and model: projection GEMMs in FP8, bytes against Flax FP8 (<= 0.85),
    modelled FP8 / BF16 speed-up at hidden 8192 (>= 1.6x, a model)."""
    lines = []
    models = [("layer cudnn", "TransformerLayer")]
    for where in _gpt_sections(store):
        _, layers_, _, _, batch, remat = where.split()
        models.append((where, f"GPT, {layers_} layers, batch {batch}, {remat}"))
    for where, model in models:
        found = {}
        for key, r in store.items():
            if key.startswith(where + " "):
                hidden, variant = key[len(where) + 1 :].split()
                found[int(hidden), variant] = r
        hiddens = sorted({hidden for hidden, _ in found})
        fp8 = {h: found[h, "fp8"] for h in hiddens if (h, "fp8") in found}
        gemms = [f"{r['fp8_gemms']} / {r['gemms']} at {h}" for h, r in fp8.items()]
        ratios = [
            f"{r['bytes'] / found[h, 'flax_fp8']['bytes']:.3f} at {h}"
            for h, r in fp8.items()
            if (h, "flax_fp8") in found
        ]
        speedups = [
            f"{found[h, 'bf16']['seconds'] / r['seconds']:.2f}x at {h}"
            for h, r in fp8.items()
            if (h, "bf16") in found
        ]
        lines += [
            f"- {model}: FP8 GEMMs / all GEMMs {', '.join(gemms) or '-'}; te_flax FP8 bytes / "
            f"Flax FP8 bytes {', '.join(ratios) or '-'} (goal <= 0.85); modelled FP8 / BF16 "
            f"speed-up {', '.join(speedups) or '-'} (a model; goal >= 1.6x at 8192)."
        ]
    return lines


NOTES = [
    "## Reading the figures",
    "",
    "- Every projection GEMM is an FP8 cuBLASLt call in both models. The TransformerLayer has "
    "no other GEMM (its attention is the two cuDNN fused calls). In the GPT's step each layer "
    "runs 15 FP8 GEMMs: the four projections forward, three of them again in the backward "
    "loop's recomputation (the MLP's output projection only feeds the residual sum, so remat "
    "does not recompute it), and dgrad and wgrad of each; the three GEMMs left are the tied "
    "byte embedding's output projection (forward, dgrad, wgrad), which the example keeps in "
    "higher precision, and cuDNN's attention runs three times per layer (forward, recomputed "
    "forward, backward).",
    "- TransformerLayer: te_flax FP8 moves about two thirds of the bytes of the same layer "
    "written with Flax's FP8 ops: Flax quantizes with separate XLA fusions (amax of every "
    "operand each step, the scaled copies written and read back), te_flax quantizes once into "
    "both layouts in its kernels and fuses the norm and activation quantization.",
    "- GPT as the example trains it (scan, no remat): te_flax FP8 moves 0.81 (hidden 4096) "
    "and 0.86 (8192) of Flax FP8's bytes at batch 2, where Flax FP8 keeps large residuals for "
    "its backward. With remat on every block 0.94 / 0.95: Flax FP8 recomputes instead of "
    "keeping those residuals (its bytes fall), as te_flax does. With remat saving the GEMM "
    "outputs (`--remat dots`) 0.99: Flax's saved FP8 dot outputs spare its backward the "
    "recomputation, while te_flax's GEMMs run inside its custom-gradient ops, whose quantized "
    "operands the policy does not save, so its norm and activation kernels run again (11 "
    "kernel calls, as with full remat, against 9 without remat). In every layout the FP8 "
    "step moves fewer bytes than the BF16 step (0.98-0.99 at batch 2).",
    "- A scanned layer's kernel is a `dynamic-slice` of its stacked float32 parameter. A "
    "Pallas kernel's custom call takes a buffer, so XLA copied each slice out before te_flax's "
    "quantize kernel read it (8 bytes per weight element per use), and an XLA cast that "
    "writes the transposed float8 layout made XLA's layout assignment transpose the whole "
    "float32 stack before the loop (Flax FP8 pays that: four `wrapped_transpose` fusions of "
    "the stacked kernels, 3 GiB at hidden 4096). te_flax quantizes a kernel traced in a "
    "scan body in its XLA stage, which reads the slice inside its cast, with the float8 data "
    "pinned to row-major so that only float8 is transposed: at hidden 4096, batch 2, the step "
    "went from 40.4 to 34.9 GiB with remat and from 38.6 to 35.9 GiB without. Layers that "
    "are not scanned keep the quantize kernel, which writes both layouts in one pass.",
    "- The modelled FP8 / BF16 speed-up of the GPT step (a model) stays below the layer's "
    "because the step also holds per-parameter work that FP8 does not shorten: AdamW's "
    "update of the float32 parameters ('optimizer update': 3.9 of 15.9 ms at hidden 4096 and "
    "15.6 of 57.8 ms at 8192, batch 2, remat on), the float32 weight slices and gradient "
    "stacks of the scan, the embedding. Its share falls with the tokens per step: 1.34x / "
    "1.40x at 4096 tokens per step, 1.52x / 1.63x at 16384 (batch 8), with remat on.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=SECTIONS, nargs="*", default=list(SECTIONS))
    parser.add_argument("--hidden", type=int, nargs="*", default=list(HIDDEN_SIZES))
    parser.add_argument("--variants", choices=tuple(VARIANTS), nargs="*", default=list(VARIANTS))
    parser.add_argument(
        "--attention", choices=("cudnn", "xla"), default="cudnn", help="the layer's attention"
    )
    parser.add_argument("--layers", type=int, default=2, help="the GPT's scanned layers")
    parser.add_argument("--batch", type=int, default=BATCH, help="the GPT's batch")
    parser.add_argument("--remat", choices=tuple(REMAT_NAMES), default="on", help="the GPT's remat")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--store", type=Path, default=STORE)
    parser.add_argument("--render", action="store_true", help="only rewrite the results file")
    args = parser.parse_args()
    reason = available()
    if reason:
        raise SystemExit(f"the deviceless H100 compile cannot run: {reason}")
    store = json.loads(args.store.read_text()) if args.store.exists() else {}
    for section in [] if args.render else args.section:
        for hidden in args.hidden:
            for variant in args.variants:
                key = _key(section, hidden, variant, args)
                store[key] = measure(
                    section,
                    hidden,
                    variant,
                    args.attention,
                    args.layers,
                    args.batch,
                    args.remat,
                )
                print(key, {k: v for k, v in store[key].items() if k != "by_kind"}, flush=True)
                args.store.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    args.out.write_text(render(store))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
