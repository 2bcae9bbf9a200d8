"""Multi-process training (``examples/distributed_train.py``): two processes on localhost, two
CPU devices each, joined by ``jax.distributed.initialize`` with gloo collectives, train to the
same parameters and FP8 state as one process on four devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import xla_flags

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
STEPS = 5  # more than amax_history_len=4: the histories roll over
FP8_COLLECTION = "_overwrite_with_gradient"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _environment(local_devices: int) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = xla_flags(local_devices)
    return env


def _launch(out: Path, local_devices: int, *flags: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "examples.distributed_train",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        *flags,
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_environment(local_devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(processes: list[subprocess.Popen]) -> list[str]:
    """The output of each process; all of them are killed if one fails or time runs out."""
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=TIMEOUT_S)
            outputs.append(output)
            assert process.returncode == 0, f"exit status {process.returncode}:\n{output}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


def _losses(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


def test_two_processes_train_as_one(tmp_path):
    coordinator = f"localhost:{_free_port()}"
    multi_out, single_out = tmp_path / "two_processes.npz", tmp_path / "one_process.npz"
    processes = [
        _launch(
            multi_out,
            2,
            "--coordinator-address",
            coordinator,
            "--num-processes",
            "2",
            "--process-id",
            str(process_id),
        )
        for process_id in range(2)
    ]
    processes.append(_launch(single_out, 4))  # the reference: one process, four devices
    first, second, single = _wait(processes)

    assert "process 0 of 2: 2 local devices, 4 in all" in first, first
    assert "process 1 of 2: 2 local devices, 4 in all" in second, second
    assert "process 0 of 1: 4 local devices, 4 in all" in single, single
    assert len(_losses(first)) == STEPS, first
    assert not _losses(second), "only process 0 reports"
    np.testing.assert_allclose(
        [float(line.split()[-1]) for line in _losses(first)],
        [float(line.split()[-1]) for line in _losses(single)],
        rtol=1e-5,
    )

    multi, reference = dict(np.load(multi_out)), dict(np.load(single_out))
    assert sorted(multi) == sorted(reference)
    assert {key.split("/")[0] for key in reference} == {"params", FP8_COLLECTION}
    for key, expected in reference.items():
        if key.startswith(FP8_COLLECTION):
            # amaxes are maxima and scales follow from them: exact whatever the process count.
            np.testing.assert_array_equal(multi[key], expected, err_msg=key)
        else:
            scale = float(np.sqrt(np.mean(np.square(expected))))
            np.testing.assert_allclose(
                multi[key], expected, rtol=1e-5, atol=1e-5 * scale, err_msg=key
            )
    # The run did update the FP8 state: every history is full and no scale is the initial 1.
    for key, value in reference.items():
        if key.endswith("_amax_history"):
            assert np.all(value > 0), (key, value)
        if key.endswith("_scale_inv"):
            assert np.all(value != 1.0), (key, value)
