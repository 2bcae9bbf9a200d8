"""TransformerEngine 2.20.2 beside te_flax in one process: the pieces every parity test uses.

Import it only after ``pytest.importorskip("transformer_engine.jax.flax")``. On a machine
without a GPU, TE's JAX extension answers two capability queries through the CUDA runtime,
which is not there; they are answered here before any TE layer reads them: compute
capability 9.0 (Hopper, which TE requires before it allows FP8) and no fused-attention
backend (TE then takes its unfused, pure-JAX attention). Run with
``NVTE_JAX_CUSTOM_CALLS=false`` (TE's pure-JAX primitives), as ``scripts/parity`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax_layers
import transformer_engine_jax
from transformer_engine.common import recipe as te_recipe

import te_flax
from te_flax import quantize
from te_flax.convert import TE_FP8_COLLECTION, from_transformer_engine

transformer_engine_jax.get_device_compute_capability = lambda gpu_id=0: 90
transformer_engine_jax.get_fused_attn_backend = lambda *args, **kwargs: (
    transformer_engine_jax.NVTE_Fused_Attn_Backend.NVTE_No_Backend,
    "no GPU",
)

TE = te_flax_layers
OURS_FP8_COLLECTION = "_overwrite_with_gradient"
HISTORY = 4
LEARNING_RATE = 1e-3

# name -> (te_flax recipe, TE recipe); None: no FP8.
RECIPES: dict[str, tuple[Any, Any]] = {
    "none": (None, None),
    "delayed": (
        quantize.DelayedScaling(amax_history_len=HISTORY),
        te_recipe.DelayedScaling(amax_history_len=HISTORY),
    ),
    "current": (quantize.Float8CurrentScaling(), te_recipe.Float8CurrentScaling()),
}


@contextmanager
def te_context(recipe: Any) -> Iterator[None]:
    if recipe is None:
        yield
    else:
        with te.autocast(enabled=True, recipe=recipe):
            yield


@contextmanager
def our_context(recipe: Any) -> Iterator[None]:
    with te_flax.autocast(enabled=recipe is not None, recipe=recipe):
        yield


def relative_error(actual: Any, expected: Any) -> float:
    """``||actual - expected|| / ||expected||`` in float32 (0 when both are 0)."""
    actual = jnp.asarray(actual, jnp.float32)
    expected = jnp.asarray(expected, jnp.float32)
    norm = float(jnp.linalg.norm(expected))
    diff = float(jnp.linalg.norm(actual - expected))
    return diff / norm if norm else diff


def flat(tree: Any) -> dict[str, Any]:
    return {
        jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@dataclasses.dataclass
class Step:
    """One training step's results, in te_flax's layout (TE's converted)."""

    out: Any
    param_grads: dict[str, Any]
    fp8: dict[str, Any]


def _loss_fn(
    module: nn.Module, fp8_collection: str, call: dict[str, Any]
) -> Callable[[Any, Any, Any, Any], Any]:
    def loss(params: Any, fp8: Any, x: Any, cotangent: Any) -> Any:
        variables = {"params": params, **({fp8_collection: fp8} if fp8 else {})}
        out = module.apply(variables, x, **call)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return loss


class Runner:
    """Training steps of one module: gradients of ``sum(out * cotangent)`` w.r.t. the
    parameters and the FP8 collection, whose "gradient" is the new FP8 state (TE's rule and
    te_flax's), then a small SGD step on the parameters."""

    def __init__(
        self,
        module: nn.Module,
        fp8_collection: str,
        context: Callable[[], Any],
        call: dict[str, Any],
    ):
        self.context = context
        self.fp8_collection = fp8_collection
        self.grad = jax.jit(
            jax.value_and_grad(_loss_fn(module, fp8_collection, call), argnums=(0, 1), has_aux=True)
        )

    def step(self, variables: dict[str, Any], x: Any, cotangent: Any) -> tuple[dict[str, Any], Any]:
        params, fp8 = variables["params"], variables.get(self.fp8_collection, {})
        with self.context():
            (_, out), (param_grads, new_fp8) = self.grad(params, fp8, x, cotangent)
        # A small step: a large one would amplify float32 rounding differences step by step.
        new_params = jax.tree.map(
            lambda p, g: p - LEARNING_RATE * g.astype(p.dtype), params, param_grads
        )
        new_variables = {"params": new_params, **({self.fp8_collection: new_fp8} if fp8 else {})}
        return new_variables, (out, param_grads, new_fp8)


def te_step_in_our_layout(result: tuple[Any, Any, Any]) -> Step:
    out, grads, fp8 = result
    converted = from_transformer_engine(
        {"params": grads, TE_FP8_COLLECTION: fp8} if fp8 else {"params": grads}
    )
    return Step(out, flat(converted["params"]), flat(converted.get(OURS_FP8_COLLECTION, {})))


def our_step(result: tuple[Any, Any, Any]) -> Step:
    out, grads, fp8 = result
    return Step(out, flat(grads), flat(fp8))


def compare_steps(ours: Step, theirs: Step) -> dict[str, float]:
    """The relative errors of te_flax's step against TE's, by what is compared.

    te_flax's amax history keeps one entry more than TE's (its oldest, which the next update
    drops; TE has cleared it): histories are compared without it.
    """
    assert ours.param_grads.keys() == theirs.param_grads.keys()
    assert ours.fp8.keys() == theirs.fp8.keys(), (sorted(ours.fp8), sorted(theirs.fp8))
    errors = {"output": relative_error(ours.out, theirs.out)}
    errors["parameter gradients"] = max(
        (relative_error(ours.param_grads[k], theirs.param_grads[k]) for k in ours.param_grads),
        default=0.0,
    )
    fp8_errors = [
        relative_error(ours.fp8[k][:-1], theirs.fp8[k][:-1])
        if k.endswith("_amax_history']")
        else relative_error(ours.fp8[k], theirs.fp8[k])
        for k in ours.fp8
    ]
    errors["FP8 state"] = max(fp8_errors, default=0.0)
    return errors
