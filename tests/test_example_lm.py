"""The example language model: it trains, resumes exactly, restores onto a mesh, and its
configuration refuses bad keys and values."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from examples.lm.__main__ import main as lm_main
from examples.lm.config import DEFAULT_CONFIG, ConfigError, load_config
from examples.lm.data import load_corpus
from examples.lm.report import loss_ratios
from examples.lm.train import (
    ResumeError,
    RunResult,
    _linen_frontend,
    _nnx_frontend,
    eval_interval,
    train,
)
from te_flax.sharding import load_axis_rules
from tests.helpers import TINY_LM, relative_error, xla_flags

ROOT = Path(__file__).resolve().parent.parent
TINY = TINY_LM


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


# The training runs' length: at least ten evaluations (eval_interval), 20% off the eval loss.
STEPS = 20


def _config(tmp_path, *overrides):
    return load_config(DEFAULT_CONFIG, [*TINY, f"output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("frontend", ["linen", "nnx"])
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "nvfp4", "none"])
def test_training_reduces_the_loss(tmp_path, corpus, frontend, recipe):
    config = _config(
        tmp_path,
        f"model.frontend={frontend}",
        f"train.recipe={recipe}",
        f"train.steps={STEPS}",
        f"train.eval_every={STEPS}",
        "checkpoint_every=0",
    )
    result = train(config, "run", corpus=corpus, progress=False)
    # eval_every is capped at a tenth of the run: at least ten evaluations after the first.
    assert result.eval_steps == list(range(0, STEPS + 1, STEPS // 10))
    assert result.eval_loss[-1] < 0.8 * result.eval_loss[0]
    assert np.isfinite(result.train_loss).all()
    fp8 = result.variables.get("_overwrite_with_gradient")
    if recipe == "delayed":
        # Per-layer FP8 state of the scanned blocks, updated by the steps.
        blocks = fp8["blocks"]
        qkv = blocks["attention"]["qkv"] if frontend == "linen" else blocks["qkv"]
        history = qkv["x_amax_history"]
        assert history.shape == (2, 4) and (history[:, 0] > 0).all()
    else:
        assert fp8 is None


def test_unrolled_blocks_train_each_with_its_own_variables(tmp_path, corpus):
    """``model.scan=false``: one block per layer, named ``blocks_0``, ``blocks_1``, each with
    its own parameters and FP8 state (what the kernel path in interpret mode needs)."""
    config = _config(tmp_path, "model.scan=false", "train.steps=4", "checkpoint_every=0")
    result = train(config, "run", corpus=corpus, progress=False)
    assert result.train_loss[-1] < result.train_loss[0]
    params, fp8 = result.variables["params"], result.variables["_overwrite_with_gradient"]
    assert {"blocks_0", "blocks_1"} <= set(params) and "blocks" not in params
    assert params["blocks_0"]["attention"]["qkv"]["kernel"].shape == (32, 3, 2, 16)
    histories = [fp8[f"blocks_{i}"]["attention"]["qkv"]["x_amax_history"] for i in (0, 1)]
    assert all(h.shape == (4,) and h[0] > 0 for h in histories)
    assert histories[0][0] != histories[1][0]


@pytest.mark.parametrize("frontend", ["linen", "nnx"])
def test_te_transformer_layer_blocks_train_in_fp8(tmp_path, corpus, frontend):
    config = _config(
        tmp_path,
        f"model.frontend={frontend}",
        "model.block=te",
        "train.recipe=delayed",
        f"train.steps={STEPS}",
        "checkpoint_every=0",
    )
    result = train(config, "run", corpus=corpus, progress=False)
    assert result.eval_loss[-1] < 0.8 * result.eval_loss[0]
    assert np.isfinite(result.train_loss).all()
    # TE's parameter tree, one slice per scanned layer: a fused [embed, 3, heads * head_dim]
    # QKV kernel, no relative position table (the model's learned positions instead).
    blocks = result.variables["params"]["blocks"]
    assert set(blocks) == {"attention", "mlp"}
    assert blocks["attention"]["qkv"]["kernel"].shape == (2, 32, 3, 32)
    assert blocks["mlp"]["wi_kernel"].shape == (2, 32, 1, 64)
    fp8 = result.variables["_overwrite_with_gradient"]["blocks"]
    for history in (fp8["attention"]["qkv"]["x_amax_history"], fp8["mlp"]["grad_1_amax_history"]):
        assert history.shape == (2, 4) and (history[:, 0] > 0).all()


@pytest.mark.parametrize("frontend", ["linen", "nnx"])
def test_te_transformer_layer_blocks_follow_the_shipped_rules(tmp_path, frontend):
    config = _config(tmp_path, f"model.frontend={frontend}", "model.block=te")
    make_frontend = _nnx_frontend if frontend == "nnx" else _linen_frontend
    with nn.logical_axis_rules(load_axis_rules("dp_fsdp_tp")):
        specs = make_frontend(config).partition_specs()["params"]["blocks"]
    # [layers, embed, qkv, heads], [layers, heads, embed], [layers, embed, act, mlp]
    assert tuple(specs["attention"]["qkv"]["kernel"]) == (None, "fsdp", None, "tensor")
    assert tuple(specs["attention"]["out"]["kernel"]) == (None, "tensor", "fsdp")
    assert tuple(specs["mlp"]["wi_kernel"]) == (None, "fsdp", None, "tensor")


def _run_cli(*arguments, devices=1):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = xla_flags(devices)
    completed = subprocess.run(
        [sys.executable, "-m", "examples.lm", "train", "--no-progress", *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]


def _final_checkpoint(directory: Path, step: int):
    with ocp.CheckpointManager(directory.resolve()) as manager:
        assert manager.latest_step() == step
        return manager.restore(step, args=ocp.args.StandardRestore())


# The one-device run that the resume tests continue: 4 steps, checkpointed at steps 2 and 4.
RESUMED = ["train.steps=4", "checkpoint_every=2", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory, corpus):
    """``one_device_run(frontend)``: that run's result and checkpoint directory, trained once per
    front end for the module. Tests copy its checkpoints and leave the directory as it is."""
    runs = {}

    def run(frontend):
        if frontend not in runs:
            output = tmp_path_factory.mktemp(f"one_device_{frontend}")
            config = _config(output, *RESUMED, f"model.frontend={frontend}")
            result = train(config, "run", corpus=corpus, progress=False)
            runs[frontend] = result, output / "run" / "checkpoints"
        return runs[frontend]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["linen", "nnx"])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path, one_device_run, frontend):
    # The uninterrupted run, checkpointed at steps 2 and 4, and one resumed from a copy of its
    # step-2 checkpoint alone in a new process (from the command line), which has nothing of
    # the first run but that checkpoint. The new process sees the eight devices of this one:
    # the same XLA flags, so its programs come from the compilation cache.
    _, whole_dir = one_device_run(frontend)
    split_dir = tmp_path / "train" / "checkpoints"
    assert sorted(path.name for path in whole_dir.iterdir()) == ["2", "4"]
    shutil.copytree(whole_dir / "2", split_dir / "2")
    common = [*TINY, *RESUMED, f"model.frontend={frontend}", f"output_dir={tmp_path}"]
    _run_cli(*common, "--resume", devices=jax.device_count())
    whole = _final_checkpoint(whole_dir, 4)
    split = _final_checkpoint(split_dir, 4)
    assert int(split["step"]) == 4 and int(split["data_position"]) == 4
    # Parameters, FP8 state and optimizer state, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, split, whole)


@pytest.mark.parametrize("frontend", ["linen", "nnx"])
def test_one_device_checkpoint_restores_sharded_onto_eight_devices(
    tmp_path, corpus, one_device_run, frontend
):
    assert jax.device_count() == 8
    fsdp8 = ["rules=fsdp", "mesh.fsdp=8"]
    # The one-device run, checkpointed at steps 2 and 4; its step-2 checkpoint alone is resumed.
    single, single_dir = one_device_run(frontend)
    checkpoints = Path("run", "checkpoints", "2")
    shutil.copytree(single_dir / "2", tmp_path / checkpoints)
    config = _config(tmp_path, *RESUMED, f"model.frontend={frontend}", *fsdp8)
    resumed = train(config, "run", resume=True, corpus=corpus, progress=False)
    assert single.steps == [1, 2, 3, 4] and resumed.steps == [3, 4]
    # Restored sharded as the fsdp rules say: the MLP kernels' embed axis over 8 devices.
    specs = resumed.partition_specs["params"]["blocks"]["mlp"]
    # ([layers, embed, act, mlp] and [layers, mlp, embed]; JAX drops trailing Nones.)
    assert tuple(specs["wi_kernel"]) == (None, "fsdp")
    assert tuple(specs["wo_kernel"]) == (None, None, "fsdp")
    # The same steps on 8 devices (the batch split across them) as on one, up to summation order.
    # Normwise per parameter: bf16 activations summed in another order, and Adam's normalized
    # first steps turn tiny gradient differences into full-size update differences (the
    # position embeddings, with the smallest gradients, differ most: about 2%).
    errors = jax.tree.map(relative_error, resumed.variables["params"], single.variables["params"])
    assert max(jax.tree.leaves(errors)) < 5e-2, errors


def test_resume_with_another_seed_is_refused(tmp_path, corpus):
    # The BF16 run of test_compare_mode_writes_the_report: its step comes from the compilation
    # cache when that test has run.
    base = ["train.steps=4", "checkpoint_every=2", "train.recipe=none"]
    train(_config(tmp_path, *base), "run", corpus=corpus, progress=False)
    with pytest.raises(ValueError, match="another seed"):
        train(
            _config(tmp_path, *base, "train.seed=1", "train.steps=5"),
            "run",
            resume=True,
            corpus=corpus,
            progress=False,
        )


def test_checkpoints_belong_to_one_run_and_every_resume_says_what_it_does(tmp_path, corpus, capsys):
    # A 3-step run stopped after step 2 (train.stop_at), then resumed: every run on one schedule,
    # so one compiled step.
    base = ["train.steps=3", "train.stop_at=2", "checkpoint_every=2", "train.recipe=none"]
    base += ["model.layers=1"]
    checkpoints = tmp_path / "run" / "checkpoints"
    quiet = {"corpus": corpus, "progress": False}
    train(_config(tmp_path, *base), "run", **quiet)
    assert f"run: checkpoints of steps 2 in {checkpoints}" in capsys.readouterr().out
    # A fresh run again: the earlier run's checkpoints move aside (orbax would skip the steps
    # that exist, and a later --resume would continue the wrong run).
    train(_config(tmp_path, *base, "train.seed=1"), "run", **quiet)
    out = capsys.readouterr().out
    assert "run: a fresh run; the earlier run's checkpoints (steps 2) moved to" in out
    assert (tmp_path / "run" / "checkpoints.previous" / "2").is_dir()
    resumed = train(_config(tmp_path, *base, "train.seed=1", "train.stop_at=null"), "run",
                    resume=True, **quiet)  # fmt: skip
    assert resumed.steps == [3]
    assert f"run: resuming from step 2 of {checkpoints}" in capsys.readouterr().out
    # A run with nothing of its own to resume names the runs that have checkpoints.
    train(_config(tmp_path, *base), "other", resume=True, **quiet)
    out = capsys.readouterr().out
    assert "other: nothing to resume in" in out and "checkpoints of other runs there: run" in out
    # Another front end's checkpoint: the parameter trees differ, not the FP8 state.
    with pytest.raises(ResumeError, match=r"model\.frontend=nnx") as raised:
        train(_config(tmp_path, *base, "train.seed=1", "train.stop_at=null", "model.frontend=nnx"),
              "run", resume=True, **quiet)  # fmt: skip
    assert "resume_migrate_fp8" not in str(raised.value)


def test_compare_mode_writes_the_report(tmp_path, corpus, monkeypatch):
    from examples.lm import __main__ as cli

    monkeypatch.setattr(cli, "load_corpus", lambda path=None: corpus)
    assert (
        cli.main(
            [
                "compare",
                "--no-progress",
                *TINY,
                "train.steps=4",
                "train.eval_every=2",
                "train.fp8_stats_every=2",
                "checkpoint_every=0",
                f"output_dir={tmp_path}",
            ]
        )
        == 0
    )
    report = (tmp_path / "report.md").read_text()
    assert "| fp8 |" in report and "| bf16 |" in report and "relative to bf16" in report
    # The ratio at every evaluation: a 4-step run evaluates after every step.
    assert "Eval loss ratio fp8 / bf16 at each evaluation (step: ratio): 0: " in report
    assert ", 4: " in report and "Farthest from 1: " in report
    # The first-step latency (trace + compile + first step) of each run, in seconds.
    header = next(line for line in report.splitlines() if line.startswith("| run |"))
    column = header.split(" | ").index("first step (s)")
    for run in ("fp8", "bf16"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {run} |"))
        assert float(row.split(" | ")[column]) > 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    # FP8 health: the fp8 run measured steps 2 and 4 inside te_flax.inspect_fp8().
    assert "![FP8 health: saturation and underflow per layer](fp8_health.png)" in report
    assert "FP8 health of the fp8 run: every 2 steps" in report and "(2 measurements;" in report
    assert "At step 4: largest saturation " in report
    assert (tmp_path / "fp8_health.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("steps", "eval_every", "expected"), [(300, 50, 30), (300, 20, 20), (8, 4, 1)]
)
def test_evaluations_come_at_least_every_tenth_of_the_run(steps, eval_every, expected):
    config = load_config(DEFAULT_CONFIG, [f"train.steps={steps}", f"train.eval_every={eval_every}"])
    assert eval_interval(config) == expected


def test_loss_ratios_divide_step_by_step_over_the_common_steps():
    def run(name, steps, train_loss, eval_steps, eval_loss):
        return RunResult(name, steps, train_loss, eval_steps, eval_loss, 0.0, 0.0, 0, None)

    fp8 = run("fp8", [3, 4, 5], [2.0, 3.0, 4.0], [0, 5], [6.0, 2.2])
    bf16 = run("bf16", [1, 2, 3, 4, 5], [9.0, 9.0, 1.0, 2.0, 4.0], [0, 3, 5], [6.0, 3.0, 2.0])
    ratios = loss_ratios(fp8, bf16)
    assert ratios.steps == [3, 4, 5] and ratios.train == [2.0, 1.5, 1.0]
    assert ratios.eval_steps == [0, 5]
    np.testing.assert_allclose(ratios.eval, [1.0, 1.1])


def test_user_text_file_is_used(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(b"hello world, " * 2000)
    corpus = load_corpus(str(text))
    tokens, targets = corpus.batch("train", 0, 0, 2, 8)
    assert bytes(np.asarray(tokens[0]).astype(np.uint8)) in (b"hello world, " * 3)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    with pytest.raises(ValueError, match="at least 10 kB"):
        text.write_bytes(b"short")
        load_corpus(str(text))


def test_fp8_attention_trains_and_updates_the_attention_state(tmp_path, corpus):
    config = _config(
        tmp_path,
        "train.fp8_attention=true",
        "train.steps=12",
        "train.eval_every=12",
        "checkpoint_every=0",
    )
    result = train(config, "run", corpus=corpus, progress=False)
    assert result.eval_loss[-1] < result.eval_loss[0]
    core = result.variables["_overwrite_with_gradient"]["blocks"]["attention"]["core"]
    # q.k and p.v each carry one GEMM's state; the probabilities' amax (x of p.v) is in (0, 1].
    assert {"x_qk_amax_history", "grad_pv_scale_inv"} <= set(core)
    probabilities = np.asarray(core["x_pv_amax_history"])  # [layers, history]
    assert (probabilities[:, 0] > 0).all() and (probabilities <= 1).all()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["train.stepz=3"], "train.stepz is not a configuration key .did you mean 'steps'"),
        (["train.steps=many"], "train.steps: Value 'many'"),
        (["model.activation=swish"], "model.activation"),
        (["train.recipe=fp4"], "train.recipe"),
        (["model.block=transformer"], "model.block"),
        (["model.block=te", "model.head_dim=16"], "model.d_model = model.heads"),
        (["train.steps=0"], "train.steps"),
        (["train.fp8_attention=true", "train.recipe=mxfp8"], "train.fp8_attention"),
        (["train.fp8_attention=true", "model.frontend=nnx"], "train.fp8_attention"),
        (["train.fp8_stats_every=-1"], "train.fp8_stats_every"),
        (["model.scan=false", "model.frontend=nnx"], "model.scan=false"),
        (["steps"], "key=value"),
    ],
)
def test_bad_config_names_the_key_in_one_line(overrides, key, capsys):
    with pytest.raises(ConfigError, match=key) as raised:
        load_config(DEFAULT_CONFIG, overrides)
    assert "\n" not in str(raised.value)
    # From the command line: that line, after the usage, and exit status 2; no traceback.
    with pytest.raises(SystemExit) as exited:
        lm_main(["train", *overrides])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].endswith(str(raised.value))
