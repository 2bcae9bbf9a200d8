"""What max-merging a reused FP8 state costs a data-parallel training step.

A two-view loss applies one variable dict twice per step (Flax's ``TrainState`` and plain
``jax.grad``, no te_flax helper): a ``LayerNormMLP`` (hidden 256, intermediate 1024,
``DelayedScaling``) on a batch sharded over 8 CPU devices (data parallelism under ``jit``). The
step is compiled twice: as te_flax builds it (the two reads of the state are marked and their
updates merge by elementwise max) and with the marking switched off (the updates are added,
the wrong state this replaces). Reported per variant: the collectives of the compiled program
(kind, dtype, bytes), XLA's ``bytes accessed`` and the median step time.

Run ``python -m bench.fp8_state_reuse``; it writes ``bench/RESULTS_fp8_state_reuse.md``. The
figures are CPU figures of the program's shape (collectives, bytes), not GPU timings.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import statistics
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import te_flax.linen as te_nn
from te_flax._layers import fp8_state
from te_flax._tools.hlo import parse_collectives
from te_flax.linen import _shell as linen_shell
from te_flax.quantize import DelayedScaling

HIDDEN, INTERMEDIATE, BATCH, SEQ, REPEATS = 256, 1024, 16, 64, 20


def _step_and_inputs():
    layer = te_nn.LayerNormMLP(intermediate_dim=INTERMEDIATE, recipe=DelayedScaling())
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN), jnp.float32)
    variables = layer.init(jax.random.key(1), x)
    state = train_state.TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(0.1))

    def loss(params, x):
        first, _ = state.apply_fn(params, x)
        second, _ = state.apply_fn(params, 2.0 * x)
        return jnp.mean(first**2) + jnp.mean(second**2)

    def step(state, x):
        return state.apply_gradients(grads=jax.grad(loss)(state.params, x))

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    return jax.jit(step), state, x


def _measure(marked: bool) -> dict[str, object]:
    # The Linen shell's reference to the marking; off: the reads are passed through unmarked.
    patch = mock.patch.object(linen_shell, "merge_reuse", side_effect=lambda states: states)
    with patch if not marked else mock.patch.object(fp8_state, "_READS", {}):
        step, state, x = _step_and_inputs()
        compiled = step.lower(state, x).compile()
        text = compiled.as_text()
        costs = compiled.cost_analysis()
        costs = costs[0] if isinstance(costs, list) else costs
        collectives = Counter(
            f"{c.kind} {'/'.join(sorted({t for t, _ in c.operands}))} {c.bytes:.0f} B"
            for c in parse_collectives(text)
        )
        state = compiled(state, x)  # warm up
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            state = jax.block_until_ready(compiled(state, x))
            times.append(time.perf_counter() - start)
    history = state.params["_overwrite_with_gradient"]["x_0_amax_history"][:3]
    return {
        "collectives": dict(sorted(collectives.items())),
        "bytes": float(costs["bytes accessed"]),
        "ms": 1e3 * statistics.median(times),
        "history": [round(float(v), 4) for v in history],
    }


def main() -> None:
    rows = {"max-merged (te_flax)": _measure(True), "added (marking off)": _measure(False)}
    lines = [
        "# Max-merging a reused FP8 state: its cost on a data-parallel step",
        "",
        "Command: `python -m bench.fp8_state_reuse` (8 CPU devices, jax "
        f"{jax.__version__}). A LayerNormMLP (hidden {HIDDEN}, intermediate {INTERMEDIATE}) "
        f"applied twice per step to a [{BATCH}, {SEQ}, {HIDDEN}] batch sharded over 8 devices,",
        "Flax's TrainState with plain jax.grad. CPU figures: the program's collectives and "
        "bytes are what carries over to a GPU, the times do not.",
        "",
        "| variant | collectives (kind dtype bytes: count) | bytes accessed | step (ms) | "
        "x_0 history after the run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        collectives = "; ".join(f"{k}: {n}" for k, n in row["collectives"].items())  # type: ignore[union-attr]
        lines.append(
            f"| {name} | {collectives} | {row['bytes']:,.0f} | {row['ms']:.1f} | {row['history']} |"
        )
    text = "\n".join(lines) + "\n"
    Path(__file__).with_name("RESULTS_fp8_state_reuse.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
