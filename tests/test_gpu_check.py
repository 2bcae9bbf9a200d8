"""scripts/gpu_check: its CPU smoke run writes every file, and it stops cleanly without a GPU
or without time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check"


def _gpu_check(out: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--python", sys.executable, *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_smoke_run_writes_every_figure(tmp_path):
    completed = _gpu_check(tmp_path, "--smoke")
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "passed" and summary["smoke"]
    assert [(p["phase"], p["status"]) for p in summary["phases"]] == [
        ("environment", "passed"),
        ("tests", "passed"),
        ("bench", "passed"),
    ]
    assert "pip-freeze.txt" in os.listdir(tmp_path)
    assert "devices [CpuDevice" in (tmp_path / "environment.txt").read_text()

    # The GPU tests all ran (a CPU device standing in for the GPU), but for the one that reads
    # the GPU's cuBLASLt calls.
    suite = ElementTree.parse(tmp_path / "tests" / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert int(suite.get("tests")) >= 15
    assert skipped and all(name.startswith("test_the_gpu_runs_cublaslt") for name in skipped)

    # One file of figures per test, what each measured.
    figures = {
        p.stem: json.loads(p.read_text())
        for p in (tmp_path / "tests/figures").glob("*")
        if p.suffix == ".json"
    }
    assert len(figures) == int(suite.get("tests"))
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
    report = (tmp_path / "tests/figures/lm/report.md").read_text()
    assert "| fp8 |" in report and "| bf16 |" in report
    assert (tmp_path / "tests/figures/lm/loss.png").stat().st_size > 1000

    bench = json.loads((tmp_path / "bench" / "gpu_results.json").read_text())
    assert bench["settings"]["smoke"] and bench["settings"]["cases_done"] == "3 of 3"
    assert "Smoke run on a CPU" in (tmp_path / "bench" / "GPU_RESULTS.md").read_text()
    markdown = (tmp_path / "SUMMARY.md").read_text()
    assert "Smoke run on a CPU" in markdown and "Overall: **passed**" in markdown
    assert "| layernorm_mlp | delayed |" in markdown and "FP8 relative to BF16" in markdown


def test_without_a_gpu_it_stops_after_the_environment_and_fails(tmp_path):
    completed = _gpu_check(tmp_path)
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FAILED"
    assert [p["phase"] for p in summary["phases"]] == ["environment"]
    assert "JAX sees no GPU" in (tmp_path / "environment.txt").read_text()


def test_a_spent_budget_skips_the_phases(tmp_path):
    completed = _gpu_check(tmp_path, "--smoke", "--budget", "1")
    assert completed.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["phases"][0]["status"] == "skipped: time budget spent"
    assert "Overall: **FAILED**" in (tmp_path / "SUMMARY.md").read_text()
