"""FP8 on the expert-parallel wire in the program XLA:GPU compiles for eight H100s (deviceless).

One bfloat16 training step of a ``MoEBlock`` at 4-way expert parallelism (``bench.moe_wire``'s
small block): under delayed scaling the dispatch all-to-all moves float8 bytes and each row
block's bfloat16 amax, at most 0.55 of the BF16 program's dispatch (a GPU keeps bfloat16
collectives 2 bytes wide, where XLA:CPU widens them to float32); the combine and the dispatch's
gradient stay in bfloat16, as in the BF16 program.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra (jax[cuda12])")

from bench.moe_wire import CASES, h100_devices, step_hlo, wire_bytes
from te_flax._tools.hlo import parse_collectives

pytestmark = pytest.mark.gpu_compile

SMALL = CASES[0]


@functools.cache
def _hlo(fp8: bool) -> str:
    return step_hlo(SMALL, fp8, ways=4, devices=h100_devices())


def test_fp8_dispatch_moves_at_most_055_of_the_bf16_bytes():
    bf16, fp8 = wire_bytes(_hlo(False)), wire_bytes(_hlo(True))
    assert fp8["dispatch"] <= 0.55 * bf16["dispatch"], (fp8, bf16)
    for part in ("dispatch gradient", "combine", "combine gradient"):
        assert fp8[part] == bf16[part] > 0, part


def test_fp8_dispatch_crosses_as_bytes_and_the_rest_in_bfloat16():
    types = {
        ("transpose(" in c.op_name, "/dispatch/" in c.op_name, t)
        for c in parse_collectives(_hlo(True))
        if c.kind == "all-to-all"
        for t, _ in c.operands
    }
    forward_dispatch = {t for backward, dispatch, t in types if dispatch and not backward}
    assert forward_dispatch == {"u8", "u16", "s32"}  # float8 bits, bfloat16 amaxes, expert ids
    assert {t for backward, dispatch, t in types if backward or not dispatch} == {"bf16"}
