"""Data-parallel FP8 training over several processes with JAX's own multi-process runtime.

A te_flax ``LayerNormMLP`` (FP8, ``DelayedScaling(amax_history_len=4)``) is trained for a few
steps on deterministic data. Every process joins the job with ``jax.distributed.initialize``,
the mesh spans the devices of all processes, and each process feeds only its own rows of the
global batch (``jax.make_array_from_process_local_data``). The step is te_flax's rule:
``merge_fp8_state`` inside the loss, optax SGD for the parameters, overwrite for the FP8 state
(``te_flax.training.apply_gradients``). Process 0 writes the final parameters and FP8 state to
``--out`` (an ``.npz`` with keys such as ``params/wi_kernel`` and
``_overwrite_with_gradient/x_0_scale_inv``).

On a cluster, run one process per host, the same command everywhere except the process id,
with the address of process 0's host as the coordinator::

  python -m examples.distributed_train --coordinator-address HOST0:1234 \\
      --num-processes N --process-id I --out final.npz

(or set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` instead of
the flags). On one machine, CPU devices stand in for accelerators: for example two processes
with two CPU devices each,
``XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu``; CPU collectives
between processes use gloo. Without a coordinator address and with one process the script
runs alone on the local devices, which gives the same result as the same global mesh spread
over several processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling
from te_flax.sharding import load_axis_rules, make_mesh
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    init_optimizer,
    merge_fp8_state,
)

__all__ = ["main", "parse_args", "train"]

HIDDEN, INTERMEDIATE, SEQ = 32, 64, 4
SEED = 0
# The input and target axes' logical names: the batch is split over the data-parallel axis.
BATCH_AXES = ("batch", None, None)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m examples.distributed_train")
    parser.add_argument(
        "--coordinator-address",
        default=env.get("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS; none: one process)",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=int(env.get("JAX_NUM_PROCESSES", "1")),
        help="processes in the job (default: $JAX_NUM_PROCESSES or 1)",
    )
    parser.add_argument(
        "--process-id",
        type=int,
        default=int(env.get("JAX_PROCESS_ID", "0")),
        help="this process's index, 0 .. num_processes - 1 (default: $JAX_PROCESS_ID or 0)",
    )
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        help="global batch size (default 16; a multiple of the number of devices)",
    )
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--out", help="process 0 writes the final variables to this .npz file")
    args = parser.parse_args(argv)
    if args.num_processes > 1 and not args.coordinator_address:
        parser.error("--num-processes > 1 needs --coordinator-address (or JAX_COORDINATOR_ADDRESS)")
    return args


def initialize(args: argparse.Namespace) -> None:
    """Joins the multi-process job (a no-op for a single process without a coordinator)."""
    if args.coordinator_address is None:
        return
    # Cross-process collectives of CPU devices; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def global_batch(step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step`` (inputs and regression targets), the same in every process.

    A real input pipeline would read only this process's rows; generating all of them here
    keeps the data independent of how many processes share it.
    """
    rng = np.random.default_rng([SEED, step])
    x = rng.standard_normal((batch, SEQ, HIDDEN), dtype=np.float32)
    target_map = np.random.default_rng([SEED, 1 << 20]).standard_normal(
        (HIDDEN, HIDDEN), dtype=np.float32
    ) / np.sqrt(HIDDEN)
    y = np.tanh(x @ target_map).astype(np.float32)
    return x, y


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The rows of the batch that live on this process's devices (one contiguous block)."""
    rows = {
        index[0].indices(global_shape[0])[:2]
        for index in sharding.addressable_devices_indices_map(global_shape).values()
    }
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    covered = sum(b - a for a, b in rows)
    if covered != stop - start:
        raise ValueError(f"this process's batch rows {sorted(rows)} are not one block")
    return slice(start, stop)


def to_global(sharding: NamedSharding, data: np.ndarray) -> jax.Array:
    """A global array from the full host batch: each process hands over only its own rows."""
    return jax.make_array_from_process_local_data(
        sharding, data[local_rows(sharding, data.shape)], data.shape
    )


def train(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Trains the layer; returns the final variables flattened to ``{"collection/name": array}``."""
    n_devices = jax.device_count()
    if args.batch % n_devices:
        raise ValueError(f"--batch {args.batch} is not a multiple of the {n_devices} devices")
    mesh = make_mesh({"data": n_devices})  # every process's devices, in one global mesh
    rules = load_axis_rules("dp")
    model = te_nn.LayerNormMLP(
        intermediate_dim=INTERMEDIATE,
        activations=("gelu",),
        recipe=DelayedScaling(amax_history_len=4),
        layernorm_input_axes=BATCH_AXES,
        dot_1_input_axes=BATCH_AXES,
        dot_2_input_axes=BATCH_AXES,
    )
    tx = optax.sgd(args.learning_rate)
    batch_sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(BATCH_AXES, rules))
    x0, _ = global_batch(0, args.batch)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        # Parameters placed as their logical axes say (replicated under data parallelism).
        abstract = jax.eval_shape(model.init, jax.random.key(SEED), x0)
        specs = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)

        def init(key, x):
            return nn.meta.unbox(model.init(key, x))

        init = jax.jit(init, out_shardings=shardings)
        variables = init(jax.random.key(SEED), to_global(batch_sharding, x0))
        opt_state = init_optimizer(tx, variables)

        @jax.jit
        def step(variables, opt_state, x, y):
            def loss_fn(variables):
                out, _ = model.apply(merge_fp8_state(variables), x)
                return jnp.mean(jnp.square(out - y))

            loss, grads = jax.value_and_grad(loss_fn)(variables)
            variables, opt_state = apply_gradients(tx, variables, grads, opt_state)
            return variables, opt_state, loss

        for i in range(args.steps):
            x, y = global_batch(i, args.batch)
            variables, opt_state, loss = step(
                variables, opt_state, to_global(batch_sharding, x), to_global(batch_sharding, y)
            )
            if jax.process_index() == 0:
                print(f"step {i}: loss {float(loss):.6f}", flush=True)

        # Every process takes part in the gather; each gets the whole (unsharded) value.
        host = multihost_utils.process_allgather(variables, tiled=True)
    return {
        f"{collection}/{name}": np.asarray(value)
        for collection in ("params", OVERWRITE_WITH_GRADIENT)
        for name, value in host[collection].items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    initialize(args)
    print(
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local devices, {jax.device_count()} in all",
        flush=True,
    )
    final = train(args)
    if args.out and jax.process_index() == 0:
        np.savez(args.out, **final)
        print(f"wrote {args.out}", flush=True)
    if args.coordinator_address is not None:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
