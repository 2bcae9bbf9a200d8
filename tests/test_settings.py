"""Scoped settings: nesting, restoring, and the value as part of ``jax.jit``'s cache key, for the
helper and for each context that is built on it."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest

from te_flax._base.settings import ScopedSetting
from te_flax._ops.kernels import dispatch, mode, pallas_kernels
from te_flax.quantize import scaling
from te_flax.sharding import MeshResource, global_mesh_resource, global_shard_guard
from te_flax.training import hold_fp8_state

_NUMBER = ScopedSetting("number", default=0)


def test_scopes_nest_and_restore_also_when_the_block_raises():
    assert _NUMBER.value == 0
    with _NUMBER.scope(1):
        assert _NUMBER.value == 1
        with pytest.raises(RuntimeError), _NUMBER.scope(2):
            assert _NUMBER.value == 2
            raise RuntimeError("leave the block")
        assert _NUMBER.value == 1
    assert _NUMBER.value == 0


def test_a_jitted_function_is_traced_again_for_each_value_and_reused_after():
    traced = []

    @jax.jit
    def scaled(x):
        traced.append(_NUMBER.value)
        return x * _NUMBER.value

    x = jnp.ones(())
    assert float(scaled(x)) == 0.0
    with _NUMBER.scope(3):
        assert float(scaled(x)) == 3.0
    assert float(scaled(x)) == 0.0
    with _NUMBER.scope(3):
        scaled(x)
    assert traced == [0, 3]


def test_each_thread_sees_its_own_value():
    seen = []
    with _NUMBER.scope(5):
        thread = threading.Thread(target=lambda: seen.append(_NUMBER.value))
        thread.start()
        thread.join()
        assert _NUMBER.value == 5
    assert seen == [0]


def test_an_unhashable_value_is_refused_with_the_setting_named():
    with (
        pytest.raises(TypeError, match="number setting takes a hashable value"),
        _NUMBER.scope(
            [1]  # type: ignore[arg-type]
        ),
    ):
        pass


def _plus_one_kernel(x, interpret):
    del interpret
    return x + 1


def test_changing_the_kernel_mode_retraces_a_jitted_function():
    # The kernel ("1": interpret mode on a CPU) adds one, the XLA stage does not: a function
    # jitted under one mode and called under another must not keep the first mode's program.
    @jax.jit
    def run(x):
        return dispatch("quantize", _plus_one_kernel, lambda y: y, x)

    x = jnp.zeros(())
    with pallas_kernels("1"):
        assert float(run(x)) == 1.0
    with pallas_kernels("0"):
        assert float(run(x)) == 0.0
    with pallas_kernels("1"):
        assert float(run(x)) == 1.0
    with pallas_kernels("off"):
        assert mode() == "0"


def test_kernel_mode_refuses_a_non_bool_assume_gpu():
    with pytest.raises(TypeError, match="assume_gpu"), pallas_kernels("auto", assume_gpu="yes"):  # type: ignore[arg-type]
        pass


def test_mesh_resource_and_distinct_axes_and_hold_are_part_of_the_jit_cache_key():
    traced = []

    @jax.jit
    def step(x):
        try:
            resource = global_mesh_resource().dp_resource
        except ValueError:
            resource = None
        traced.append((resource, scaling.distinct_axes()))
        return x

    x = jnp.ones(())
    step(x)
    with global_shard_guard(MeshResource(dp_resource="data")):
        step(x)
    with scaling.distinct_over(("exp",)):
        step(x)
    with hold_fp8_state():
        step(x)
    assert traced == [
        (None, frozenset()),
        ("data", frozenset()),
        (None, frozenset({"exp"})),
        (None, frozenset()),
    ]
