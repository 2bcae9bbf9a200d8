"""scripts/gpu_check: its CPU smoke run writes every file, and it stops cleanly without a GPU
or without time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check"


def _gpu_check(out: Path, *arguments: str, python: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PIP_"))}
    # An index-less pip, as on a GPU image without network: nothing may be fetched.
    env.update(PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0")
    interpreter = ["--python", sys.executable] if python else []
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *interpreter, *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_smoke_run_with_the_system_jax_writes_every_figure_in_eight_files(tmp_path):
    (tmp_path / "tests.log").write_text("a previous run's log\n")
    completed = _gpu_check(tmp_path, "--smoke", "--system", python=False)
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "passed" and summary["smoke"] and summary["system"]
    assert [(p["phase"], p["status"]) for p in summary["phases"]] == [
        ("environment", "passed"),
        ("tests", "passed"),
        ("bench", "passed"),
    ]
    # One flat folder of at most eight files; nothing installed, so no install log.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "GPU_RESULTS.md",
        "SUMMARY.md",
        "bench.log",
        "environment.txt",
        "loss.png",
        "summary.json",
        "tests.log",
    ]
    assert "a previous run's log" not in (tmp_path / "tests.log").read_text()
    environment = (tmp_path / "environment.txt").read_text()
    assert "# pip freeze" in environment and "jax==" in environment
    probe = summary["environment"]
    assert probe["jax"] == jax.__version__ and probe["untested"] == []
    assert probe["te_flax"].startswith(str(ROOT)) and probe["platform"] == "cpu"

    # The GPU tests all ran (a CPU device standing in for the GPU), but for the one that reads
    # the GPU's cuBLASLt calls.
    junit = summary["tests"]["junit"]
    assert junit["failures"] == 0 and junit["errors"] == 0 and junit["tests"] >= 15
    skipped = list(junit["skipped_tests"])
    assert skipped and all(name.startswith("test_the_gpu_runs_cublaslt") for name in skipped)

    # What each test measured, one entry per test.
    figures = summary["tests"]["figures"]
    assert len(figures) == junit["tests"]
    agreement = [f for f in figures.values() if "recipe" in f]
    assert {(f["op"], f["recipe"]) for f in agreement} >= {
        ("dense", "delayed"),
        ("layernorm_dense", "delayed"),
        ("layernorm_mlp", "delayed"),
    }
    for f in agreement:
        assert f["smoke"] and f["accelerator"] != f["cpu"]
        errors = f["step_3_error_vs_cpu"]
        assert {"y", "dx"} <= set(errors) and any(k.startswith("dkernel") for k in errors)
        assert 0 < f["accelerator_error_vs_unquantized"]["y"] <= f["tolerances"][0]
    state = figures["test_fp8_state_after_three_steps_agrees_with_the_cpu_layernorm_mlp"]
    assert len(state["gemm_1_dgrad"]["amax_history"]) == 3
    lm = figures["test_example_gpt_trains_as_well_in_fp8_as_in_bf16"]
    assert abs(lm["final_eval_loss_fp8_vs_bf16"]) <= 0.02
    assert "| fp8 |" in summary["example_report"] and "| bf16 |" in summary["example_report"]
    assert (tmp_path / "loss.png").stat().st_size > 1000

    assert summary["bench"]["settings"]["smoke"]
    assert summary["bench"]["settings"]["cases_done"] == "3 of 3"
    assert "Smoke run on a CPU" in (tmp_path / "GPU_RESULTS.md").read_text()
    markdown = (tmp_path / "SUMMARY.md").read_text()
    assert "Smoke run on a CPU" in markdown and "Overall: **passed**" in markdown
    assert "| layernorm_mlp | delayed |" in markdown and "FP8 relative to BF16" in markdown
    assert f"jax {jax.__version__}" in markdown


def test_without_a_gpu_it_stops_after_the_environment_and_fails(tmp_path):
    completed = _gpu_check(tmp_path, "--system", python=False)
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FAILED"
    assert [p["phase"] for p in summary["phases"]] == ["environment"]
    assert summary["phases"][0]["status"] == "failed: JAX sees no GPU"
    assert "JAX sees no GPU" in (tmp_path / "environment.txt").read_text()


def test_a_spent_budget_skips_the_phases(tmp_path):
    completed = _gpu_check(tmp_path, "--smoke", "--budget", "1")
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["phases"][0]["status"] == "skipped: time budget spent"
    assert "Overall: **FAILED**" in (tmp_path / "SUMMARY.md").read_text()


def test_system_mode_installs_nothing():
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--system", "--find-links", "wheels"],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2 and "--system installs nothing" in completed.stderr
