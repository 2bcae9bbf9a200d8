"""The XLA stages' bytes against a recorded baseline: a regression is flagged, not found later.

te_flax's XLA stages are a real path (multi-GPU programs without a mesh, ``TE_FLAX_PALLAS=0``),
and XLA fuses them by pattern: a change of form in one stage (a ``select`` around
``quantize``'s clamp, say) can make XLA write float32 copies it did not write before, with
every test still green. This compiles, deviceless for the H100 of ``tests/data``, the training
steps of ``bench.te_peer`` with the XLA stages (``pallas_kernels("0")``): ``DenseGeneral``,
``LayerNormDenseGeneral`` and ``LayerNormMLP`` at hidden 2048, and two hidden-8192
``TransformerLayer``s (the model level of ``bench/RESULTS_te_peer.md``), each without FP8 and
with delayed scaling. Every configuration's bytes (all, and those of the non-GEMM kernels) are
compared with ``bench/xla_stages_baseline.json``, recorded per JAX minor version since XLA's
fusions differ between them; more than ``TOLERANCE`` above the baseline is flagged
``REGRESSED``, with the largest instructions that the baseline did not have, and the command
exits with status 1::

    JAX_PLATFORMS=cpu python -m bench.xla_stages            # check; writes RESULTS_xla_stages.md
    JAX_PLATFORMS=cpu python -m bench.xla_stages --record   # accept the figures as the baseline

``python -m bench`` runs the check too (``--quick``: the layers only). Figures are bytes of
compiled programs and a MODEL of the step time (``bench.te_peer``), not GPU measurements.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
if _TRITON_OFF not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRITON_OFF}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from bench import te_peer  # noqa: E402

__all__ = ["CONFIGURATIONS", "TOLERANCE", "check", "main", "measure"]

BASELINE = Path(__file__).with_name("xla_stages_baseline.json")
RESULTS = Path(__file__).with_name("RESULTS_xla_stages.md")
# More than this above the recorded bytes is a regression; XLA's fusion choices move the bytes
# of an unchanged program by well under 1% between runs (they did not move at all here).
TOLERANCE = 0.03
VARIANT = "te_flax XLA stages"
LAYER_SHAPE = te_peer.Shape(tokens=4096, seq=2048, hidden=2048, mlp=8192, heads=16)
MODEL_SHAPE = te_peer.Shape(tokens=4096, seq=512, hidden=8192, mlp=32768, heads=64)
CONFIGURATIONS = (
    "DenseGeneral",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "two TransformerLayers",
)
RECIPES = ("none", "delayed")
LARGEST = 8  # instructions kept with each baseline entry
HISTORY_HEADING = "## Before and after"


def jax_key() -> str:
    """The baseline's key for the running JAX: its minor version (``jax 0.12``)."""
    return "jax " + ".".join(jax.__version__.split(".")[:2])


def measure(configuration: str, recipe: str) -> dict:
    """The bytes of one XLA-stage training step, compiled deviceless for the H100."""
    if configuration == "two TransformerLayers":
        figures = te_peer.model_step(MODEL_SHAPE, "1 GPU", VARIANT, recipe, True)
    else:
        compiled = te_peer.compile_step(VARIANT, configuration, LAYER_SHAPE, recipe)
        figures = te_peer.summarize(compiled["hlo"], configuration, LAYER_SHAPE, recipe)
    return {
        "all_bytes": figures["other_bytes"] + figures["gemm_bytes"],
        "other_bytes": figures["other_bytes"],
        "model_ms": figures["model_s"] * 1e3,
        # {"fusion kInput: f32[8192,2048]": bytes}: what a regression's new instructions are
        # told apart from.
        "largest": {
            f"{instruction}: {result}": round(size)
            for instruction, result, size in figures["all"][:LARGEST]
        },
    }


def _verdict(now: dict, recorded: dict | None) -> tuple[str, list[str]]:
    """``ok``, ``REGRESSED`` or ``no baseline``, and what the baseline did not have."""
    if recorded is None:
        return "no baseline", []
    worse = [
        key for key in ("all_bytes", "other_bytes") if now[key] > recorded[key] * (1 + TOLERANCE)
    ]
    if not worse:
        return "ok", []
    new = [
        f"{instruction} ({size / 1e6:.0f} MB)"
        for instruction, size in now["largest"].items()
        if instruction not in recorded["largest"]
    ]
    return "REGRESSED", new


def check(configurations=CONFIGURATIONS, log: Callable[[str], None] = print) -> dict:
    """Measures ``configurations`` and compares each with the baseline of the running JAX.

    Returns ``{"jax": key, "rows": [...], "regressed": [names]}``."""
    baseline = json.loads(BASELINE.read_text()).get(jax_key(), {}) if BASELINE.exists() else {}
    rows, regressed = [], []
    for configuration in configurations:
        for recipe in RECIPES:
            name = f"{configuration} / {recipe}"
            now = measure(configuration, recipe)
            verdict, new = _verdict(now, baseline.get(name))
            rows.append({"name": name, **now, "verdict": verdict, "new": new})
            recorded = baseline.get(name)
            against = (
                f" ({now['all_bytes'] / recorded['all_bytes']:.3f}x the baseline)"
                if recorded
                else ""
            )
            log(f"XLA stages, {name}: {now['all_bytes'] / 1e9:.3f} GB{against}: {verdict}")
            if verdict == "REGRESSED":
                regressed.append(name)
                for line in new:
                    log(f"    not in the baseline: {line}")
    return {"jax": jax_key(), "rows": rows, "regressed": regressed}


def record(result: dict) -> None:
    """Writes ``result``'s figures as the baseline of its JAX version."""
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    entries = baseline.setdefault(result["jax"], {})
    for row in result["rows"]:
        entries[row["name"]] = {key: row[key] for key in ("all_bytes", "other_bytes", "largest")}
    BASELINE.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")


def report(result: dict, command: str) -> str:
    """The results file: every configuration against its baseline, FP8 over BF16."""
    lines = [
        "# The XLA stages' bytes against their baseline (deviceless H100)",
        "",
        f"Command: `{command}` ({result['jax']}; `bench/xla_stages.py` says what it compiles).",
        "",
        "Bytes of the compiled programs (every entry instruction's operands read once, results",
        f"written once); the step time is a MODEL, not a GPU measurement. Flagged: more than "
        f"{TOLERANCE:.0%} above `bench/xla_stages_baseline.json`.",
        "",
        "| configuration / recipe | all GB | non-GEMM GB | model ms | FP8/BF16 bytes "
        "| FP8/BF16 time | verdict |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    by_name = {row["name"]: row for row in result["rows"]}
    for row in result["rows"]:
        bf16 = by_name.get(row["name"].rsplit(" / ", 1)[0] + " / none", row)
        lines.append(
            f"| {row['name']} | {row['all_bytes'] / 1e9:.3f} | {row['other_bytes'] / 1e9:.3f} "
            f"| {row['model_ms']:.3f} | {row['all_bytes'] / bf16['all_bytes']:.3f} "
            f"| {bf16['model_ms'] / row['model_ms']:.3f}x | {row['verdict']} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configurations", nargs="+", default=list(CONFIGURATIONS), choices=CONFIGURATIONS
    )
    parser.add_argument("--record", action="store_true", help="write the figures as the baseline")
    parser.add_argument("--no-write", action="store_true", help=f"leave {RESULTS.name} as it is")
    args = parser.parse_args(argv)
    command = "python -m bench.xla_stages " + " ".join(sys.argv[1:] if argv is None else argv)
    result = check(args.configurations)
    if args.record:
        record(result)
        print(f"recorded as the {result['jax']} baseline in {BASELINE.name}")
    if not args.no_write:
        # The hand-written history below the generated table is kept.
        old = RESULTS.read_text() if RESULTS.exists() else ""
        kept = HISTORY_HEADING + old.split(HISTORY_HEADING, 1)[1] if HISTORY_HEADING in old else ""
        RESULTS.write_text(report(result, command.strip()) + ("\n" + kept if kept else ""))
    if result["regressed"] and not args.record:
        raise SystemExit(
            f"the XLA stages moved more than {TOLERANCE:.0%} above their baseline in: "
            + ", ".join(result["regressed"])
            + ". Find the change (the instructions above are new), or accept the figures "
            "with --record if the change is meant."
        )


if __name__ == "__main__":
    main()
