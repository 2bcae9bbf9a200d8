"""Context-parallel attention: peak bytes per device against sequence length, 1 to 8 devices.

``JAX_PLATFORMS=cpu python -m bench.attention`` (``--quick``: shorter sequences) compiles one
training step (forward and backward of a weighted sum of the output) of ``DotProductAttention``
(causal, float32 logits, bf16 inputs, batch 1, 8 heads of 64) with the sequence sharded over a
``context`` mesh axis of 1, 2, 4 and 8 CPU devices, for both strategies (causal load balancing
on), and reads each device's memory from the compiled program (``memory_analysis()``:
arguments + outputs + temporaries). Nothing is run; the figures are XLA's buffer assignment for
the CPU program, whose attention is the XLA maths (the score matrix is materialised, no flash
kernel), so they show how the per-device footprint scales, not a GPU's. Figures go to
``bench/RESULTS_attention.md`` (``--only cp`` runs this section alone and keeps the others).

FP8 attention (``--only fp8`` runs this section alone and keeps the others in the results
file): the relative L2 error of the output and the q/k/v gradients of one training step of a
causal ``DotProductAttention`` (bf16 inputs, batch 1, 8 heads of 64), under
``DelayedScaling(fp8_dpa=True)`` (second step: the scales then come from the first step's
amax) and ``Float8CurrentScaling(fp8_dpa=True)``, and of the BF16 attention itself, each
against the float32 attention of the same (bf16-valued) inputs. Run on the CPU: the float8
emulation is exact, so the errors are the ones a GPU gives up to the order of float32 sums.

Packing (``--only packing``): a fixed corpus of documents (log-normal lengths, 32 to 8192
tokens) in rows of 8192 tokens, one document per row (padded) against documents packed
first-fit-decreasing several to a row (``SequenceDescriptor.from_segment_ids_and_pos``). The
attention FLOPs of each layout are the compiled training step's (XLA's cost analysis of one
row, times the rows); beside them the FLOPs a kernel that skips masked 128 x 128 tiles would
do, counted from the masks (a model), and the FLOPs of the attended pairs alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import te_flax.linen as te_nn  # noqa: E402
from bench.memory import compiled_memory  # noqa: E402
from te_flax.attention import SequenceDescriptor  # noqa: E402
from te_flax.quantize import DelayedScaling, Float8CurrentScaling  # noqa: E402
from te_flax.sharding import make_mesh  # noqa: E402

HEADS, HEAD_DIM = 8, 64
OUT = Path(__file__).resolve().parent / "RESULTS_attention.md"


def peak_bytes(seq: int, cp_size: int, strategy: str) -> int:
    """Arguments + outputs + temporaries of one device's compiled training step."""
    module = te_nn.DotProductAttention(
        head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        attn_mask_type="causal",
        context_parallel_axis="context",
        context_parallel_strategy=strategy,
        context_parallel_causal_load_balanced=cp_size > 1,
    )

    def loss(q, k, v):
        out = module.apply({}, q, k, v)
        return jnp.sum(out.astype(jnp.float32) * jnp.float32(0.5))

    shape = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), jnp.bfloat16)
    with jax.set_mesh(make_mesh({"data": 8 // cp_size, "context": cp_size})):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    memory = compiled_memory(compiled)
    return memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]


PACKING_HEADING = "## Packed against padded rows: attention FLOPs at 8192 tokens"
ROW, TILE = 8192, 128


def _produced(command: str, start: float) -> str:
    """A section's opening: the command, its minutes since ``start`` and the time."""
    minutes = (time.time() - start) / 60
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"Produced by `{command}` ({minutes:.1f} min, {when})."


def corpus(n_docs: int = 256, seed: int = 0) -> list[int]:
    """Document lengths: log-normal (median about 900 tokens), clipped to 32 .. ROW."""
    lengths = np.random.default_rng(seed).lognormal(np.log(900.0), 1.0, n_docs)
    return [int(n) for n in np.clip(lengths, 32, ROW)]


def pack(lengths: list[int]) -> list[list[int]]:
    """First-fit decreasing: each row a list of document lengths summing to at most ROW."""
    rows: list[list[int]] = []
    for n in sorted(lengths, reverse=True):
        row = next((r for r in rows if sum(r) + n <= ROW), None)
        if row is None:
            rows.append([n])
        else:
            row.append(n)
    return rows


def row_segments(row: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (1, 2, ...; 0 for padding) and positions of one packed row."""
    ids = np.zeros(ROW, np.int32)
    pos = np.zeros(ROW, np.int32)
    start = 0
    for i, n in enumerate(row):
        ids[start : start + n] = i + 1
        pos[start : start + n] = np.arange(n)
        start += n
    return ids, pos


def attended_pairs(ids: np.ndarray) -> np.ndarray:
    """[ROW, ROW] bool: query i attends key j (same document, not padding, j <= i)."""
    same = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0)
    return same & np.tri(ROW, dtype=bool)


def tiles_touched(pairs: np.ndarray) -> int:
    """128 x 128 tiles holding at least one attended pair."""
    blocks = pairs.reshape(ROW // TILE, TILE, ROW // TILE, TILE)
    return int(blocks.any(axis=(1, 3)).sum())


def step_flops(packed: bool) -> float:
    """XLA's FLOP count of one row's compiled causal training step (forward + backward)."""
    module = te_nn.DotProductAttention(
        head_dim=HEAD_DIM, num_attention_heads=HEADS, attn_mask_type="causal",
        transpose_batch_sequence=False, qkv_layout="thd_thd_thd" if packed else "bshd_bshd_bshd",
    )  # fmt: skip

    def loss(q, k, v, ids, pos):
        kwargs = {}
        if packed:
            kwargs["sequence_descriptor"] = SequenceDescriptor.from_segment_ids_and_pos(ids, pos)
        out = module.apply({}, q, k, v, **kwargs)
        return jnp.sum(out.astype(jnp.float32))

    shape = jax.ShapeDtypeStruct((1, ROW, HEADS, HEAD_DIM), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct((1, ROW), jnp.int32)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return float(step.lower(shape, shape, shape, ints, ints).compile().cost_analysis()["flops"])


def packing_section(command: str) -> list[str]:
    start = time.time()
    lengths = corpus()
    packed_rows = pack(lengths)
    # Forward q.k and p.v plus the backward's four GEMMs: 3 x (2 x 2 x head_dim) per pair.
    pair_flops = 12 * HEAD_DIM * HEADS
    tile_pairs = TILE * TILE
    layouts = {"padded": [[n] for n in lengths], "packed": packed_rows}
    rows = []
    for name, layout in layouts.items():
        flops = step_flops(name == "packed") * len(layout)
        tiles = pairs = 0
        for row in layout:
            mask = attended_pairs(row_segments(row)[0])
            tiles += tiles_touched(mask)
            pairs += int(mask.sum())
        rows.append((name, len(layout), flops, tiles * tile_pairs * pair_flops, pairs * pair_flops))
        print(name, len(layout), f"{flops:.3e}", f"{tiles:,}", f"{pairs:,}", flush=True)
    tokens = sum(lengths)
    lines = [
        PACKING_HEADING,
        "",
        f"{_produced(command, start)} {len(lengths)} documents, "
        f"{tokens:,} tokens (log-normal lengths, median about 900, clipped to 32 .. {ROW}; "
        f"seed 0), causal attention with {HEADS} heads of {HEAD_DIM}, in rows of {ROW} "
        "tokens: one document per row (padded), or packed first-fit decreasing with segment "
        "ids. Compiled FLOPs: XLA's cost analysis of one row's training step (forward and "
        "backward, the CPU program: dense scores, masked), times the rows. Tile-skipping "
        f"FLOPs: the {TILE} x {TILE} tiles of each row's mask that hold an attended pair, "
        "at the full tile's GEMM FLOPs (12 x head_dim x heads per query-key pair: q.k and p.v "
        "forward, four GEMMs backward), a model of a flash kernel that skips masked tiles, as "
        "cuDNN's and the context-parallel ring's block skipping do. Attended pairs: the pairs "
        "the masks allow, the useful work.",
        "",
        "| layout | rows | tokens / row slot | compiled FLOPs | tile-skipping FLOPs (model) "
        "| attended-pair FLOPs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, n_rows, flops, tiled, useful in rows:
        lines.append(
            f"| {name} | {n_rows} | {tokens / (n_rows * ROW):.1%} | {flops:.3e} "
            f"| {tiled:.3e} | {useful:.3e} |"
        )
    (_, padded_rows, padded, padded_tiled, _), (_, _, packed, packed_tiled, _) = rows
    lines += [
        "",
        f"Packing needs {padded / packed:.1f}x fewer compiled FLOPs than padding (rows "
        f"{padded_rows} -> {len(packed_rows)}): the XLA attention computes every pair of a "
        "row and masks it, so there the padding is the waste packing removes, and a packed "
        "row still computes its cross-document pairs. Against a kernel that skips masked "
        f"tiles the ratio is {padded_tiled / packed_tiled:.2f}x: such a kernel already skips "
        "a padded row's padding, and a packed row adds the tiles that straddle two "
        "documents; what packing saves there is rows (activation memory, the other layers' "
        "padded tokens), not attention FLOPs.",
    ]
    return lines


FP8_HEADING = "## FP8 attention: error against float32 attention"
FP8_RECIPES = {
    "BF16 (no FP8)": None,
    "FP8 delayed (step 2)": DelayedScaling(fp8_dpa=True, amax_history_len=16),
    "FP8 current": Float8CurrentScaling(fp8_dpa=True),
}


def _attention_step(recipe, q, k, v, cotangent):
    """Output, q/k/v gradients and the new variables of one step of causal attention."""
    module = te_nn.DotProductAttention(
        head_dim=HEAD_DIM, num_attention_heads=HEADS, transpose_batch_sequence=False,
        recipe=recipe,
    )  # fmt: skip
    variables = module.init(jax.random.key(0), q, k, v)

    def loss(variables, q, k, v, cotangent):
        out = module.apply(variables, q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (new, *grads), out = step(variables, q, k, v, cotangent)
    if variables:  # delayed scaling: the second step, with the scales of the first
        (_, *grads), out = step(new, q, k, v, cotangent)
    return out, grads


def _relative(a: jax.Array, b: jax.Array) -> float:
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fp8_error_rows(seqs: tuple[int, ...]) -> list[tuple[str, int, list[float]]]:
    """(attention, seq, relative errors of out, dq, dk, dv) against float32 attention."""
    rows = []
    for seq in seqs:
        keys = jax.random.split(jax.random.key(seq), 4)
        shape = (1, seq, HEADS, HEAD_DIM)
        q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out, grads = _attention_step(None, *f32, cotangent)
        reference = [out, *grads]
        for name, recipe in FP8_RECIPES.items():
            out, grads = _attention_step(recipe, q, k, v, cotangent)
            errors = [_relative(a, b) for a, b in zip([out, *grads], reference, strict=True)]
            rows.append((name, seq, errors))
            print(name, seq, " ".join(f"{e:.4f}" for e in errors), flush=True)
    return rows


def fp8_section(seqs: tuple[int, ...], command: str) -> list[str]:
    start = time.time()
    rows = fp8_error_rows(seqs)
    lines = [
        FP8_HEADING,
        "",
        f"{_produced(command, start)} One training step of a causal "
        f"`DotProductAttention`, inputs `[1, seq, {HEADS}, {HEAD_DIM}]` drawn from N(0, 1) and "
        "rounded to bf16, the output cotangent N(0, 1); relative L2 error "
        "`||x - x_f32|| / ||x_f32||` of the output and the q, k, v gradients against the "
        "float32 attention of the same inputs. FP8: queries, keys, values and probabilities in "
        "e4m3, the output and score gradients in e5m2 (HYBRID); delayed scaling measured at "
        "its second step (scales from the first step's amax). Exact float8 emulation on the "
        "CPU.",
        "",
        "| attention | seq | output | dq | dk | dv |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, seq, errors in rows:
        lines.append(f"| {name} | {seq} | " + " | ".join(f"{e:.2%}" for e in errors) + " |")
    return lines


def _replace_section(text: str, heading: str, section: list[str]) -> str:
    """``text`` with the section under ``heading`` (to the next ``## `` heading) replaced, or
    the section appended."""
    lines = text.rstrip("\n").split("\n")
    if heading in lines:
        start = lines.index(heading)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = lines[end:]
        lines = [*lines[:start], *section, *(["", *tail] if tail else [])]
    else:
        lines = [*lines, "", *section]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequences up to 2048")
    parser.add_argument(
        "--only",
        choices=("fp8", "cp", "packing"),
        help="run one section, keep the others in the results file",
    )
    args = parser.parse_args()
    fp8_seqs = (512, 1024) if args.quick else (1024, 4096)
    if args.only in ("fp8", "packing"):
        command = f"JAX_PLATFORMS=cpu python -m bench.attention --only {args.only}"
        if args.only == "fp8":
            command += " --quick" if args.quick else ""
            heading, section = FP8_HEADING, fp8_section(fp8_seqs, command)
        else:
            heading, section = PACKING_HEADING, packing_section(command)
        existing = OUT.read_text() if OUT.exists() else ""
        OUT.write_text(_replace_section(existing, heading, section))
        print(f"wrote {OUT}")
        return
    seqs = (512, 1024, 2048) if args.quick else (1024, 2048, 4096, 8192)
    sizes = (1, 2, 4, 8)
    start = time.time()
    load = os.getloadavg()[0]
    rows = []
    for strategy in ("all_gather", "ring"):
        for seq in seqs:
            mib = [peak_bytes(seq, cp, strategy) / 2**20 for cp in sizes]
            rows.append((strategy, seq, mib))
            print(strategy, seq, " ".join(f"{m:.1f}" for m in mib), flush=True)
    command = "JAX_PLATFORMS=cpu python -m bench.attention" + (" --quick" if args.quick else "")
    command += " --only cp" if args.only == "cp" else ""
    lines = [
        "# Context-parallel attention: peak bytes per device",
        "",
        f"{_produced(command, start)} One training step (forward + backward) of "
        "`DotProductAttention`, causal, bf16 inputs "
        f"`[1, seq, {HEADS}, {HEAD_DIM}]`, float32 logits, the sequence over a `context` mesh "
        "axis (load balanced when it has more than one device); per-device bytes from the "
        "compiled CPU program (`memory_analysis()`: arguments + outputs + temporaries - "
        "aliased). Compiled, not run.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; load average {load:.1f} at the "
        f"start. jax {jax.__version__}. The CPU attention is the XLA maths, which materialises "
        "the scores: one device holds `heads x seq x seq` float32 scores and probabilities, a "
        "context-parallel device `heads x seq/cp x seq` (all-gather: its queries against every "
        "key; ring: one block's scores per step, forward and backward, since its custom VJP "
        "saves only the local q, k, v, output and log-sum-exp and recomputes each block's "
        "probabilities in a second ring).",
        "",
        "Before the ring's custom VJP (autodiff through the ring's loop, which keeps every "
        "step's blocks and probabilities for the backward pass), the ring's per-device bytes "
        "at 8192 tokens were 2640.4 / 1322.7 / 677.5 MiB on 2 / 4 / 8 devices (4096 tokens: "
        "680.2 / 341.3 / 178.7 MiB), by the same command. Every ring step, a device's own "
        "block included, is one loop iteration, forward and backward: with the own block "
        "outside the loop (and on 2 devices the loop of one step unrolled), XLA merged the "
        "backward's recomputed scores with the forward's and kept them from one to the other "
        "(3648 / 562 / 153 MiB at 8192 tokens). A device's peak is now one block's backward "
        "working set, about 4 float32 `heads x seq/cp x seq/cp` buffers: 2 devices need about "
        "4x the bytes of 4.",
        "",
        "| strategy | seq | "
        + " | ".join(f"{cp} device{'s' * (cp > 1)} (MiB)" for cp in sizes)
        + " | 1 / 8 |",
        "| --- | --- | " + " | ".join("---" for _ in sizes) + " | --- |",
    ]
    for strategy, seq, mib in rows:
        cells = " | ".join(f"{m:.1f}" for m in mib)
        lines.append(f"| {strategy} | {seq} | {cells} | {mib[0] / mib[-1]:.1f}x |")
    if args.only == "cp":  # keep the other sections as they are
        existing = OUT.read_text() if OUT.exists() else ""
        kept = existing.split("\n")
        first = next((i for i, line in enumerate(kept) if line.startswith("## ")), len(kept))
        lines += ["", *kept[first:]]
        OUT.write_text("\n".join(lines).rstrip("\n") + "\n")
        print(f"wrote {OUT}")
        return
    lines += ["", *packing_section(command), "", *fp8_section(fp8_seqs, command)]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
