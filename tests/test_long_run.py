"""A long FP8 run: 2,000 delayed-scaling steps of the example model stay finite, keep their amax
histories bounded, and end where the same run in BF16 ends.

The FP8 run is checkpointed at step 1,000 and resumed, so the FP8 state of both halves can be
compared (a resumed run is bit-identical to an uninterrupted one, tests/test_example_lm.py).
It takes about half a minute on two CPU cores, so it is marked slow (CI runs it); run it alone
with ``python -m pytest -q -p no:xdist -s tests/test_long_run.py`` (``-s`` prints the final
losses and their ratio).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from examples.lm.config import DEFAULT_CONFIG, load_config
from examples.lm.data import load_corpus
from examples.lm.train import RunResult, train
from te_flax.training import OVERWRITE_WITH_GRADIENT
from tests.helpers import TINY_LM_MODEL

STEPS = 2000
SMALL = [
    *TINY_LM_MODEL,
    # 32 tokens a step: the horizon, not the batch, is what is tested. An FP8 step takes 7 ms on
    # two CPU cores (9 ms at 64 tokens), and XLA:CPU's FP8 conversions grow with the batch.
    "train.batch=2",
    "train.seq_len=16",
    "train.learning_rate=1e-2",
    "train.warmup_steps=20",
    "train.eval_every=200",
    "train.eval_batches=32",  # 1,024 tokens an evaluation
    "train.amax_history_len=16",
    f"train.steps={STEPS}",
    # No FP8-health steps: they train as the other steps do (the same losses, bit for bit), but
    # are a second program to compile in each half and a slower step every 20.
    "train.fp8_stats_every=0",
]
# Activations after a norm, weights and gradients of this model have amaxes of a few units
# (about 3 at most over the run); a scale drifting away would show as orders of magnitude.
AMAX_BOUND = 100.0
# Over the second half, no history's maximum may grow by more than this factor. Gradient
# amaxes vary from one 16-step window to another (batch noise: the largest growth here is
# 2.8x); a drifting scale or a diverging run grows by orders of magnitude.
SECOND_HALF_GROWTH = 4.0
LOSS_TOLERANCE = 0.02  # FP8's final eval loss within 2% of BF16's


def _histories(result: RunResult) -> dict[str, np.ndarray]:
    """Each GEMM operand's amax history ([layers, L]) by its variable path."""
    leaves = jax.tree_util.tree_leaves_with_path(result.variables[OVERWRITE_WITH_GRADIENT])
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in leaves
        if jax.tree_util.keystr(path).endswith("_amax_history']")
    }


@pytest.mark.slow
def test_two_thousand_fp8_steps_stay_bounded_and_track_bf16(tmp_path):
    corpus = load_corpus()
    config = load_config(
        DEFAULT_CONFIG, [*SMALL, "checkpoint_every=1000", f"output_dir={tmp_path}"]
    )
    first = train(
        dataclasses.replace(config, train=dataclasses.replace(config.train, stop_at=STEPS // 2)),
        "fp8",
        corpus=corpus,
        progress=False,
    )
    second = train(config, "fp8", resume=True, corpus=corpus, progress=False)
    bf16_config = dataclasses.replace(
        config, checkpoint_every=0, train=dataclasses.replace(config.train, recipe="none")
    )
    bf16 = train(bf16_config, "bf16", corpus=corpus, progress=False)

    assert second.steps == list(range(STEPS // 2 + 1, STEPS + 1))
    for result in (first, second, bf16):
        assert np.isfinite(result.train_loss).all() and np.isfinite(result.eval_loss).all()
    fp8_state = jax.tree.leaves(second.variables[OVERWRITE_WITH_GRADIENT])
    assert all(np.isfinite(leaf).all() for leaf in fp8_state)

    middle, end = _histories(first), _histories(second)
    assert len(end) == 12  # {x, kernel, grad} of the 4 GEMMs of the (scanned) blocks
    for name, history in end.items():
        assert (history[:, 0] > 0).all(), f"{name} recorded no amax in the last step"
        assert history.max() < AMAX_BOUND, f"{name}: amax {history.max()}"
        assert history.max() <= SECOND_HALF_GROWTH * middle[name].max(), (
            f"{name} grew over the second half: {middle[name].max()} -> {history.max()}"
        )

    # Both runs learned, and FP8 ends where BF16 ends.
    assert second.eval_loss[-1] < 0.5 * first.eval_loss[0]
    ratio = second.eval_loss[-1] / bf16.eval_loss[-1]
    print(f"final eval loss: fp8 {second.eval_loss[-1]:.4f}, bf16 {bf16.eval_loss[-1]:.4f}")
    print(f"ratio {ratio:.4f}; largest amax {max(h.max() for h in end.values()):.3g}")
    assert abs(ratio - 1) < LOSS_TOLERANCE, (second.eval_loss[-1], bf16.eval_loss[-1], ratio)
