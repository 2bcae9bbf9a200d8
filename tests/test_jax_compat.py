"""The one home of JAX's private internals: each guarded, with a fallback that gives the same
results (slower) and says so once; the tested version range and what reports it."""

from __future__ import annotations

import io
import warnings

import jax
import jax.numpy as jnp
import pytest

import te_flax
from te_flax._base import jax_compat as _jax_compat
from te_flax._ops.kernels import switch
from te_flax.accumulate import accumulate_gradients


@pytest.fixture
def fresh_notes(monkeypatch):
    monkeypatch.setattr(_jax_compat, "_said", set())


def test_versions_inside_the_range_are_not_reported():
    assert _jax_compat.outside_tested_range({"jax": "0.10.2", "jaxlib": "0.12.0.1"}) == []
    assert _jax_compat.outside_tested_range({"flax": "0.12.12", "jax": "0.12.9"}) == []


def test_versions_outside_the_range_are_reported():
    lines = _jax_compat.outside_tested_range({"jax": "0.13.0", "flax": "0.12.7"})
    assert len(lines) == 2
    assert "jax 0.13.0 is outside the range" in lines[0]
    assert "flax 0.12.7 is outside the range" in lines[1]


def test_the_installed_versions_are_inside_the_range():
    assert _jax_compat.outside_tested_range() == []


def test_show_config_says_whether_the_versions_are_tested():
    out = io.StringIO()
    te_flax.show_config(out)
    assert "tested range: yes" in out.getvalue()


def test_batch_tracer_fallback_treats_every_tracer_as_batched_and_says_so_once(
    fresh_notes, monkeypatch
):
    monkeypatch.setattr(_jax_compat, "_BATCH_TRACER", None)
    seen = []
    with pytest.warns(RuntimeWarning, match="recognising vmap's operands"):
        jax.jit(lambda x: seen.append(_jax_compat.is_batch_tracer(x)) or x)(jnp.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second use is silent
        assert _jax_compat.is_batch_tracer(jnp.ones(2)) is False
    assert seen == [True]


def test_accumulation_without_partial_evaluation_gives_the_same_result(fresh_notes, monkeypatch):
    def loss_fn(variables, x):
        return jnp.sum(jnp.tanh(x @ variables["params"]["w"]))

    variables = {"params": {"w": jnp.arange(6.0).reshape(3, 2) / 6}}
    microbatches = jnp.linspace(-1.0, 1.0, 12).reshape(2, 2, 3)
    expected = accumulate_gradients(loss_fn, variables, microbatches)
    monkeypatch.setattr(_jax_compat, "_PARTIAL_EVAL", None)
    with pytest.warns(RuntimeWarning, match="quantizing the kernels once"):
        fallback = accumulate_gradients(loss_fn, variables, microbatches)
    for a, b in zip(jax.tree.leaves(fallback), jax.tree.leaves(expected), strict=True):
        assert jnp.allclose(a, b, rtol=1e-6)


def test_scan_detection_finds_a_scan_body():
    def body(carry, x):
        return carry, _jax_compat.traced_for_scan(x)

    assert not _jax_compat.traced_for_scan(jnp.ones(2))
    found = []
    jax.lax.scan(
        lambda c, x: (found.append(_jax_compat.traced_for_scan(x)) or c, None), 0, jnp.ones(3)
    )
    assert found == [True]


def test_auto_uses_the_triton_kernels_only_where_jax_keeps_that_backend():
    def kernel(x, *, interpret):
        raise AssertionError("the kernel was traced")

    with switch.pallas_kernels("auto", assume_gpu=True):
        if _jax_compat.pallas_triton_kept():
            pytest.skip("this JAX keeps the Pallas Triton backend: auto uses the kernels")
        out = switch.dispatch("quantize", kernel, lambda x: x + 1, jnp.ones(2))
    assert jnp.array_equal(out, jnp.full(2, 2.0))
