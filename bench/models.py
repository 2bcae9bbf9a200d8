"""The candidates: te_flax's Linen layers and the Flax-only layers a user would write instead.

Every benchmark compares, for one shape and one recipe, two Linen models that compute the same
function from the same parameters:

* ``te_flax``: ``te_flax.linen.LayerNormDenseGeneral`` / ``LayerNormMLP``;
* ``flax``: ``nn.LayerNorm`` followed by ``nn.DenseGeneral`` (two of them and the activation for
  the MLP), with ``dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp`` under FP8.

Both take bfloat16 activations and keep float32 parameters; both keep their delayed-scaling
state in the ``_overwrite_with_gradient`` collection, whose "gradient" is its new value, and run
the same step: ``value_and_grad`` of the same loss, then the state overwritten with that value
(what Flax's ``TrainState.apply_gradients`` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

import te_flax.linen as te_nn
from te_flax.quantize import DelayedScaling

__all__ = [
    "AMAX_HISTORY_LEN",
    "IMPLS",
    "RECIPES",
    "Candidate",
    "Case",
    "build",
    "loss_fn",
    "make_grad_step",
    "with_new_fp8_state",
]

IMPLS = ("te_flax", "flax")
RECIPES = ("none", "delayed")  # no FP8; FP8 delayed scaling (HYBRID: e4m3 forward, e5m2 grads)
# Both libraries' default history length.
AMAX_HISTORY_LEN = 1024
ACTIVATION_DTYPE = jnp.bfloat16
PARAM_DTYPE = jnp.float32
EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer at one shape: ``x [batch, seq, hidden]`` into LayerNormDenseGeneral or MLP.

    ``features`` is the output size of LayerNormDenseGeneral and the intermediate size of
    LayerNormMLP.
    """

    layer: str  # "LayerNormDenseGeneral" or "LayerNormMLP"
    batch: int
    seq: int
    hidden: int
    features: int
    activations: tuple[str, ...] = ("gelu",)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def name(self) -> str:
        if self.layer == "LayerNormDenseGeneral":
            return f"LNDense {self.tokens}x{self.hidden}->{self.features}"
        act = "+".join(self.activations)
        return f"LNMLP {self.tokens}x{self.hidden}->{self.features} {act}"

    @property
    def n_act(self) -> int:
        return len(self.activations)

    def gemm_shapes(self) -> list[tuple[int, int, int]]:
        """(M, K, N) of each forward GEMM."""
        if self.layer == "LayerNormDenseGeneral":
            return [(self.tokens, self.hidden, self.features)]
        return [
            (self.tokens, self.hidden, self.n_act * self.features),
            (self.tokens, self.features, self.hidden),
        ]

    def forward_flops(self) -> int:
        return sum(2 * m * k * n for m, k, n in self.gemm_shapes())

    def step_flops(self) -> int:
        """GEMM flops of a training step: forward, dgrad and wgrad, each as large as forward."""
        return 3 * self.forward_flops()

    def describe(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "x": [self.batch, self.seq, self.hidden],
            "features" if self.layer == "LayerNormDenseGeneral" else "intermediate": self.features,
            **({"activations": list(self.activations)} if self.layer == "LayerNormMLP" else {}),
            "gemms_mkn": [list(shape) for shape in self.gemm_shapes()],
            "step_flops": self.step_flops(),
        }


# ----------------------------------------------------------------------------- Flax-only layers


def _flax_dense(features, fp8: bool, name: str) -> nn.DenseGeneral:
    dot_general_cls = None
    if fp8:
        # Flax's direct-quantization FP8 op (e4m3 forward, e5m2 gradients, delayed scaling).
        def dot_general_cls():
            return fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=AMAX_HISTORY_LEN)

    return nn.DenseGeneral(
        features,
        use_bias=False,
        dtype=ACTIVATION_DTYPE,
        param_dtype=PARAM_DTYPE,
        dot_general_cls=dot_general_cls,
        name=name,
    )


def _flax_norm() -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=EPSILON, dtype=ACTIVATION_DTYPE, param_dtype=PARAM_DTYPE, name="norm"
    )


class FlaxLayerNormDense(nn.Module):
    """``nn.LayerNorm`` then ``nn.DenseGeneral``: what a user writes without te_flax."""

    features: int
    fp8: bool

    @nn.compact
    def __call__(self, x):
        y = _flax_norm()(x)  # [batch, seq, hidden]
        return _flax_dense(self.features, self.fp8, "dense")(y)  # [batch, seq, features]


def _activation(name: str) -> Callable:
    # te_flax's "gelu" is the tanh approximation, as is Flax's nn.gelu default.
    return {"gelu": nn.gelu, "silu": nn.silu, "relu": nn.relu, "linear": lambda x: x}[name]


class FlaxLayerNormMLP(nn.Module):
    """LayerNorm, DenseGeneral to ``[n_act, intermediate]``, activation, DenseGeneral.

    What a user writes without te_flax.
    """

    intermediate: int
    activations: tuple[str, ...]
    fp8: bool

    @nn.compact
    def __call__(self, x):
        n_act = len(self.activations)
        y = _flax_norm()(x)
        # [batch, seq, hidden] -> [batch, seq, n_act, intermediate]
        h = _flax_dense((n_act, self.intermediate), self.fp8, "wi")(y)
        a = _activation(self.activations[0])(h[..., 0, :])
        if n_act == 2:  # gated: act(slice 0) * slice 1
            a = a * h[..., 1, :]
        return _flax_dense(x.shape[-1], self.fp8, "wo")(a)  # [batch, seq, hidden]


# ----------------------------------------------------------------------------- building


@dataclasses.dataclass
class Candidate:
    """A model, its variables and its input; ``apply(variables, x)`` returns the layer output."""

    impl: str
    recipe: str
    case: Case
    apply: Callable
    variables: dict
    x: jax.Array

    @property
    def label(self) -> str:
        return f"{self.impl} {'FP8' if self.recipe == 'delayed' else 'BF16'}"


def _te_model(case: Case, recipe: str) -> nn.Module:
    fp8_recipe = DelayedScaling(amax_history_len=AMAX_HISTORY_LEN) if recipe == "delayed" else None
    common = dict(dtype=None, param_dtype=PARAM_DTYPE, epsilon=EPSILON, recipe=fp8_recipe)
    if case.layer == "LayerNormDenseGeneral":
        return te_nn.LayerNormDenseGeneral(features=case.features, **common)
    return te_nn.LayerNormMLP(
        intermediate_dim=case.features, activations=case.activations, **common
    )


def _te_params_as_flax(case: Case, te_params: dict) -> dict:
    """te_flax's parameter tree laid out as the Flax-only model's (the same arrays)."""
    norm = {"scale": te_params["scale"], "bias": te_params["ln_bias"]}
    if case.layer == "LayerNormDenseGeneral":
        return {"norm": norm, "dense": {"kernel": te_params["kernel"]}}
    return {
        "norm": norm,
        "wi": {"kernel": te_params["wi_kernel"]},  # [hidden, n_act, intermediate]
        "wo": {"kernel": te_params["wo_kernel"]},  # [intermediate, hidden]
    }


def build(case: Case, impl: str, recipe: str, seed: int = 0) -> Candidate:
    """The candidate ``impl`` for ``case`` and ``recipe``; both impls get the same parameters."""
    x = jax.random.normal(
        jax.random.key(seed), (case.batch, case.seq, case.hidden), ACTIVATION_DTYPE
    )
    te_model = _te_model(case, recipe)
    te_variables = nn.meta.unbox(te_model.init(jax.random.key(seed + 1), x))
    if impl == "te_flax":
        return Candidate(impl, recipe, case, lambda v, x: te_model.apply(v, x)[0], te_variables, x)
    fp8 = recipe == "delayed"
    if case.layer == "LayerNormDenseGeneral":
        model = FlaxLayerNormDense(case.features, fp8)
    else:
        model = FlaxLayerNormMLP(case.features, case.activations, fp8)
    variables = {"params": _te_params_as_flax(case, te_variables["params"])}
    fresh = jax.jit(model.init)(jax.random.key(0), x)
    if fp8:
        variables[OVERWRITE_WITH_GRADIENT] = fresh[OVERWRITE_WITH_GRADIENT]
    shapes = jax.tree.map(jnp.shape, fresh["params"])
    assert jax.tree.map(jnp.shape, variables["params"]) == shapes, shapes
    return Candidate(impl, recipe, case, model.apply, variables, x)


# ----------------------------------------------------------------------------- the train step


def loss_fn(apply: Callable, variables, x):
    """The same scalar loss for every candidate: the mean square of the layer output."""
    out = apply(variables, x)
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def make_grad_step(candidate: Candidate) -> Callable:
    """``step(variables, x) -> (loss, (grads, x_grad))``: forward and backward of a train step.

    The input gradient is part of it, as for a layer inside a network. ``grads["params"]``
    goes to the optimizer; ``grads["_overwrite_with_gradient"]`` is the new FP8 state (see
    ``with_new_fp8_state``). The optimizer update itself is left out: it is the same for every
    candidate, and XLA fuses it differently around each one's weight-gradient GEMM, which
    would blur what the layers themselves cost.
    """
    apply = candidate.apply

    def step(variables, x):
        return jax.value_and_grad(partial(loss_fn, apply), argnums=(0, 1))(variables, x)

    return step


def with_new_fp8_state(variables: dict, grads: dict) -> dict:
    """The delayed-scaling state update of a training step, as Flax's ``TrainState`` does it.

    The "gradient" of the ``_overwrite_with_gradient`` collection is its new value.
    """
    if OVERWRITE_WITH_GRADIENT not in variables:
        return variables
    return {**variables, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
