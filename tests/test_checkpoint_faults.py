"""Checkpoints that do not fit, and runs killed while checkpointing.

``te_flax.convert.migrate_fp8_state`` refuses a checkpoint whose FP8 state differs from the
model's (another ``amax_history_len``, no FP8 state, state the recipe does not keep) with an
error naming the difference, and migrates it only when asked. The example trainer checks a
checkpoint's tree metadata on resume and does the same (``resume_migrate_fp8``).

A run SIGKILLed during a save or between saves (the trainer's ``EXAMPLES_LM_KILL`` hook, in a
subprocess) resumes from the last complete checkpoint, bit for bit like an uninterrupted run;
the unfinished save is ignored and then deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import te_flax.linen as te_nn
from examples.lm.config import DEFAULT_CONFIG, load_config
from examples.lm.data import load_corpus
from examples.lm.train import KILL_HOOK, train
from te_flax.convert import RecomputedFp8ScalesWarning, migrate_fp8_state
from te_flax.quantize import DelayedScaling, Float8CurrentScaling
from te_flax.training import OVERWRITE_WITH_GRADIENT
from tests.helpers import F32, TINY_LM

ROOT = Path(__file__).resolve().parent.parent
FP8 = OVERWRITE_WITH_GRADIENT
TINY = TINY_LM
# Every run's schedule: the killed runs train all of it; the resumed ones stop after step 3.
# One schedule makes one set of programs, so the runs in subprocesses load them from the
# compilation cache that the runs in this process filled, and the other way round.
STEPS = ["train.steps=8", "checkpoint_every=2"]


def _layer_variables(recipe, features=8):
    layer = te_nn.DenseGeneral(features=features, recipe=recipe)
    x = jnp.ones((2, 16), F32)
    return layer, x, nn.meta.unbox(layer.init(jax.random.key(0), x))


def _scanned(history_len: int, layers: int = 2) -> dict:
    """A scanned model's variables: each FP8 leaf has a leading layer axis."""
    return {
        "params": {"kernel": jnp.ones((layers, 4, 4), F32)},
        FP8: {
            "block": {
                "x_amax_history": jnp.zeros((layers, history_len), F32),
                "x_scale_inv": jnp.ones((layers, 1), F32),
            }
        },
    }


# ----------------------------------------------------------------------------- migrate_fp8_state


def test_a_fitting_checkpoint_comes_back_unchanged():
    recipe = DelayedScaling(amax_history_len=4)
    _, _, variables = _layer_variables(recipe)
    fitted = migrate_fp8_state(variables, variables, recipe=recipe)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), fitted, dict(variables))
    assert jax.tree.structure(fitted) == jax.tree.structure(dict(variables))


def test_another_history_length_is_named_and_refused():
    saved, target = _scanned(16), _scanned(1024)
    with pytest.raises(ValueError) as error:
        migrate_fp8_state(saved, target, recipe=DelayedScaling())
    message = str(error.value)
    assert "block/x_amax_history has length 16 in the checkpoint" in message
    assert "amax_history_len=1024" in message
    assert "te_flax.convert.migrate_fp8_state(..., resize_history=True)" in message


@pytest.mark.parametrize(("saved_len", "target_len"), [(6, 4), (3, 5)])
def test_resized_histories_keep_the_newest_entries(saved_len, target_len):
    saved, target = _scanned(saved_len), _scanned(target_len)
    # Newest entry first (index 0), per scanned layer: [[1, 2, ...], [10, 20, ...]].
    history = jnp.arange(1, saved_len + 1, dtype=F32)
    saved[FP8]["block"]["x_amax_history"] = jnp.stack([history, 10 * history])
    saved[FP8]["block"]["x_scale_inv"] = jnp.array([[0.5], [0.25]], F32)
    recipe = DelayedScaling(amax_history_len=target_len)
    with pytest.warns(RecomputedFp8ScalesWarning, match="1 of 1 changed"):
        fitted = migrate_fp8_state(saved, target, recipe=recipe, resize_history=True)
    fitted = fitted[FP8]["block"]
    kept = min(saved_len, target_len)
    expected = np.zeros((2, target_len), np.float32)
    expected[0, :kept] = np.arange(1, kept + 1)
    expected[1, :kept] = 10 * np.arange(1, kept + 1)
    np.testing.assert_array_equal(fitted["x_amax_history"], expected)
    # Each scale is the recipe's of the kept window: its largest amax over e4m3's 448.
    largest = np.array([[kept], [10 * kept]], np.float32)
    np.testing.assert_array_equal(fitted["x_scale_inv"], largest * np.float32(1 / 448))


def test_a_bf16_checkpoint_into_an_fp8_model_is_refused_or_initialised_fresh():
    recipe = DelayedScaling(amax_history_len=4)
    layer, x, fp8_variables = _layer_variables(recipe)
    _, _, bf16_variables = _layer_variables(None)
    with pytest.raises(ValueError, match=r"keeps 6 FP8 variables the checkpoint lacks") as error:
        migrate_fp8_state(bf16_variables, fp8_variables, recipe=recipe)
    assert "init_missing=True" in str(error.value)
    fitted = migrate_fp8_state(bf16_variables, fp8_variables, recipe=recipe, init_missing=True)
    # The parameters are the checkpoint's; the FP8 state is what a fresh init gives.
    np.testing.assert_array_equal(fitted["params"]["kernel"], bf16_variables["params"]["kernel"])
    jax.tree.map(np.testing.assert_array_equal, fitted[FP8], dict(fp8_variables[FP8]))
    y = layer.apply(fitted, x)
    assert bool(jnp.isfinite(y).all())


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["bf16", "current"])
def test_delayed_scaling_state_into_a_model_that_keeps_none_is_refused_or_dropped(recipe):
    _, _, delayed = _layer_variables(DelayedScaling(amax_history_len=4))
    layer, x, target = _layer_variables(recipe)
    assert FP8 not in target
    with pytest.raises(ValueError, match=r"holds 6 FP8 variables the model does not keep") as error:
        migrate_fp8_state(delayed, target)
    assert "drop_extra=True" in str(error.value)
    fitted = migrate_fp8_state(delayed, target, drop_extra=True)
    assert set(fitted) == {"params"}
    assert bool(jnp.isfinite(layer.apply(fitted, x)).all())


def test_each_migration_happens_only_when_asked():
    saved = _scanned(4)
    saved[FP8]["block"]["extra_scale_inv"] = jnp.ones((2, 1), F32)
    target = _scanned(8)
    target[FP8]["other"] = {"x_scale_inv": jnp.ones((2, 1), F32)}
    everything = dict(resize_history=True, init_missing=True, drop_extra=True)
    everything["recipe"] = DelayedScaling(amax_history_len=8)
    for left_out in ("resize_history", "init_missing", "drop_extra"):
        with pytest.raises(ValueError, match=f"{left_out}=True"):
            migrate_fp8_state(saved, target, **{**everything, left_out: False})
    fitted = migrate_fp8_state(saved, target, **everything)[FP8]
    assert set(fitted["block"]) == {"x_amax_history", "x_scale_inv"}
    assert fitted["block"]["x_amax_history"].shape == (2, 8)
    np.testing.assert_array_equal(fitted["other"]["x_scale_inv"], np.ones((2, 1)))


def test_what_no_migration_resolves_is_refused_even_with_every_option():
    everything = dict(resize_history=True, init_missing=True, drop_extra=True)
    with pytest.raises(ValueError, match=r"params/kernel has shape \(3, 4, 4\) in the checkpoint"):
        migrate_fp8_state(_scanned(4, layers=3), _scanned(4, layers=2), **everything)
    saved = _scanned(4, layers=3)
    saved["params"] = _scanned(4, layers=2)["params"]
    with pytest.raises(ValueError, match="another number of scanned layers"):
        migrate_fp8_state(saved, _scanned(4, layers=2), **everything)
    with pytest.raises(TypeError, match="variables must be a mapping of collections"):
        migrate_fp8_state([saved], _scanned(4))


def test_abstract_trees_are_checked_without_arrays():
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _scanned(16))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _scanned(4))
    with pytest.raises(ValueError, match="has length 16"):
        jax.eval_shape(lambda v: migrate_fp8_state(v, target), abstract)
    recipe = DelayedScaling(amax_history_len=4)
    fitted = jax.eval_shape(
        lambda v: migrate_fp8_state(v, target, recipe=recipe, resize_history=True), abstract
    )
    assert fitted[FP8]["block"]["x_amax_history"].shape == (2, 4)


# ------------------------------------------------------------------- the example trainer's resume


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, corpus):
    """A two-step run of a recipe, checkpointed at step 2 (made once, when first asked for)."""
    root = tmp_path_factory.mktemp("saved")

    def run_directory(recipe: str) -> Path:
        if not (root / recipe).exists():
            config = _config(root / recipe, f"train.recipe={recipe}", "train.stop_at=2")
            train(config, "run", corpus=corpus, progress=False)
        return root / recipe

    return run_directory


def _config(output_dir, *overrides):
    base = [*TINY, *STEPS, "train.stop_at=3", f"output_dir={output_dir}"]
    return load_config(DEFAULT_CONFIG, [*base, *overrides])


CHANGED_RECIPES = [
    ("delayed", ["train.amax_history_len=8"], "has length 4 in the checkpoint"),
    ("delayed", ["train.recipe=current"], "holds 24 FP8 variables the model does not keep"),
    # Slow only for the BF16 run it trains first.
    pytest.param(
        "none",
        ["train.recipe=delayed"],
        "keeps 24 FP8 variables the checkpoint lacks",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("saved", "overrides", "error"), CHANGED_RECIPES)
def test_resume_with_another_fp8_state_is_refused(
    tmp_path, saved_run, corpus, saved, overrides, error
):
    shutil.copytree(saved_run(saved), tmp_path, dirs_exist_ok=True)
    with pytest.raises(ValueError, match=error) as raised:
        train(_config(tmp_path, *overrides), "run", resume=True, corpus=corpus, progress=False)
    assert "cannot resume from step 2" in str(raised.value)
    assert "resume_migrate_fp8=true" in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "overrides", "error"), CHANGED_RECIPES)
def test_resume_migrates_fp8_state_when_asked(tmp_path, saved_run, corpus, saved, overrides, error):
    del error
    shutil.copytree(saved_run(saved), tmp_path, dirs_exist_ok=True)
    config = _config(tmp_path, *overrides, "resume_migrate_fp8=true")
    result = train(config, "run", resume=True, corpus=corpus, progress=False)
    assert result.steps == [3] and np.isfinite(result.train_loss).all()
    fp8 = result.variables.get(FP8)
    if config.train.recipe != "delayed":
        assert fp8 is None
        return
    history = fp8["blocks"]["attention"]["qkv"]["x_amax_history"]  # [layers, L], newest first
    assert history.shape == (2, config.train.amax_history_len)
    if saved == "delayed":  # step 3's amax, then the checkpoint's newest two, then empty slots
        with ocp.CheckpointManager((tmp_path / "run" / "checkpoints").resolve()) as manager:
            old = manager.restore(2, args=ocp.args.StandardRestore())["variables"][FP8]
        old_history = old["blocks"]["attention"]["qkv"]["x_amax_history"]
        np.testing.assert_array_equal(history[:, 1:3], old_history[:, :2])
        np.testing.assert_array_equal(history[:, 3:], 0)
    else:  # fresh state, then one step: one amax recorded
        assert (history[:, 0] > 0).all() and (history[:, 1:] == 0).all()


# ------------------------------------------------------------- runs killed while checkpointing

# Runs one configuration of the example trainer and writes what it measured to a JSON file.
DRIVER = """
import json, sys
from examples.lm.config import DEFAULT_CONFIG, load_config
from examples.lm.train import train
config = load_config(DEFAULT_CONFIG, sys.argv[3:])
result = train(config, "train", resume=sys.argv[1] == "resume", progress=False)
fields = ("steps", "train_loss", "eval_steps", "eval_loss")
json.dump({field: getattr(result, field) for field in fields}, open(sys.argv[2], "w"))
"""


def _run(
    output_dir: Path, *, resume: bool = False, kill: str | None = None
) -> subprocess.CompletedProcess:
    # This process's XLA flags, its eight devices included (the run uses one): under another
    # device count the same programs have other compilation-cache keys and compile again.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop(KILL_HOOK, None)
    if kill is not None:
        env[KILL_HOOK] = kill
    measured = output_dir / ("resumed.json" if resume else "run.json")
    command = [sys.executable, "-c", DRIVER, "resume" if resume else "new", str(measured)]
    command += [*TINY, *STEPS, f"output_dir={output_dir}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _checkpoints(output_dir: Path) -> Path:
    return output_dir / "train" / "checkpoints"


def _restore_step(output_dir: Path, step: int):
    with ocp.CheckpointManager(_checkpoints(output_dir).resolve()) as manager:
        return manager.restore(step, args=ocp.args.StandardRestore())


def _restore(output_dir: Path, step: int):
    """The latest checkpoint, which must be ``step``'s."""
    with ocp.CheckpointManager(_checkpoints(output_dir).resolve()) as manager:
        assert manager.latest_step() == step
    return _restore_step(output_dir, step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    completed = _run(output_dir)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir, json.loads((output_dir / "run.json").read_text())


def _assert_killed(output_dir: Path, killed, measured: str, complete: list[int], unfinished):
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (output_dir / measured).exists()
    # On disk: complete steps (the two newest kept), and the killed save's temporary directory.
    names = sorted(path.name for path in _checkpoints(output_dir).iterdir())
    assert names == sorted([str(step) for step in complete] + unfinished)
    for step in complete:
        assert (_checkpoints(output_dir) / str(step) / "commit_success.txt").exists()
    with ocp.CheckpointManager(_checkpoints(output_dir).resolve()) as manager:
        assert list(manager.all_steps()) == complete  # an unfinished save is not a step


@pytest.mark.slow
def test_a_killed_run_resumes_from_the_last_complete_checkpoint_bit_for_bit(
    tmp_path, uninterrupted
):
    # One run killed twice (each launch costs its start-up, not its steps): during a save, then,
    # resumed, between saves; resumed again, it ends as the uninterrupted run does.
    whole_dir, whole = uninterrupted
    _assert_killed(
        tmp_path, _run(tmp_path, kill="save:6"), "run.json", [2, 4], ["6.orbax-checkpoint-tmp"]
    )
    killed = _run(tmp_path, resume=True, kill="step:7")
    # The unfinished save was deleted and the run continued after step 4: step 6 saved again,
    # bit for bit as the uninterrupted run saved it.
    _assert_killed(tmp_path, killed, "resumed.json", [4, 6], [])
    jax.tree.map(np.testing.assert_array_equal, _restore(tmp_path, 6), _restore_step(whole_dir, 6))

    resumed = _run(tmp_path, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(path.name for path in _checkpoints(tmp_path).iterdir()) == ["6", "8"]
    measured = json.loads((tmp_path / "resumed.json").read_text())
    assert measured["steps"] == [7, 8]
    # The same losses, to the last bit (JSON keeps a float's shortest exact repr).
    assert measured["train_loss"] == whole["train_loss"][6:]
    assert measured["eval_loss"][-1] == whole["eval_loss"][-1]
    # Parameters, FP8 state, optimizer state, step and data position, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, _restore(tmp_path, 8), _restore(whole_dir, 8))
