"""Training the example GPT: optax AdamW, FP8 state updates, orbax checkpoints, eval.

One loop serves both front ends: each provides ``init`` (a Linen-style variable dict of plain
arrays: ``params`` and the FP8 collection) and ``apply(variables, tokens)``. The step is
te_flax's rule: ``te_flax.training.value_and_grad`` (the FP8 state marked for max-merging),
the optimizer for ``params``, overwrite for the FP8 state (``apply_gradients``).

Checkpoints are orbax's: a save is written into a temporary directory that is renamed to the
step's only once complete, so a run killed during a save resumes from the previous one (the
unfinished directory is deleted when the next run opens the checkpoints). A resumed run whose
recipe keeps other FP8 state than the checkpoint's is refused with the difference named, or
migrated when ``resume_migrate_fp8`` is set (``te_flax.convert.migrate_fp8_state``); delayed
scaling's scales are always recomputed from the saved amax histories under this run's recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

import te_flax
import te_flax.nnx as te_nnx
from te_flax.convert import migrate_fp8_state
from te_flax.quantize import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from te_flax.sharding import load_axis_rules, make_mesh
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    fp8_stats_slots,
    init_optimizer,
    value_and_grad,
)

from . import model_linen, model_nnx
from .config import Config
from .data import Corpus, load_corpus

__all__ = ["KILL_HOOK", "ResumeError", "RunResult", "train"]

# A test hook (tests/test_checkpoint_faults.py) that SIGKILLs the run at a chosen point:
# "step:N" after step N, once the saves started before are complete (a kill between saves);
# "save:N" inside step N's save, after orbax wrote every file and before it committed them by
# renaming the step's temporary directory (a kill during a save).
KILL_HOOK = "EXAMPLES_LM_KILL"


@dataclasses.dataclass
class RunResult:
    """What a run measured."""

    name: str
    steps: list[int]
    train_loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    step_time_s: float  # median wall time of a step after compilation
    tokens_per_s: float
    parameters: int
    variables: Any  # the final variables (params and FP8 state), on the host
    partition_specs: Any = None  # how the final variables were laid out on the mesh
    aux_loss: list[float] = dataclasses.field(default_factory=list)  # MoE, per step
    # Wall time of the run's first step: tracing, compiling and running train_step (0: resumed
    # past the end, no step ran).
    first_step_s: float = 0.0
    tokens_dropped: list[int] = dataclasses.field(default_factory=list)  # MoE, per step
    # FP8 health: (step, the step's FP8 statistics on the host) every train.fp8_stats_every
    # steps (te_flax.inspect_fp8()); the statistics steps are left out of the step time.
    fp8_stats: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    fp8_stats_step_s: float = 0.0  # median wall time of a statistics step after its compile


def make_recipe(config: Config):
    t = config.train
    if t.recipe == "delayed":
        return DelayedScaling(amax_history_len=t.amax_history_len, fp8_dpa=t.fp8_attention)
    if t.recipe == "current":
        return Float8CurrentScaling(fp8_dpa=t.fp8_attention)
    if t.recipe == "blockwise":
        return Float8BlockScaling()
    if t.recipe == "mxfp8":
        return MXFP8BlockScaling()
    if t.recipe == "nvfp4":
        return NVFP4BlockScaling(disable_stochastic_rounding=True)
    return None


@dataclasses.dataclass
class _Frontend:
    init: Any  # key -> variables
    apply: Any  # (variables, tokens) -> (logits, sown intermediates)
    partition_specs: Any  # () -> the variables' PartitionSpecs on the mesh, under the rules
    # variables -> zeros of the "fp8_stats" collection (te_flax.inspect_fp8()); None: the
    # front end collects none (NNX here: its variables pass through Linen variable dicts).
    stats_slots: Any = None


def _linen_frontend(config: Config) -> _Frontend:
    model = model_linen.GPT(config.model)
    tokens = jnp.zeros((1, config.train.seq_len), jnp.int32)

    def partition_specs():
        boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
        return nn.logical_to_mesh(nn.get_partition_spec(boxed))

    return _Frontend(
        init=lambda key: nn.meta.unbox(model.init(key, tokens)),
        apply=lambda variables, tokens: model.apply(variables, tokens, mutable=["intermediates"]),
        partition_specs=partition_specs,
        stats_slots=lambda variables: fp8_stats_slots(model.apply, variables, tokens),
    )


def _nnx_frontend(config: Config) -> _Frontend:
    def build(key):
        # A "dropout" stream too: the TransformerLayer's dropout layers take one at construction
        # (unused: the example trains without dropout).
        rngs = nnx.Rngs(params=key, dropout=key)
        return model_nnx.GPT(config.model, config.train.seq_len, rngs=rngs)

    abstract = jax.eval_shape(lambda: build(jax.random.key(0)))
    graphdef, state = nnx.split(abstract)

    def apply(variables, tokens):
        model = nnx.merge(graphdef, state, copy=True)
        te_nnx.load_linen_variables(model, variables)
        return model(tokens), {}

    def partition_specs():
        # Each variable's logical names (its sharding metadata) resolved by the active rules,
        # in the layout of te_flax.nnx.linen_variables.
        rules = nn.get_logical_axis_rules()

        def spec(variable):
            names = variable.get_metadata().get("out_sharding")
            return nn.logical_to_mesh_axes(names, rules) if names else PartitionSpec()

        def specs(variable_type):
            state = nnx.state(abstract, variable_type)
            is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
            return nnx.to_pure_dict(jax.tree.map(spec, state, is_leaf=is_variable))

        fp8 = specs(te_nnx.Fp8Meta)
        return {"params": specs(nnx.Param), **({OVERWRITE_WITH_GRADIENT: fp8} if fp8 else {})}

    return _Frontend(
        init=lambda key: te_nnx.linen_variables(build(key)),
        apply=apply,
        partition_specs=partition_specs,
    )


def eval_interval(config: Config) -> int:
    """Steps between evaluations: ``train.eval_every``, and at most a tenth of the run, so that a
    comparison shows at least ten points of each run's eval loss."""
    t = config.train
    return max(1, min(t.eval_every, t.steps // 10))


def make_optimizer(config: Config) -> optax.GradientTransformation:
    t = config.train
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, t.warmup_steps, max(t.steps, t.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(t.clip_norm),
        optax.adamw(schedule, weight_decay=t.weight_decay),
    )


def _sown(intermediates, name: str):
    """The sum of every sown value called ``name`` (each MoE layer's), 0 without any."""
    leaves = jax.tree_util.tree_flatten_with_path(intermediates)[0]
    values = [
        jnp.sum(v).astype(jnp.float32) for path, v in leaves if name in jax.tree_util.keystr(path)
    ]
    return sum(values, jnp.zeros((), jnp.float32))


def _loss(frontend, variables, tokens, targets):
    """The training loss (cross-entropy plus the MoE aux loss) and its parts."""
    logits, intermediates = frontend.apply(variables, tokens)
    logits = logits.astype(jnp.float32)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    aux_loss = _sown(intermediates, "aux_loss")
    dropped = _sown(intermediates, "tokens_dropped")
    return cross_entropy + aux_loss, (cross_entropy, aux_loss, dropped)


def _mesh(config: Config) -> jax.sharding.Mesh:
    shape = dataclasses.asdict(config.mesh)
    if shape["context"] == 1 and config.rules != "cp":
        del shape["context"]  # the (data, fsdp, tensor) mesh of the other rule sets
    n = int(np.prod(list(shape.values())))
    if n > jax.device_count():
        raise ValueError(f"mesh {shape} needs {n} devices but {jax.device_count()} are available")
    return make_mesh(shape, devices=jax.devices()[:n])


def _kill_point() -> tuple[str, int] | None:
    value = os.environ.get(KILL_HOOK)
    if not value:
        return None
    when, _, step = value.partition(":")
    if when not in ("step", "save") or not step.isdigit():
        raise ValueError(f"{KILL_HOOK}={value!r} must be step:N or save:N (N a step number)")
    return when, int(step)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def make_train_step(frontend, tx):
    """The training step, not jitted: ``(state, tokens, targets) -> (state, loss parts)``, with
    ``state = {"variables", "opt_state"}``."""

    def train_step(state, tokens, targets):
        def loss_fn(variables):
            return _loss(frontend, variables, tokens, targets)

        # te_flax's value_and_grad max-merges the FP8 state of the layers' reuses.
        (_, parts), grads = value_and_grad(loss_fn, has_aux=True)(state["variables"])
        variables, opt_state = apply_gradients(tx, state["variables"], grads, state["opt_state"])
        return {"variables": variables, "opt_state": opt_state}, parts

    return train_step


def make_stats_step(frontend, tx):
    """The training step that also measures FP8 statistics, not jitted, to run inside
    ``te_flax.inspect_fp8()``: ``(state, slots, tokens, targets) -> (state, loss parts,
    statistics)``. The statistics variables (``slots``) join the variables only inside the
    step: their gradient is the step's statistics, and the checkpointed variables stay as
    they are."""

    def stats_step(state, slots, tokens, targets):
        def loss_fn(variables):
            return _loss(frontend, variables, tokens, targets)

        variables = {**state["variables"], "fp8_stats": slots}
        (_, parts), grads = value_and_grad(loss_fn, has_aux=True)(variables)
        stats = grads.pop("fp8_stats")
        new_variables, opt_state = apply_gradients(
            tx, state["variables"], grads, state["opt_state"]
        )
        return {"variables": new_variables, "opt_state": opt_state}, parts, stats

    return stats_step


def _killed_before_commit(step: int) -> type:
    """orbax's temporary directory, made to kill the run before it commits ``step``'s save."""

    class KilledBeforeCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            if self.get_final().name == str(step):  # the step's directory, not an item's
                _kill_self()
            await super().finalize(*args, **kwargs)

    return KilledBeforeCommit


class ResumeError(ValueError):
    """A checkpoint this run cannot continue: one line that says what differs."""


def _saved_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _set_aside_earlier_run(directory: Path, name: str) -> None:
    """A fresh run starts a fresh checkpoint directory: an earlier run's checkpoints are moved
    to ``checkpoints.previous`` (replacing what was there), saying so, so that a later
    ``--resume`` continues this run and not that one."""
    steps = _saved_steps(directory)
    if not directory.exists():
        return
    previous = directory.with_name(directory.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    directory.rename(previous)
    if steps:
        print(
            f"{name}: a fresh run; the earlier run's checkpoints (steps "
            f"{', '.join(map(str, steps))}) moved to {previous} (pass --resume to continue a "
            "run instead)"
        )


def _nothing_to_resume(directory: Path, name: str) -> str:
    """What a ``--resume`` with no checkpoint of its run says: where it looked, and the runs
    that have checkpoints beside it."""
    others = sorted(
        p.parent.name
        for p in directory.parent.parent.glob("*/checkpoints")
        if p != directory and _saved_steps(p)
    )
    where = f"; checkpoints of other runs there: {', '.join(others)}" if others else ""
    hint = " (`compare --resume` continues the fp8 and bf16 runs)" if others else ""
    return f"{name}: nothing to resume in {directory}{where}{hint}; starting from step 0"


def _checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    kill = _kill_point()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2,
        create=True,
        # A save a killed run left unfinished (its temporary directory) is deleted on opening.
        cleanup_tmp_directories=True,
        temporary_path_class=_killed_before_commit(kill[1]) if kill and kill[0] == "save" else None,
    )
    # The handler named, so that a checkpoint's tree metadata can be read before restoring.
    handler = ocp.StandardCheckpointHandler()
    return ocp.CheckpointManager(directory.resolve(), options=options, item_handlers=handler)


def abstract_rng(seed: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def _checkpoint(state, step: int, seed: int) -> dict:
    """What a checkpoint holds: variables (parameters and FP8 state), optimizer state, step,
    the RNG the data is drawn with, and the data position (batches are a function of both)."""
    return {
        **state,
        "step": jnp.asarray(step, jnp.int32),
        "rng": jnp.asarray(abstract_rng(seed)),
        "data_position": jnp.asarray(step, jnp.int32),
    }


def _restore(
    manager: ocp.CheckpointManager,
    step: int,
    state: dict,
    config: Config,
    replicated: NamedSharding,
) -> dict:
    """The checkpoint of ``step`` on this run's mesh and layout, whatever the saving run's were.

    Its FP8 state must fit this run's recipe, or is fitted to it with ``resume_migrate_fp8``
    (another ``amax_history_len``, a checkpoint with no FP8 state or with state the recipe
    does not keep); the saved tree's metadata is checked before anything is read.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        _checkpoint(state, 0, config.train.seed),
    )
    migrate = functools.partial(
        migrate_fp8_state,
        target=abstract["variables"],
        # Delayed scaling's scales are recomputed from the saved histories under this run's
        # recipe: a checkpoint of another format or margin is converted, never used as saved.
        recipe=make_recipe(config),
        resize_history=config.resume_migrate_fp8,
        init_missing=config.resume_migrate_fp8,
        drop_extra=config.resume_migrate_fp8,
    )
    wanted = dict(jax.tree_util.tree_flatten_with_path(abstract["variables"])[0])

    def as_saved(path, metadata):
        # Where the checkpoint's array fits the model's, it is read straight into its sharding.
        like = wanted.get(path)
        if like is not None and like.shape == metadata.shape and like.dtype == metadata.dtype:
            return like
        return jax.ShapeDtypeStruct(metadata.shape, metadata.dtype, sharding=replicated)

    saved = jax.tree_util.tree_map_with_path(
        as_saved, manager.item_metadata(step).tree["variables"]
    )
    try:
        jax.eval_shape(migrate, saved)  # refuses a mismatch before anything is read
    except ValueError as error:
        if "parameters do not fit" in str(error):
            # Not an FP8 matter: another architecture wrote the checkpoint.
            hint = (
                "; the parameter trees differ, so the checkpoint was written by another model "
                f"configuration (this run: model.frontend={config.model.frontend}, "
                f"model.block={config.model.block}, model.layers={config.model.layers}); "
                "resume with the configuration that wrote it, or start a fresh run"
            )
        elif not config.resume_migrate_fp8:
            hint = "; this trainer migrates FP8 state when resumed with resume_migrate_fp8=true"
        else:
            hint = ""
        raise ResumeError(
            f"cannot resume from step {step} in {manager.directory}: {error}{hint}"
        ) from error
    restored = manager.restore(
        step, args=ocp.args.StandardRestore({**abstract, "variables": saved})
    )
    shardings = jax.tree.map(lambda x: x.sharding, abstract["variables"])
    restored["variables"] = jax.device_put(migrate(restored["variables"]), shardings)
    return restored


def train(
    config: Config,
    name: str = "run",
    resume: bool = False,
    corpus: Corpus | None = None,
    progress: bool = True,
) -> RunResult:
    """Trains for ``config.train.steps`` steps (continuing a checkpoint with ``resume``)."""
    corpus = corpus or load_corpus(config.data)
    t = config.train
    recipe = make_recipe(config)
    mesh = _mesh(config)
    rules = load_axis_rules(config.rules)
    batch_spec = nn.logical_to_mesh_axes(("batch", None), rules)
    batch_sharding = NamedSharding(mesh, batch_spec)
    batch_devices = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(tuple(batch_spec))]))
    if t.batch % batch_devices:
        raise ValueError(
            f"train.batch={t.batch} must be a multiple of the {batch_devices} devices the "
            f"rule set {config.rules!r} splits the batch over"
        )
    with (
        jax.set_mesh(mesh),
        nn.logical_axis_rules(rules),
        te_flax.autocast(enabled=recipe is not None, recipe=recipe),
    ):
        frontend = (_nnx_frontend if config.model.frontend == "nnx" else _linen_frontend)(config)
        tx = make_optimizer(config)
        # Parameters are created sharded as the rules say; the optimizer state follows them.
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            frontend.partition_specs(),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        variables = jax.jit(frontend.init, out_shardings=shardings)(jax.random.key(t.seed))
        replicated = NamedSharding(mesh, PartitionSpec())
        abstract_opt = jax.eval_shape(lambda v: init_optimizer(tx, v), variables)
        # Moments shaped like a parameter are sharded like it; counters are replicated.
        tx_shardings = optax.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            abstract_opt.tx_state,
            shardings["params"],
            transform_non_params=lambda _: replicated,
        )
        # The rest of the optimizer state (pending FP8 updates, counters) is replicated.
        opt_shardings = jax.tree.map(lambda _: replicated, abstract_opt)._replace(
            tx_state=tx_shardings
        )
        opt_state = jax.jit(lambda v: init_optimizer(tx, v), out_shardings=opt_shardings)(variables)
        state = {"variables": variables, "opt_state": opt_state}
        parameters = sum(x.size for x in jax.tree.leaves(state["variables"]["params"]))
        start = 0
        manager = None
        kill = _kill_point()
        if config.checkpoint_every:
            directory = Path(config.output_dir) / name / "checkpoints"
            if not resume:
                _set_aside_earlier_run(directory, name)
            manager = _checkpoint_manager(directory)
            if resume and manager.latest_step() is not None:
                latest = manager.latest_step()
                print(f"{name}: resuming from step {latest} of {manager.directory}")
                restored = _restore(manager, latest, state, config, replicated)
                if not np.array_equal(restored["rng"], abstract_rng(t.seed)):
                    raise ResumeError(
                        f"the checkpoint in {manager.directory} was made with another seed; "
                        f"resume with the same train.seed (now {t.seed})"
                    )
                start = int(restored["data_position"])
                state = {"variables": restored["variables"], "opt_state": restored["opt_state"]}
            elif resume:
                print(_nothing_to_resume(directory, name))

        train_step = jax.jit(make_train_step(frontend, tx))
        stats_every = t.fp8_stats_every if recipe is not None and frontend.stats_slots else 0
        if stats_every:
            stats_step = jax.jit(make_stats_step(frontend, tx))
            slots = frontend.stats_slots(state["variables"])

        @jax.jit
        def eval_loss(variables, tokens, targets):
            return _loss(frontend, variables, tokens, targets)[1][0]

        def evaluate(variables) -> float:
            losses = []
            for i in range(t.eval_batches):
                tokens, targets = corpus.batch("eval", t.seed, i, t.batch, t.seq_len)
                tokens, targets = jax.device_put((tokens, targets), batch_sharding)
                losses.append(float(eval_loss(variables, tokens, targets)))
            return float(np.mean(losses))

        result = RunResult(name, [], [], [], [], 0.0, 0.0, parameters, None)
        if start == 0:
            result.eval_steps.append(0)
            result.eval_loss.append(evaluate(state["variables"]))
        times, stats_times = [], []
        end = t.steps if t.stop_at is None else min(t.stop_at, t.steps)
        every = eval_interval(config)
        bar = tqdm(range(start, end), desc=name, disable=not progress, initial=start)
        for step in bar:
            tokens, targets = corpus.batch("train", t.seed, step, t.batch, t.seq_len)
            tokens, targets = jax.device_put((tokens, targets), batch_sharding)
            began = time.perf_counter()
            if stats_every and (step + 1) % stats_every == 0:
                # FP8 health: this step also measures every GEMM operand's statistics.
                with te_flax.inspect_fp8():
                    state, parts, stats = stats_step(state, slots, tokens, targets)
                result.fp8_stats.append((step + 1, jax.device_get(stats)))
                (loss, aux_loss, dropped), timed = parts, stats_times
            else:
                state, (loss, aux_loss, dropped) = train_step(state, tokens, targets)
                timed = times
            loss = float(loss)  # waits for the step
            timed.append(time.perf_counter() - began)
            result.steps.append(step + 1)
            result.train_loss.append(loss)
            if config.model.moe.experts:
                result.aux_loss.append(float(aux_loss))
                result.tokens_dropped.append(int(dropped))
            if len(times) > 1:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{t.batch * t.seq_len / times[-1]:.0f}")
            if (step + 1) % every == 0 or step + 1 == end:
                result.eval_steps.append(step + 1)
                result.eval_loss.append(evaluate(state["variables"]))
            if manager is not None and (
                (step + 1) % config.checkpoint_every == 0 or step + 1 == end
            ):
                saved = _checkpoint(state, step + 1, t.seed)
                manager.save(step + 1, args=ocp.args.StandardSave(saved))
            if kill == ("step", step + 1):
                if manager is not None:
                    manager.wait_until_finished()
                _kill_self()
        if manager is not None:
            manager.wait_until_finished()
            steps = ", ".join(map(str, manager.all_steps()))
            print(f"{name}: checkpoints of steps {steps} in {manager.directory}")
            manager.close()
        result.first_step_s = times[0] if times else 0.0
        # The first statistics step compiles its program: the rest show what one costs.
        measured = stats_times[1:] or stats_times
        result.fp8_stats_step_s = float(np.median(measured)) if measured else 0.0
        steady = times[1:] or times
        result.step_time_s = float(np.median(steady)) if steady else 0.0
        result.tokens_per_s = t.batch * t.seq_len / result.step_time_s if steady else 0.0
        result.partition_specs = jax.tree.map(lambda x: x.sharding.spec, state["variables"])
        result.variables = jax.device_get(state["variables"])
        return result
