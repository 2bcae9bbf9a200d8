"""The compiled-HLO reader the benches and the GPU-compile tests share."""

from te_flax._tools.hlo import computation_rows, entry_rows

# Two instructions of an optimized module: a custom call returning a tuple of seven values (its
# text carries ``/*index=5*/`` comments) and a fusion reading one of them.
_NORM = (
    "  %norm = (bf16[4,8]{1,0}, f32[4]{0}, f32[4]{0}, f32[1]{0}, f32[1]{0}, /*index=5*/f32[1]{0},"
    ' u8[16]{0}) custom-call(%p0), custom_call_target="te_norm_forward_ffi"'
)
_MODULE = "\n".join(
    [
        "HloModule step",
        "",
        "ENTRY %main (p0: bf16[4,8]) -> f32[4] {",
        "  %p0 = bf16[4,8]{1,0} parameter(0)",
        _NORM,
        "  %gte = f32[4]{0} get-tuple-element(%norm), index=1",
        "  ROOT %out = f32[4]{0} fusion(%gte), kind=kLoop, calls=%fused",
        "}",
    ]
)


def test_a_tuple_of_six_or_more_values_is_counted_whole():
    rows = {row["name"]: row for row in entry_rows(_MODULE)}
    assert set(rows) == {"norm", "out"}
    # read bf16[4,8] (64 B); written 64 + 16 + 16 + 4 + 4 + 4 + 16 B
    assert rows["norm"]["bytes"] == 64 + 64 + 16 + 16 + 4 + 4 + 4 + 16
    assert rows["norm"]["instruction"] == "GEMM te_norm_forward_ffi"
    # the fusion reads the custom call's whole tuple value (operand accounting by name)
    assert rows["out"]["instruction"] == "fusion kLoop"


def test_instructions_that_move_nothing_are_left_out():
    rows = computation_rows(["  %p = f32[8]{0} parameter(0)", "  %c = f32[] constant(1)"])
    assert rows == []


def test_an_async_collective_moves_its_operands_and_outputs_once():
    """A start's result tuple repeats its operands and the done only waits: an all-gather of
    bf16[8,64] (1 KiB) into bf16[8,512] (8 KiB) moves 9 KiB, a reduce-scatter back 9 KiB, and an
    all-reduce-start (whose result is its output alone) 2 x 128 B."""
    rows = computation_rows(
        [
            "  %x = bf16[8,64]{1,0} parameter(0)",
            "  %ag = (bf16[8,64]{1,0}, bf16[8,512]{1,0}) all-gather-start(%x), dimensions={1}",
            "  %agd = bf16[8,512]{1,0} all-gather-done(%ag)",
            "  %rs = ((bf16[8,512]{1,0}), bf16[8,64]{1,0}) reduce-scatter-start(%agd), "
            "dimensions={1}, to_apply=%add",
            "  %rsd = bf16[8,64]{1,0} reduce-scatter-done(%rs)",
            "  %s = f32[32]{0} parameter(1)",
            "  %ar = f32[32]{0} all-reduce-start(%s), to_apply=%add",
            "  %ard = f32[32]{0} all-reduce-done(%ar)",
        ]
    )
    moved = {row["name"]: row["bytes"] for row in rows}
    assert moved == {"ag": 1024 + 8192, "rs": 8192 + 1024, "ar": 128 + 128}
