"""``te_flax.explain``: every GEMM of a compiled program, FP8 or not, where it runs, its source.

Programs whose GEMMs are known: one FP8 ``dense`` training step (three GEMMs: forward
e4m3 x e4m3, dgrad e5m2 x e4m3, wgrad e4m3 x e5m2), a plain bfloat16 ``jnp.dot`` beside it (not
FP8, its line named in the summary), a ``layernorm_mlp`` step (six FP8 GEMMs), a data-parallel
step on 8 CPU devices (its gradient all-reduce) and a scanned product (run once per iteration).
The CPU target emulates FP8 (XLA widens the float8 operands), which the report says; the H100
target (deviceless, the ``gpu-compile`` extra) runs them on cuBLASLt. Then the HLO reader on a
hand-written module (stack frames, kernels, ragged_dot), the command line and the errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import te_flax
import te_flax._explain
from te_flax.__main__ import main
from te_flax._ops.grouped import RaggedOnGpuWarning
from te_flax._ops.kernels import pallas_kernels
from te_flax._tools import targets
from te_flax._tools.explain import read_report
from te_flax.dense import dense, grouped_dense, grouped_quantizer_set
from te_flax.layernorm_mlp import layernorm_mlp
from te_flax.quantize import DelayedScaling, QuantizerFactory

TOKENS, HIDDEN, FEATURES, OUT = 32, 64, 128, 16
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> str:
    """``test_explain.py:N``, N the line of this file that ends with ``# marker``."""
    numbers = [i for i, text in enumerate(SOURCE, 1) if text.endswith(f"# {marker}")]
    assert len(numbers) == 1, marker
    return f"test_explain.py:{numbers[0]}"


def _quantizer_set():
    return QuantizerFactory.create_set(fp8_recipe=DelayedScaling(amax_history_len=4))


def dense_then_dot(kernel, quantizer_set, x, w):
    out = dense(x, kernel, quantizer_set=quantizer_set)  # fp8 dense
    y = jnp.dot(out, w)  # bf16 dot
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def dense_step():
    """A training step: an FP8 dense, then a bfloat16 product of its output."""
    args = (
        jnp.ones((HIDDEN, FEATURES), jnp.float32),
        _quantizer_set(),
        jnp.ones((TOKENS, HIDDEN), jnp.bfloat16),
        jnp.ones((FEATURES, OUT), jnp.bfloat16),
    )
    return jax.value_and_grad(dense_then_dot, argnums=(0, 1, 2)), args


def mlp_loss(params, quantizer_sets, x):
    out = layernorm_mlp(  # fp8 mlp
        x,
        params["gamma"],
        params["beta"],
        [params["k1"], params["k2"]],
        [None, None],
        "layernorm",
        quantizer_sets=quantizer_sets,
    )
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def mlp_step():
    params = {
        "gamma": jnp.ones((HIDDEN,)),
        "beta": jnp.zeros((HIDDEN,)),
        "k1": jnp.ones((HIDDEN, 1, FEATURES)),
        "k2": jnp.ones((FEATURES, HIDDEN)),
    }
    args = (params, (_quantizer_set(), _quantizer_set()), jnp.ones((TOKENS, HIDDEN), jnp.bfloat16))
    return jax.value_and_grad(mlp_loss, argnums=(0, 1, 2)), args


def _by_role(report: te_flax.ExplainReport, tokens: int = TOKENS) -> dict[str, te_flax.GemmInfo]:
    """The dense's three GEMMs by their output shape (forward, dgrad, wgrad); ``tokens`` per
    device."""
    roles = {(tokens, FEATURES): "forward", (tokens, HIDDEN): "dgrad", (HIDDEN, FEATURES): "wgrad"}
    found = {roles[g.shape]: g for g in report.gemms if g.fp8 and g.shape in roles}
    assert sorted(found) == ["dgrad", "forward", "wgrad"], report
    return found


def _assert_dense_step(report: te_flax.ExplainReport, tokens: int = TOKENS) -> None:
    roles = _by_role(report, tokens)
    assert roles["forward"].operand_dtypes == (E4M3, E4M3)
    assert roles["dgrad"].operand_dtypes == (E5M2, E4M3)
    assert roles["wgrad"].operand_dtypes == (E4M3, E5M2)
    assert not roles["forward"].backward and roles["dgrad"].backward and roles["wgrad"].backward
    for gemm in roles.values():
        assert gemm.source.endswith(f"{_line('fp8 dense')} (dense_then_dot)"), gemm
        assert gemm.bytes >= HIDDEN * FEATURES  # at least its float8 kernel
        assert gemm.runs == 1
    # The bfloat16 product and its gradient (XLA:CPU before jax 0.12 computes bfloat16 dots in
    # float32, and the report says what XLA compiled).
    others = [gemm for gemm in report.gemms if not gemm.fp8]
    dtypes = {gemm.dtypes for gemm in others}
    assert others and dtypes in ({"bfloat16"}, {"float32"}), others
    assert report.target == "cpu" or dtypes == {"bfloat16"}
    bf16 = f"{len(others)} in {dtypes.pop()}: tests/{_line('bf16 dot')} (dense_then_dot)"
    assert report.summary.startswith(f"3 of {3 + len(others)} GEMMs in FP8; {bf16}")


# ----------------------------------------------------------------------------- CPU target


@pytest.fixture(scope="module")
def cpu_dense_report() -> te_flax.ExplainReport:
    step, args = dense_step()
    return te_flax.explain(step, *args, target="cpu")


def test_cpu_dense_step_has_three_emulated_fp8_gemms_and_names_the_bf16_line(cpu_dense_report):
    report = cpu_dense_report
    _assert_dense_step(report)
    assert report.target == "cpu" and report.compile_seconds > 0
    for gemm in _by_role(report).values():
        # XLA:CPU has no FP8 GEMM: it widens the float8 operands, and the report says so.
        assert gemm.emulated and not any(d.startswith("float8") for d in gemm.read_dtypes)
        assert gemm.runs_on.startswith("XLA dot") and "FP8 emulated" in gemm.runs_on
    assert report.summary.endswith("FP8 emulated (this target has no FP8 GEMM)")
    assert report.collectives == ()


def test_report_prints_summary_first_then_a_row_per_gemm(cpu_dense_report):
    text = str(cpu_dense_report)
    lines = text.splitlines()
    assert lines[0].startswith("te_flax.explain: cpu, compiled in ")
    assert lines[1] == cpu_dense_report.summary
    header = next(line for line in lines if line.lstrip().startswith("pass"))
    assert header.split() == ["pass", "operands", "output", "runs", "on", "bytes", "runs", "source"]
    rows = lines[lines.index(header) + 1 : lines.index("Collectives") - 1]
    assert len(rows) == len(cpu_dense_report.gemms)
    assert sum(f"{E5M2} x {E4M3}" in row for row in rows) == 1  # the dgrad
    assert "Collectives\n  (none)" in text


def test_cpu_layernorm_mlp_step_has_six_fp8_gemms():
    step, args = mlp_step()
    report = te_flax.explain(step, *args, target="cpu")
    assert len(report.gemms) == 6 and all(gemm.fp8 for gemm in report.gemms), report
    assert report.summary.startswith("6 of 6 GEMMs in FP8")
    assert {gemm.source for gemm in report.gemms} == {f"tests/{_line('fp8 mlp')} (mlp_loss)"}
    assert sum(not gemm.backward for gemm in report.gemms) == 2


def test_sharded_step_reports_its_gradient_all_reduce():
    """Data parallel on 8 CPU devices: the batch is split, the kernel replicated, so the
    kernel's gradient is summed over the devices (an all-reduce of float32 [hidden, features])."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    step, (kernel, quantizer_set, x, w) = dense_step()
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", None)))
    report = te_flax.explain(step, kernel, quantizer_set, x, w, target="cpu")
    _assert_dense_step(report, tokens=TOKENS // 8)  # each device's GEMMs: its rows
    reduces = [c for c in report.collectives if c.kind == "all-reduce"]
    # The kernel's gradient (XLA may combine it with the loss's scalars into one all-reduce).
    gradient = [c for c in reduces if c.bytes >= HIDDEN * FEATURES * 4]
    assert len(gradient) == 1 and gradient[0].dtypes == ("float32",), report
    assert not gradient[0].fp8 and gradient[0].backward
    assert report.summary.endswith(f"; {len(report.collectives)} collectives (float32)")
    assert "\n  all-reduce  float32  32.0 KiB  1     tests/test_explain.py:" in str(report)


def test_a_scanned_gemm_runs_once_per_iteration():
    def stacked(kernels, x):
        def layer(x, kernel):
            return jnp.dot(x, kernel), None  # scanned dot

        return jax.lax.scan(layer, x, kernels)[0]

    report = te_flax.explain(stacked, jnp.ones((3, 16, 16)), jnp.ones((4, 16)), target="cpu")
    assert [(gemm.runs, gemm.fp8) for gemm in report.gemms] == [(3, False)], report
    assert report.gemms[0].source.endswith(f"{_line('scanned dot')} (layer)")


def test_host_target_is_the_default_backend_with_its_own_fp8_lowering():
    step, args = dense_step()
    report = te_flax.explain(step, *args, target="host")
    assert report.target == f"host ({jax.default_backend()})"
    # This backend (the suite's CPU) has no FP8 GEMM: the dense's GEMMs are emulated FP8.
    assert [gemm.emulated for gemm in report.gemms if gemm.fp8] == [True] * 3, report


def test_a_jitted_function_keeps_its_static_arguments():
    scaled = jax.jit(lambda x, k, n: jnp.dot(x, k) * n, static_argnums=2)
    report = te_flax.explain(scaled, jnp.ones((8, 16)), jnp.ones((16, 4)), 3, target="cpu")
    assert [gemm.dtypes for gemm in report.gemms] == ["float32"]


# ----------------------------------------------------------------------------- the HLO reader

# A module as XLA prints it: the frame tables (a parent printed one above its id), a float8
# operand widened inside a fusion, a te_flax kernel GEMM, an expanded ragged_dot in a loop of 4.
_MODULE = """HloModule step

FileNames
1 "/home/user/model.py"
2 "TE_FLAX/dense.py"

FunctionNames
1 "<module>"
2 "loss"
3 "dense"

FileLocations
1 {file_name_id=1 function_name_id=1 line=30 end_line=30 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=5 end_column=20}
3 {file_name_id=2 function_name_id=3 line=99 end_line=99 column=5 end_column=20}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}

%widened (p0: f8e4m3fn[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = f8e4m3fn[8,16]{1,0} parameter(0)
  %wide = bf16[8,16]{1,0} convert(%p0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%wide, %p1), DIMS, FORWARD_3
}

%body (state: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %state = (s32[], bf16[8,16]{1,0}) parameter(0)
  %x = bf16[8,16]{1,0} get-tuple-element(%state), index=1
  %gemm.2 = (bf16[8,16]{1,0}, s8[1024]{0}) custom-call(%x, %x), CUBLAS, RAGGED_2
  %i = s32[] get-tuple-element(%state), index=0
  %y = bf16[8,16]{1,0} get-tuple-element(%gemm.2), index=0
  ROOT %next = (s32[], bf16[8,16]{1,0}) tuple(%i, %y)
}

%cond (c: (s32[], bf16[8,16])) -> pred[] {
  %c = (s32[], bf16[8,16]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: f8e4m3fn[8,16], b: bf16[16,4], s: s32[4], k: f8e4m3fn[4,16,16]) -> bf16[8,4] {
  %a = f8e4m3fn[8,16]{1,0} parameter(0)
  %b = bf16[16,4]{1,0} parameter(1)
  %s = s32[4]{0} parameter(2)
  %k = f8e4m3fn[4,16,16]{2,1,0} parameter(3)
  %kernel = bf16[8,16]{1,0} custom-call(%s, %a, %k), custom_call_target="mosaic_gpu_v2", KERNEL_3
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,16]{1,0}) tuple(%zero, %kernel)
  %loop = (s32[], bf16[8,16]{1,0}) while(%init), condition=%cond, body=%body, FOUR_TRIPS
  ROOT %fused = bf16[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%widened
}
"""
_MODULE_ATTRIBUTES = {
    "FORWARD_3": 'metadata={op_name="jit(step)/jvp()/dot_general" stack_frame_id=3}',
    "RAGGED_2": 'metadata={op_name="jit(step)/jvp()/ragged_dot_general" stack_frame_id=2}',
    "KERNEL_3": 'metadata={op_name="jit(step)/transpose(jvp())/te_flax_group_gemm" '
    "stack_frame_id=3}",
    "DIMS": "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "CUBLAS": 'custom_call_target="__cublas$lt$matmul"',
    "FOUR_TRIPS": 'backend_config={"known_trip_count":{"n":"4"}}',
}


def test_the_reader_finds_every_gemm_with_its_dtypes_place_runs_and_source_line():
    te_flax_folder = str(Path(te_flax.__file__).parent)
    module = _MODULE.replace("TE_FLAX", te_flax_folder)
    for placeholder, attribute in _MODULE_ATTRIBUTES.items():
        module = module.replace(placeholder, attribute)
    report = read_report(module, "h100")  # a target with FP8 GEMMs
    gemms = {gemm.name: gemm for gemm in report.gemms}
    assert sorted(gemms) == ["fused", "gemm.2", "kernel"]
    fused, ragged, kernel = gemms["fused"], gemms["gemm.2"], gemms["kernel"]
    # The dot reads bf16, widened from float8 inside its fusion: on a target with FP8 GEMMs
    # that is a bfloat16 GEMM, and the report says where the float8 went.
    assert fused.operand_dtypes == fused.read_dtypes == ("bfloat16", "bfloat16")
    assert fused.runs_on == "XLA dot, float8 widened to bfloat16 before it" and not fused.fp8
    assert fused.bytes == 8 * 16 + 16 * 4 * 2 + 8 * 4 * 2
    # The frames: te_flax's dense, called from the user's line 12, called from line 30.
    assert fused.source == "/home/user/model.py:12 (loss)"
    assert fused.stack[1:] == ("/home/user/model.py:12 (loss)", "/home/user/model.py:30 (<module>)")
    assert ragged.runs_on == "XLA's expansion of ragged_dot: cuBLASLt" and ragged.runs == 4
    # x read once (it is both operands), the result written; not the workspace
    assert ragged.shape == (8, 16) and ragged.bytes == 2 * 8 * 16 * 2
    assert kernel.runs_on == "te_flax kernel te_flax_group_gemm" and kernel.fp8
    assert kernel.backward and not fused.backward
    assert report.summary == "1 of 3 GEMMs in FP8; 2 in bfloat16: /home/user/model.py:12 (loss)"


def test_on_a_target_without_fp8_gemms_widened_float8_counts_as_emulated_fp8():
    module = _MODULE.replace("TE_FLAX", "/te_flax")
    for placeholder, attribute in _MODULE_ATTRIBUTES.items():
        module = module.replace(placeholder, attribute)
    fused = read_report(module, "cpu", fp8_gemms=False).gemms[0]
    assert fused.name == "fused" and fused.runs_on == "XLA dot, FP8 emulated in bfloat16"
    assert fused.operand_dtypes == (E4M3, "bfloat16") and fused.emulated and not fused.fp8


# ----------------------------------------------------------------------------- command line


def cli_program():
    """The command line's example: ``python -m te_flax explain tests.test_explain:cli_program``."""
    return dense_step()


def test_command_line_prints_the_report(capsys):
    assert main(["explain", "tests.test_explain:cli_program", "--target", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("te_flax.explain: cpu")
    assert "3 of " in printed.splitlines()[1] and _line("bf16 dot") in printed


def test_python_m_te_flax_explain_runs_a_file():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "te_flax", "explain", "tests/test_explain.py:cli_program"]
    completed = subprocess.run(
        [*command, "--target", "cpu"], env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines()[1].startswith("3 of "), completed.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "no_colon"], "expected MODULE:FUNCTION"),
        (["explain", "tests.test_explain:missing"], "has no function 'missing'"),
        (["explain", "tests.no_such_module:step"], "no module 'tests.no_such_module' here"),
        (["explain", "no_such_file.py:step"], "no Python file 'no_such_file.py'"),
        (["explain", "tests.test_explain:E4M3"], "has no function 'E4M3'"),
        (["explain", "tests.test_explain:_quantizer_set"], "must return (fn, args)"),
    ],
)
def test_command_line_errors_say_what_is_expected(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main([*argv, "--target", "cpu"])
    assert raised.value.code == 2  # argparse's status for a wrong command line
    printed = capsys.readouterr().err
    assert printed.startswith("usage: python -m te_flax") and message in printed, printed


# ----------------------------------------------------------------------------- errors


def test_unknown_target_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"one of 'h100', 'cpu', 'host'.*got 'a100'"):
        te_flax.explain(jnp.dot, jnp.ones((2, 2)), jnp.ones((2, 2)), target="a100")


def test_h100_without_the_cuda_jaxlib_names_the_extra(monkeypatch):
    monkeypatch.setattr(targets, "_cuda_plugin", lambda: None)
    monkeypatch.setattr(te_flax._explain, "local_gpu", lambda target: False)
    with pytest.raises(RuntimeError, match=r"pip install 'te-flax\[gpu-compile\]'.*target='cpu'"):
        te_flax.explain(jnp.dot, jnp.ones((2, 2)), jnp.ones((2, 2)))


# ----------------------------------------------------------------------------- H100 target


@pytest.mark.gpu_compile
def test_h100_dense_step_runs_its_three_fp8_gemms_on_cublaslt():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    step, args = dense_step()
    report = te_flax.explain(step, *args, target="h100")
    assert report.target == "h100 (deviceless compile)"
    _assert_dense_step(report)
    for gemm in _by_role(report).values():
        assert gemm.runs_on == "cuBLASLt FP8" and not gemm.emulated
    assert all(gemm.runs_on.startswith("cuBLAS") for gemm in report.gemms if not gemm.fp8)
    assert "emulated" not in report.summary


@pytest.mark.gpu_compile
def test_h100_layernorm_mlp_step_runs_six_fp8_gemms_on_cublaslt():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    step, args = mlp_step()
    report = te_flax.explain(step, *args, target="h100")
    assert [gemm.runs_on for gemm in report.gemms] == ["cuBLASLt FP8"] * 6, report
    assert report.summary == "6 of 6 GEMMs in FP8"


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    ("kernels", "runs_on"),
    [("auto", "te_flax kernel te_flax_"), ("0", "XLA's expansion of ragged_dot: cuBLASLt FP8")],
)
def test_h100_grouped_dense_names_its_kernels_or_xlas_ragged_dot(kernels, runs_on):
    """grouped_dense's ragged lowering: te_flax's grouped GEMM kernels where the switch takes
    them (explain traces as a GPU process does), else XLA's rewrite of ragged_dot."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    # Shapes the kernels take (the forward's needs 128-row tiles per group).
    groups, rows, hidden, features = 4, 512, 256, 512
    quantizer_set = grouped_quantizer_set(_quantizer_set(), groups)

    def loss(kernel, quantizer_set, x, sizes):
        out = grouped_dense(x, kernel, sizes, quantizer_set=quantizer_set, lowering="ragged")
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    args = (
        jnp.ones((groups, hidden, features)),
        quantizer_set,
        jnp.ones((rows, hidden), jnp.bfloat16),
        jnp.full((groups,), rows // groups, jnp.int32),
    )
    with pallas_kernels(kernels), warnings.catch_warnings():
        warnings.simplefilter("ignore", RaggedOnGpuWarning)  # the XLA rewrite, said below
        report = te_flax.explain(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    assert len(report.gemms) == 3 and all(gemm.fp8 for gemm in report.gemms), report
    assert all(gemm.runs_on.startswith(runs_on) for gemm in report.gemms), report


@pytest.mark.gpu_compile
def test_h100_sharded_step_moves_its_mesh_onto_deviceless_h100s():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    step, (kernel, quantizer_set, x, w) = dense_step()
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", None)))
    kernel = jax.device_put(kernel, NamedSharding(mesh, PartitionSpec("fsdp", None)))
    report = te_flax.explain(step, kernel, quantizer_set, x, w)
    # Each device's GEMMs (the partitioner picks their blocks), the dense's three in FP8.
    assert [gemm.runs_on for gemm in report.gemms if gemm.fp8] == ["cuBLASLt FP8"] * 3, report
    assert all(gemm.runs_on.startswith("cuBLAS") for gemm in report.gemms)
    kinds = {collective.kind for collective in report.collectives}
    assert {"all-gather", "all-reduce"} <= kinds, report  # the FSDP kernel, the gradient
