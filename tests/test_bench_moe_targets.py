"""bench.gpu_moe's reading of a modelled MoE step: the targets it checks and the GEMM bound."""

from __future__ import annotations

import pytest

from bench.gpu_moe import MODEL_CASES, MODEL_VARIANTS, _case_lines, _gemm_bound_ms
from bench.moe import HBM_BYTES_PER_S, PEAK_FLOPS


def _row(gb: float, peak_ms: float, derated_ms: float, kernel_calls=()) -> dict:
    return {
        "grouped_kernels": len(kernel_calls),
        "kernel_types": [],
        "fp8_gemms": 0,
        "other_gemms": 0,
        "flops": 1e12,
        "bytes": gb * 1e9,
        "memory": {"argument": 0, "output": 0, "alias": 0, "temp": 0},
        "ms": {"peak": peak_ms, "derated": derated_ms},
        "gemm_calls": [],
        "kernel_gemm_calls": list(kernel_calls),
        "mixed_fp8_calls": [(f, b) for f, b, fp8 in kernel_calls if fp8],
        "top": [],
    }


def _lines(fp8: dict, bf16_peak: float = 30.0, bf16_derated: float = 40.0) -> str:
    rows = {name: _row(40.0, bf16_peak, bf16_derated) for name in MODEL_VARIANTS}
    rows["MoEBlock fp8"] = fp8
    return "\n".join(_case_lines(MODEL_CASES[0], rows))


def test_the_targets_say_which_model_meets_them():
    # 0.80 of the bytes; 1.50x at peak (30 / 20), 1.43x derated (40 / 28).
    text = _lines(_row(32.0, 20.0, 28.0))
    assert "bytes at most 0.85: 0.800, met;" in text
    assert "1.50x peak, met; 1.43x derated, **not met**." in text
    # 0.90 of the bytes, slower than 1.5x on both models.
    text = _lines(_row(36.0, 25.0, 35.0))
    assert "0.900, **not met**;" in text
    assert "1.20x peak, **not met**; 1.14x derated, **not met**." in text


def test_the_bound_counts_each_gemm_at_the_rate_of_its_types():
    """Float8 calls at the FP8 peak, the others (jax 0.10's gradient GEMMs in bfloat16) at
    BF16's; bytes do not count."""
    calls = [(2e12, 5e9, True), (4e12, 9e9, False)]
    expected = 1e3 * (2e12 / PEAK_FLOPS["fp8"] + 4e12 / PEAK_FLOPS["bf16"])
    assert _gemm_bound_ms(_row(0.0, 1.0, 1.0, calls)) == pytest.approx(expected)
    text = _lines(_row(32.0, 20.0, 28.0, calls))
    assert f"take {expected:.2f} ms;" in text
    assert f"more than {30.0 / expected:.2f}x faster" in text


def test_mixed_float8_gemms_at_bf16_rate_add_their_lost_time():
    """jax 0.10's best case for HYBRID: its e4m3 x e5m2 GEMMs at BF16's peak, each call still
    the longer of its FLOPs and its bytes; a call bound by its bytes costs nothing more."""
    compute_bound, byte_bound = (4e12, 1e9, True), (1e9, 3.35e9, True)
    text = _lines(_row(32.0, 20.0, 28.0, [compute_bound, byte_bound]))
    slower = 1e3 * (4e12 / PEAK_FLOPS["bf16"] - 4e12 / PEAK_FLOPS["fp8"])
    assert 1e9 / PEAK_FLOPS["bf16"] < 3.35e9 / HBM_BYTES_PER_S
    assert f"{20.0 + slower:.2f} ms peak, {30.0 / (20.0 + slower):.2f}x the best BF16 row" in text
    assert "its 2 e4m3 x e5m2 GEMMs" in text
