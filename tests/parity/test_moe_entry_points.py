"""TransformerEngine's MoE entry points: ``te_flax.moe.get_moe_recv_capacity_per_rank`` sizes a
rank's receive buffer to the token as TE 2.20.2 does, and every ``moe`` argument TE takes,
te_flax takes by the same name (the "same" signature checks of ``test_te_names`` cover the
order and defaults; TE's ``moe`` itself needs its CUDA expert-parallel communicator, so its
results are checked against a dense reference in ``tests/test_moe_te_api.py``)."""

from __future__ import annotations

import inspect
import itertools

import pytest

te_moe = pytest.importorskip("transformer_engine.jax.moe", reason="needs TransformerEngine")

from te_flax import moe as ours  # noqa: E402


def test_recv_capacity_equals_tes():
    cases = itertools.product(
        (4, 8, 16, 64, 256), (1, 2, 4, 8), (1, 3, 64, 1000, 4096), (1, 2, 4, 8, 16),
        (None, 1.0, 1.25, 3.0), (128, 32),
    )  # fmt: skip
    checked = 0
    for experts, topk, tokens, ep, factor, alignment in cases:
        if experts % ep or topk > experts:
            continue
        arguments = dict(
            num_experts=experts,
            num_experts_per_tok=topk,
            max_tokens_per_rank=tokens,
            ep_size=ep,
            recv_capacity_factor=factor,
            alignment=alignment,
        )
        expected = te_moe.get_moe_recv_capacity_per_rank(**arguments)
        assert ours.get_moe_recv_capacity_per_rank(**arguments) == expected, arguments
        checked += 1
    assert checked > 1000


def test_record_ep_bootstrap_signature_takes_tes_arguments():
    theirs = inspect.signature(te_moe.record_ep_bootstrap_signature_for_moe).parameters
    assert list(inspect.signature(ours.record_ep_bootstrap_signature_for_moe).parameters) == list(
        theirs
    )
