"""TransformerEngine's import paths on request (``te_flax.as_transformer_engine``): after the
switch, ``import transformer_engine.jax...`` gives te_flax's objects for every name
docs/porting.md maps, one call runs through each such module, every other TransformerEngine
name is refused with its porting row, and an installed or imported TransformerEngine is never
shadowed silently.

The table the package ships (``te_flax/transformer_engine_names.tsv``) is docs/porting.md's;
regenerate it with ``python -m tests.test_te_paths``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import te_flax
from te_flax import _te_paths
from te_flax.__main__ import main
from tests.test_te_names import ROOT, status_rows

TABLE = ROOT / "te_flax" / _te_paths.TABLE
HEADER = (
    "# docs/porting.md's table of TransformerEngine names (name, status, te_flax), as\n"
    "# te_flax.as_transformer_engine() reads it; written by `python -m tests.test_te_paths`.\n"
)


def table_text() -> str:
    rows = status_rows()
    return HEADER + "".join(f"{name}\t{status}\t{note}\n" for name, (status, note) in rows.items())


def test_the_shipped_table_is_portings():
    assert TABLE.read_text(encoding="utf-8") == table_text(), (
        "te_flax/transformer_engine_names.tsv differs from docs/porting.md: regenerate it with "
        "python -m tests.test_te_paths"
    )


@pytest.fixture
def served():
    """The switch on for one test, off again after it."""
    if _te_paths.importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here: the switch refuses to hide it")
    te_flax.as_transformer_engine()
    yield
    te_flax.as_transformer_engine(False)


def _served_names() -> dict[str, str]:
    same = {
        name: _te_paths.te_flax_path(name)
        for name, (status, _) in status_rows().items()
        if status == "same"
    }
    return {**same, **_te_paths.DROP_INS, **_te_paths.EXTRAS}


def test_every_mapped_name_is_te_flax_s_object(served):
    for te_name, path in _served_names().items():
        module, _, name = te_name.rpartition(".")
        theirs = getattr(importlib.import_module(module), name)
        ours = getattr(importlib.import_module(path.rpartition(".")[0]), path.rpartition(".")[2])
        assert theirs is ours, te_name
    for row, (status, _) in status_rows().items():
        assert row not in _te_paths.DROP_INS or status == "different", row
    import transformer_engine.jax as te

    assert te.flax.module.TransformerEngineBase is te_flax.linen.TransformerEngineBase
    assert "DenseGeneral" in te.flax.__all__ and "flax" in dir(te)


def _calls() -> dict[str, object]:
    """One call per module that serves names, through TransformerEngine's paths."""
    import transformer_engine.jax.flax as te_nn
    from transformer_engine.common import recipe
    from transformer_engine.jax import (
        activation,
        attention,
        autocast,
        dense,
        ep,
        layernorm,
        layernorm_dense,
        layernorm_mlp,
        moe,
        permutation,
        router,
        sharding,
    )
    from transformer_engine.jax import cpp_extensions as tex
    from transformer_engine.jax.flax import module, transformer
    from transformer_engine.jax.quantize import (
        QuantizerFactory,
        helper,
        metadata,
        misc,
        quantizer,
        scaling_modes,
    )

    x = jnp.ones((2, 4, 32))
    kernel, gamma = jnp.full((32, 16), 0.05), jnp.ones(32)
    qs = QuantizerFactory.create_set(fp8_recipe=recipe.DelayedScaling())
    logits = jnp.arange(16.0).reshape(2, 8)
    return {
        "transformer_engine.common.recipe": recipe.Float8CurrentScaling().fp8_format,
        "transformer_engine.jax": autocast(enabled=True, recipe=recipe.DelayedScaling()),
        "transformer_engine.jax.activation": activation.activation(x[:, :, None], ("gelu",)),
        "transformer_engine.jax.attention": attention.reorder_causal_load_balancing(
            x, attention.ReorderStrategy.DualChunkSwap, 2, 1
        ),
        "transformer_engine.jax.cpp_extensions": dense.dense(
            x, kernel, collective_op_set=tex.noop_collective_op_set
        ),
        "transformer_engine.jax.cpp_extensions.gemm": tex.gemm.CollectiveOpSet.create(
            tex.gemm.CollectiveOp.NONE
        ),
        "transformer_engine.jax.dense": dense.dense(x, kernel, quantizer_set=qs),
        "transformer_engine.jax.ep": _bootstrap(ep),
        "transformer_engine.jax.flax": te_nn.DenseGeneral(8).init(jax.random.key(0), x),
        "transformer_engine.jax.flax.module": module.LayerNorm().init(jax.random.key(0), x),
        "transformer_engine.jax.flax.transformer": transformer.rotary_pos_emb(
            x.reshape(2, 4, 2, 16), (1, 10000), False
        ),
        "transformer_engine.jax.layernorm": layernorm.layernorm(x, gamma, None, "rmsnorm"),
        "transformer_engine.jax.layernorm_dense": layernorm_dense.layernorm_dense(
            x, kernel, gamma, jnp.zeros(32)
        ),
        "transformer_engine.jax.layernorm_mlp": layernorm_mlp.layernorm_mlp(
            x,
            gamma,
            None,
            [jnp.full((32, 1, 8), 0.1), jnp.full((8, 32), 0.1)],
            [None, None],
            "rmsnorm",
        ),
        "transformer_engine.jax.moe": moe.get_moe_recv_capacity_per_rank(
            num_experts=8, num_experts_per_tok=2, max_tokens_per_rank=64, ep_size=2
        ),
        "transformer_engine.jax.permutation": permutation.routing_map_to_selected_experts(
            jax.nn.softmax(logits), logits > 5, 2
        ),
        "transformer_engine.jax.quantize": QuantizerFactory.create_set(),
        "transformer_engine.jax.quantize.helper": helper.fp8_autocast(enabled=False),
        "transformer_engine.jax.quantize.metadata": metadata.QuantizeMeta(),
        "transformer_engine.jax.quantize.misc": misc.QuantizeLayout.ROWWISE,
        "transformer_engine.jax.quantize.quantizer": quantizer.noop_quantizer_set.is_noop,
        "transformer_engine.jax.quantize.scaling_modes": scaling_modes.ScalingMode.NO_SCALING,
        "transformer_engine.jax.router": router.fused_topk_with_score_function(logits, 2),
        "transformer_engine.jax.sharding": sharding.global_shard_guard(sharding.MeshResource()),
    }


def _bootstrap(ep) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ep_bootstrap's note that it sets nothing up
        ep.ep_bootstrap(1, 0, 4, 8, 128, 32)
    ep.ep_finalize()
    return True


def test_one_call_through_every_mapped_module(served):
    calls = _calls()
    modules = {name.rpartition(".")[0] for name in _served_names()}
    assert set(calls) == modules, "every module that serves names gets a call here"
    for module, result in calls.items():
        assert result is not None, module


def test_other_names_are_refused_with_their_porting_row(served):
    with pytest.raises(_te_paths.TransformerEngineNameError) as error:
        from transformer_engine.jax.softmax import softmax  # noqa: F401
    message = str(error.value)
    assert (
        "docs/porting.md" in message and "row `transformer_engine.jax.softmax.softmax`" in message
    )
    assert "refused" in message and "jax.nn.softmax" in message
    import transformer_engine.jax.cpp_extensions as tex

    with pytest.raises(_te_paths.TransformerEngineNameError, match=r"row `transformer_engine\.jax"
                       r"\.cpp_extensions\.\*`"):  # fmt: skip
        tex.collective_gemm_bootstrap  # noqa: B018  (a name only the module's row covers)
    with pytest.raises(_te_paths.TransformerEngineNameError, match="different"):
        from transformer_engine.jax.ep import ep_dispatch  # noqa: F401
    import transformer_engine.jax.dense as te_dense

    with pytest.raises(AttributeError, match="public JAX names"):
        te_dense.no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        import transformer_engine.pytorch  # noqa: F401
    assert importlib.util.find_spec("transformer_engine.jax.no_such_module") is None


def test_an_imported_or_installed_transformer_engine_is_never_shadowed_silently(tmp_path):
    fake = types.ModuleType("transformer_engine")
    sys.modules["transformer_engine"] = fake
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            te_flax.as_transformer_engine()
    finally:
        del sys.modules["transformer_engine"]
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("REAL = True\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"installed here.*shadow_installed=True"):
            te_flax.as_transformer_engine()
        assert not _te_paths.transformer_engine_served()
        with pytest.warns(_te_paths.ShadowedTransformerEngineWarning, match="is hidden"):
            te_flax.as_transformer_engine(shadow_installed=True)
        import transformer_engine

        assert not hasattr(transformer_engine, "REAL")
        assert transformer_engine.jax.autocast is te_flax.autocast
    finally:
        te_flax.as_transformer_engine(False)
        sys.path.remove(str(tmp_path))
    assert "transformer_engine" not in sys.modules


def test_the_environment_variable_and_the_run_command(tmp_path):
    script = tmp_path / "uses_te.py"
    script.write_text(
        "import sys\n"
        "import transformer_engine.jax.flax as te_nn\n"
        "print(type(te_nn).__name__, te_nn.LayerNormMLP.__module__, sys.argv[1:])\n"
    )
    env = {**os.environ, "TE_FLAX_AS_TRANSFORMER_ENGINE": "1", "JAX_PLATFORMS": "cpu"}
    code = "import te_flax, transformer_engine.jax as te; print(te.autocast is te_flax.autocast)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
    env.pop("TE_FLAX_AS_TRANSFORMER_ENGINE")
    done = subprocess.run(
        [sys.executable, "-m", "te_flax", "run", str(script), "--flag", "1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert done.stdout.strip() == "TransformerEngineModule te_flax.linen.modules ['--flag', '1']"
    bad = {**env, "TE_FLAX_AS_TRANSFORMER_ENGINE": "yes"}
    done = subprocess.run(
        [sys.executable, "-c", "import te_flax"], env=bad, capture_output=True, text=True
    )
    assert done.returncode != 0 and "set it to 1" in done.stderr


def test_run_command_in_process(tmp_path, capsys, monkeypatch):
    if _te_paths.importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here: the switch refuses to hide it")
    assert main(["run"]) == 2 and "name a module" in capsys.readouterr().err
    (tmp_path / "te_run_probe.py").write_text(
        "import sys\nimport transformer_engine.jax as te\n"
        "print(te.autocast.__module__, sys.argv[1:])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        assert main(["run", "-m", "te_run_probe", "--steps", "2"]) == 0
    finally:
        te_flax.as_transformer_engine(False)
    assert capsys.readouterr().out.strip() == "te_flax.quantize.autocast ['--steps', '2']"


if __name__ == "__main__":
    Path(TABLE).write_text(table_text(), encoding="utf-8")
