"""Whether two checkouts compile te_flax's programs the same: the check of a refactor.

A change that reorganises the code (a module moved, a wrapper merged, a signature bound
differently) must not change what XLA runs. ``dump`` writes the optimized HLO of a fixed set of
programs, each normalized so that only the program is compared: the source locations XLA keeps
(``metadata``, the stack-frame tables, the call site a Mosaic GPU kernel embeds in its
serialized module, and the fingerprints derived from them) are dropped. ``compare`` then says
which programs differ, with exit status 1 if any does::

    JAX_PLATFORMS=cpu python -m bench.same_programs dump BEFORE    # in the old checkout
    JAX_PLATFORMS=cpu python -m bench.same_programs dump AFTER     # in the new one
    python -m bench.same_programs compare BEFORE AFTER

The programs: the training step (``te_flax.training.value_and_grad`` of a squared sum) and the
forward of ``DenseGeneral``, ``LayerNormDenseGeneral`` (with its norm output, and with LoRA) and
``LayerNormMLP`` (SwiGLU; and GELU with LoRA, dropout and the norm output) under no recipe,
delayed, current and MXFP8 scaling; ``LayerNormMLP`` without its norm; FP8 attention; the
ragged and capacity grouped GEMM without FP8, delayed and current; NNX's ``LayerNormMLP``; and,
where XLA's GPU compiler is installed (``jax[cuda12]``), the example GPT's training step
compiled deviceless for an H100 with and without FP8, Pallas kernels included. A Mosaic GPU
kernel is compared by its name and operands only: its own code is its tests' concern.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_SOURCE = [
    (re.compile(r",? ?metadata=\{[^}]*\}"), ""),
    (re.compile(r",? ?stack_frame_id=\d+"), ""),
    (re.compile(r'kernel_hash = ".*?", module = ".*?", (?=skip_device_barrier)'), ""),
    (re.compile(r'fingerprint_before_lhs="\w+"'), ""),
    (re.compile(r"^HloModule \S+", re.MULTILINE), "HloModule program"),
]


def normalized(hlo_text: str) -> str:
    """``hlo_text`` without what names the source rather than the program."""
    lines, in_section = [], False
    for line in hlo_text.split("\n"):
        if line in _SECTIONS:
            in_section = True
            continue
        if in_section and (not line.strip() or line[0].isdigit() or line.startswith(" ")):
            continue
        in_section = False
        lines.append(line)
    text = "\n".join(lines)
    for pattern, replacement in _SOURCE:
        text = pattern.sub(replacement, text)
    return text


def _linen_programs(name: str, module: Any, x: jax.Array, **kwargs: Any) -> Iterator[tuple]:
    """The layer's training step and forward, as (name, jitted function, arguments)."""
    from te_flax.training import value_and_grad

    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = module.init(rngs, x, **kwargs)

    def apply(variables: Any, x: jax.Array) -> Any:
        return module.apply(variables, x, rngs={"dropout": jax.random.key(2)}, **kwargs)

    def loss(variables: Any, x: jax.Array) -> jax.Array:
        out = apply(variables, x)
        if isinstance(out, tuple):  # (out, norm output or None)
            out = out[0] + (0 if out[1] is None else jnp.sum(out[1]))
        return jnp.sum(out.astype(jnp.float32) ** 2)

    yield f"{name}_step", jax.jit(value_and_grad(loss)), (variables, x)
    yield f"{name}_forward", jax.jit(apply), (variables, x)


def _layer_programs() -> Iterator[tuple]:
    import te_flax.linen as te_nn
    from te_flax.quantize import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

    x = jax.random.normal(jax.random.key(3), (4, 32, 64), jnp.bfloat16)
    recipes = {
        "none": None,
        "delayed": DelayedScaling(amax_history_len=4),
        "current": Float8CurrentScaling(),
        "mxfp8": MXFP8BlockScaling(),
    }
    lora = dict(enable_low_rank_adaptation=True, low_rank_adaptation_dim=8)
    for name, recipe in recipes.items():
        yield from _linen_programs(
            f"dense_{name}", te_nn.DenseGeneral(features=128, recipe=recipe), x
        )
        ln_dense = te_nn.LayerNormDenseGeneral(
            features=128, recipe=recipe, return_layernorm_output=True
        )
        yield from _linen_programs(f"ln_dense_{name}", ln_dense, x)
        ln_dense = te_nn.LayerNormDenseGeneral(features=128, recipe=recipe, **lora)
        yield from _linen_programs(f"ln_dense_lora_{name}", ln_dense, x)
        mlp = te_nn.LayerNormMLP(
            intermediate_dim=128, activations=("silu", "linear"), recipe=recipe
        )
        yield from _linen_programs(f"mlp_{name}", mlp, x, deterministic=True)
        mlp = te_nn.LayerNormMLP(
            intermediate_dim=128, recipe=recipe, intermediate_dropout_rate=0.1,
            return_layernorm_output=True, **lora,
        )  # fmt: skip
        yield from _linen_programs(f"mlp_lora_dropout_{name}", mlp, x, deterministic=False)
    mlp = te_nn.LayerNormMLP(
        intermediate_dim=128, enable_layernorm=False, recipe=recipes["delayed"]
    )
    yield from _linen_programs("mlp_without_norm_delayed", mlp, x, deterministic=True)


def _other_programs() -> Iterator[tuple]:
    from flax import nnx

    import te_flax.linen as te_nn
    import te_flax.nnx as te_nnx
    from te_flax.dense import grouped_dense, grouped_quantizer_set
    from te_flax.quantize import DelayedScaling, Float8CurrentScaling, QuantizerFactory

    attention = te_nn.DotProductAttention(
        head_dim=16, num_attention_heads=4, num_gqa_groups=2, transpose_batch_sequence=False,
        recipe=DelayedScaling(fp8_dpa=True, amax_history_len=4),
    )  # fmt: skip
    q = jax.random.normal(jax.random.key(4), (2, 32, 4, 16), jnp.bfloat16)
    kv = jax.random.normal(jax.random.key(5), (2, 32, 2, 16), jnp.bfloat16)
    variables = attention.init(jax.random.key(0), q, kv, kv)

    def attention_loss(q: jax.Array) -> jax.Array:
        return jnp.sum(attention.apply(variables, q, kv, kv).astype(jnp.float32))

    yield "fp8_attention_step", jax.jit(jax.value_and_grad(attention_loss)), (q,)
    x = jax.random.normal(jax.random.key(6), (64, 32), jnp.bfloat16)
    kernel = jax.random.normal(jax.random.key(7), (4, 32, 48), jnp.float32)
    sizes = jnp.array([10, 20, 4, 30], jnp.int32)
    grouped_recipes = (
        ("none", None),
        ("delayed", DelayedScaling()),
        ("current", Float8CurrentScaling()),
    )
    for name, recipe in grouped_recipes:
        for lowering in ("ragged", "capacity"):

            def loss(
                kernel: jax.Array, x: jax.Array, recipe: Any = recipe, lowering: str = lowering
            ):
                sets = {}
                if recipe is not None:
                    one = QuantizerFactory.create_set(fp8_recipe=recipe)
                    sets = {"quantizer_set": grouped_quantizer_set(one, kernel.shape[0])}
                out = grouped_dense(x, kernel, sizes, lowering=lowering, **sets)
                return jnp.sum(out.astype(jnp.float32) ** 2)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            yield f"grouped_{lowering}_{name}_step", step, (kernel, x)
    x = jax.random.normal(jax.random.key(3), (4, 32, 64), jnp.bfloat16)
    for name, recipe in (("none", None), ("delayed", DelayedScaling(amax_history_len=4))):
        mlp = te_nnx.LayerNormMLP(
            64, intermediate_dim=128, activations=("silu", "linear"), recipe=recipe,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
        graphdef, state = nnx.split(mlp)

        def nnx_loss(state: Any, x: jax.Array, graphdef: Any = graphdef) -> jax.Array:
            out = nnx.merge(graphdef, state)(x, deterministic=True)[0]
            return jnp.sum(out.astype(jnp.float32) ** 2)

        yield f"nnx_mlp_{name}_step", jax.jit(jax.value_and_grad(nnx_loss)), (state, x)


def dump(directory: Path, log: Callable[[str], None] = print) -> int:
    """Writes each program's normalized HLO to ``directory``; returns how many."""
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, function, arguments in (*_layer_programs(), *_other_programs()):
        text = function.lower(*arguments).compile().as_text()
        (directory / f"{name}.hlo").write_text(normalized(text))
        count += 1
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        log("the example GPT's H100 step: skipped (XLA's GPU compiler, jax[cuda12], is absent)")
        return count
    from bench.model import compile_gpt_step

    for fp8 in (True, False):
        hlo_text, _ = compile_gpt_step(256, fp8, "te_flax", layers=2, remat="on", batch=2, seq=128)
        (directory / f"gpt_h100_{'fp8' if fp8 else 'bf16'}_step.hlo").write_text(
            normalized(hlo_text)
        )
        count += 1
    return count


def compare(before: Path, after: Path, log: Callable[[str], None] = print) -> bool:
    """Whether every program of ``before`` is in ``after`` and compiles the same."""
    names = sorted(path.name for path in before.glob("*.hlo"))
    different = [
        name
        for name in names
        if not (after / name).exists() or (before / name).read_text() != (after / name).read_text()
    ]
    for name in different:
        log(f"DIFFERENT: {name}")
    log(f"{len(names) - len(different)} of {len(names)} programs the same")
    return bool(names) and not different


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("dump", help="write the programs' HLO").add_argument("directory")
    pair = commands.add_parser("compare", help="compare two dumps")
    pair.add_argument("before")
    pair.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "dump":
        print(f"{dump(Path(args.directory))} programs written to {args.directory}")
        return 0
    return 0 if compare(Path(args.before), Path(args.after)) else 1


if __name__ == "__main__":
    sys.exit(main())
