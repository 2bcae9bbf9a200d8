"""What one finite loss spike does to delayed scaling, and ``drop_amax_spikes`` undoing it.

A ``LayerNormMLP`` (hidden 128, intermediate 256, ``DelayedScaling(amax_history_len=16)``)
trains with ``optax.clip_by_global_norm(1.0)`` and SGD; at step 4 the loss is multiplied by
1e12 (finite, so ``skip_nonfinite`` rightly lets the clipped step through). Each step's kernel
gradients are compared with the unquantized gradients of the same variables and batch
(normwise relative error; 1 means nothing of the gradient is left), without a guard
(``apply_gradients(..., drop_amax_spikes=False)``) and with the guard that is the training
helpers' default (``drop_amax_spikes=True``: a step's amax more than 1e3 times the largest of
its history is left out).

Run ``JAX_PLATFORMS=cpu python -m bench.amax_spike``; it writes ``bench/RESULTS_amax_spike.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.training import (
    apply_gradients,
    init_optimizer,
    value_and_grad,
)

STEPS, SPIKE_STEP, SPIKE = 12, 4, 1e12
RECIPE = DelayedScaling(amax_history_len=16)
KERNELS = ("wi_kernel", "wo_kernel")


def run(guard: bool) -> list[dict[str, float]]:
    """Per step: each kernel gradient's relative error against the unquantized gradient."""
    fp8 = te_nn.LayerNormMLP(intermediate_dim=256, recipe=RECIPE)
    reference = te_nn.LayerNormMLP(intermediate_dim=256, recipe=None)
    xs = jax.random.normal(jax.random.key(0), (STEPS, 8, 32, 128))
    variables = nn.unbox(fp8.init(jax.random.key(1), xs[0]))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2))

    def loss(variables, x, scale, module=fp8):
        y, _ = module.apply(variables, x)
        return jnp.mean(jnp.square(y.astype(jnp.float32))) * scale

    fp8_grad = jax.jit(value_and_grad(loss))
    exact_grad = jax.jit(jax.grad(lambda p, x, s: loss({"params": p}, x, s, reference)))
    opt_state = init_optimizer(tx, variables)
    rows = []
    for step in range(STEPS):
        scale = SPIKE if step == SPIKE_STEP else 1.0
        _, grads = fp8_grad(variables, xs[step], scale)
        exact = exact_grad(variables["params"], xs[step], scale)
        rows.append(
            {
                name: float(
                    jnp.linalg.norm(grads["params"][name] - exact[name])
                    / jnp.linalg.norm(exact[name])
                )
                for name in KERNELS
            }
        )
        variables, opt_state = apply_gradients(
            tx, variables, grads, opt_state, drop_amax_spikes=guard
        )
    return rows


def main() -> Path:
    plain, guarded = run(False), run(True)
    lines = [
        "# One finite loss spike under delayed scaling",
        "",
        __doc__.split("\n\n")[1].replace("\n", " ").replace("``", "`"),
        "",
        "| step | wi_kernel, no guard | wo_kernel, no guard | wi_kernel, guarded | "
        "wo_kernel, guarded |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for step, (a, b) in enumerate(zip(plain, guarded, strict=True)):
        mark = " (spike)" if step == SPIKE_STEP else ""
        lines.append(
            f"| {step}{mark} | {a['wi_kernel']:.3f} | {a['wo_kernel']:.3f} | "
            f"{b['wi_kernel']:.3f} | {b['wo_kernel']:.3f} |"
        )
    lines += [
        "",
        "Reproduce with `JAX_PLATFORMS=cpu python -m bench.amax_spike` (CPU, float8 emulated "
        "by XLA: the same values a GPU's float8 casts give).",
    ]
    path = Path(__file__).parent / "RESULTS_amax_spike.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


if __name__ == "__main__":
    main()
