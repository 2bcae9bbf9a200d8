"""``bench.same_programs``: what it compares of two programs, and what it leaves out."""

from __future__ import annotations

from bench.same_programs import compare, normalized

# An HLO text as XLA prints it: its lines are as long as XLA makes them.
PROGRAM = """HloModule jit_step_{n}, entry_computation_layout={{(f32[4]{{0}})->f32[4]{{0}}}}

FileNames
1 "{path}/te_flax/_ops/gemm.py"

StackFrames
1 {{file_location_id=1 parent_frame_id=0}}

ENTRY %main (x: f32[4]) -> f32[4] {{
  %x = f32[4]{{0}} parameter(0)
  ROOT %y = f32[4]{{0}} {op}(%x, %x), metadata={{op_name="jit(step)/mul" source_file="{path}/a.py" source_line={n}}}, stack_frame_id=1
  %k = (f32[4]{{0}}) custom-call(%x), custom_call_target="mosaic_gpu_v2", backend_config={{kernel_hash = "{n}", module = "ML{path}", skip_device_barrier = false}}
}}
"""  # noqa: E501


def test_normalized_keeps_the_program_and_drops_its_source_locations():
    one = PROGRAM.format(n=1, path="/a", op="multiply")
    other = PROGRAM.format(n=2, path="/somewhere/else", op="multiply")
    assert normalized(one) == normalized(other)
    assert "source_file" not in normalized(one) and "/a" not in normalized(one)
    assert 'custom_call_target="mosaic_gpu_v2"' in normalized(one)
    assert normalized(one) != normalized(PROGRAM.format(n=1, path="/a", op="add"))


def test_compare_names_each_program_that_differs_or_is_missing(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    for name in ("a", "b", "c"):
        (before / f"{name}.hlo").write_text(name)
    (after / "a.hlo").write_text("a")
    (after / "b.hlo").write_text("B")
    lines: list[str] = []
    assert not compare(before, after, lines.append)
    assert lines == ["DIFFERENT: b.hlo", "DIFFERENT: c.hlo", "1 of 3 programs the same"]
    (after / "b.hlo").write_text("b")
    (after / "c.hlo").write_text("c")
    assert compare(before, after, lines.append)
    assert not compare(tmp_path / "empty", after, lines.append)  # nothing compared
