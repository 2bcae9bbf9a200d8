"""Multi-device runs on the shipped rule sets: a sharded training step equals the single-device
one, parameters and optimizer state are placed as the rules say, each layout's collectives,
FP8 amax under ``shard_map``, and the mesh and rule-set helpers."""

from __future__ import annotations

import contextlib
import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import te_flax.linen as te_nn
import te_flax.nnx as te_nnx
from te_flax._base.jax_compat import JAX_VERSION
from te_flax.dense import dense
from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerFactory,
)
from te_flax.sharding import (
    LOGICAL_AXES,
    RULES_DIR,
    load_axis_rules,
    make_mesh,
    use_sharding,
    with_logical_constraint,
)
from te_flax.training import (
    OVERWRITE_WITH_GRADIENT,
    apply_gradients,
    init_optimizer,
    merge_fp8_state,
)
from tests.helpers import F32, assert_close, normal

P = PartitionSpec
DELAYED = DelayedScaling(amax_history_len=4)
BATCH, SEQ, HIDDEN, INTERMEDIATE = 8, 8, 32, 64
# Activation logical axes, as the rule sets name them: the residual / norm input, a GEMM-1
# input (None gathers the sequence under sequence parallelism) and GEMM 2's input.
NORM_AXES = ("batch", "length", "act_embed")
GEMM_1_AXES = ("batch", None, "act_embed")
GEMM_2_AXES = ("batch", None, "act_mlp")
# Sharded values differ from single-device ones only by float32 summation order.
VALUE_TOLERANCE = 1e-5

# name -> (rule set, mesh shape, number of devices)
LAYOUTS = {
    "dp": ("dp", {"data": 8}, 8),
    "fsdp": ("fsdp", {"fsdp": 8}, 8),
    "tp": ("tp", {"data": 2, "tensor": 4}, 8),
    "tp_sp": ("tp_sp", {"tensor": 4}, 4),
    "dp_fsdp_tp": ("dp_fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, 8),
}


@contextlib.contextmanager
def _layout(name: str, rules=None):
    """The layout's mesh and rules (or ``rules``) made active; yields ``(mesh, rules)``."""
    rule_set, shape, n_devices = LAYOUTS[name]
    rules = load_axis_rules(rule_set) if rules is None else rules
    mesh = make_mesh(shape, devices=jax.devices()[:n_devices])
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh, rules


def _spec(array) -> tuple:
    """``array``'s PartitionSpec with one entry per dimension (JAX trims trailing Nones)."""
    assert isinstance(array.sharding, NamedSharding), array.sharding
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def _place(array, logical_axes, mesh, rules):
    spec = nn.logical_to_mesh_axes(logical_axes, rules)
    return jax.device_put(array, NamedSharding(mesh, spec))


def _inputs():
    keys = jax.random.split(jax.random.key(42), 2)
    x = normal(keys[0], (BATCH, SEQ, HIDDEN), scale=2.0) + 0.5
    return x, keys[1]


# ----------------------------------------------------------------------------- the layers


def _layer_attributes(kind: str, recipe) -> dict:
    if kind == "layernorm_dense":
        return dict(
            kernel_axes=("embed", "mlp"),
            use_bias=True,
            bias_axes=("mlp",),
            layernorm_input_axes=NORM_AXES,
            dot_input_axes=GEMM_1_AXES,
            recipe=recipe,
        )
    return dict(
        intermediate_dim=INTERMEDIATE,
        activations=("gelu", "linear"),
        use_bias=True,
        layernorm_input_axes=NORM_AXES,
        dot_1_input_axes=GEMM_1_AXES,
        dot_2_input_axes=GEMM_2_AXES,
        recipe=recipe,
    )


def _output_axes(kind: str) -> tuple:
    # LayerNormDenseGeneral is column parallel: its output feeds a GEMM 2. LayerNormMLP's output
    # is the residual, laid out as the norm input.
    return GEMM_2_AXES if kind == "layernorm_dense" else NORM_AXES


def _linen_layer(kind: str, recipe) -> nn.Module:
    attributes = _layer_attributes(kind, recipe)
    if kind == "layernorm_dense":
        return te_nn.LayerNormDenseGeneral(features=INTERMEDIATE, **attributes)
    return te_nn.LayerNormMLP(**attributes)


def _nnx_maker(kind: str, recipe):
    attributes = _layer_attributes(kind, recipe)

    def make():
        if kind == "layernorm_dense":
            return te_nnx.LayerNormDenseGeneral(
                HIDDEN, INTERMEDIATE, rngs=nnx.Rngs(0), **attributes
            )
        return te_nnx.LayerNormMLP(HIDDEN, rngs=nnx.Rngs(0), **attributes)

    return make


def _output_shape(kind: str) -> tuple:
    return (BATCH, SEQ, INTERMEDIATE if kind == "layernorm_dense" else HIDDEN)


def _linen_shardings(layer, x, mesh, rules):
    abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)


def _linen_init(layer, x, mesh=None, rules=None):
    """Variables, created by jit with the rules' shardings when ``mesh`` is given."""
    if mesh is None:
        return nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x))
    shardings = _linen_shardings(layer, x, mesh, rules)
    init = jax.jit(layer.init, out_shardings=shardings)
    return nn.meta.unbox(init(jax.random.key(0), x))


def _nnx_init(make, mesh=None):
    """``(graphdef, state)``, the state created by jit with the Params' shardings on ``mesh``."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    create = lambda: nnx.split(make())[1]  # noqa: E731
    if mesh is None:
        return graphdef, jax.jit(create)()
    shardings = nnx.get_named_sharding(abstract_state, mesh)
    return graphdef, jax.jit(create, out_shardings=shardings)()


def _linen_step(layer, output_axes):
    """``(variables, x, cotangent) -> (output, {"params": grads, "fp8": new FP8 state})``."""

    def loss(variables, x, cotangent):
        out, _ = layer.apply(merge_fp8_state(variables), x)
        out = with_logical_constraint(out, output_axes)  # laid out as the next layer's input
        return jnp.sum(out * cotangent), out

    def step(variables, x, cotangent):
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables, x, cotangent)
        return out, {"params": grads["params"], "fp8": grads.get(OVERWRITE_WITH_GRADIENT, {})}

    return step


def _nnx_step(graphdef, output_axes):
    def loss_fn(model, x, cotangent):
        out, _ = model(x)
        out = with_logical_constraint(out, output_axes)
        return jnp.sum(out * cotangent), out

    def step(state, x, cotangent):
        model = nnx.merge(graphdef, state)
        (_, out), grads = te_nnx.value_and_grad(loss_fn, has_aux=True)(model, x, cotangent)
        return out, {
            "params": nnx.to_pure_dict(nnx.state(grads, nnx.Param)),
            "fp8": nnx.to_pure_dict(nnx.state(grads, te_nnx.Fp8Meta)),
        }

    return step


# Logical axis names of the layers' parameters. Linen's rules replicate a name they do not
# mention; NNX's ``get_partition_spec`` keeps it as a mesh axis name, so the NNX runs below
# give every such name an explicit ``None`` rule (see test_nnx_partition_specs_follow_...).
PARAMETER_AXES = ("embed", "act", "mlp")


def _complete_rules(rules) -> tuple:
    mentioned = {name for name, _ in rules}
    return tuple(rules) + tuple((name, None) for name in PARAMETER_AXES if name not in mentioned)


def _run(framework: str, kind: str, recipe, layout: str | None):
    """One training step: ``(output, {"params": grads, "fp8": new state}, placement)``, where
    ``placement`` (None on one device) holds the PartitionSpecs of x, the parameters and their
    gradients."""
    x, cotangent_key = _inputs()
    cotangent = normal(cotangent_key, _output_shape(kind))
    context = contextlib.nullcontext((None, None)) if layout is None else _layout(layout)
    if framework == "nnx" and layout is not None:
        context = _layout(layout, _complete_rules(load_axis_rules(LAYOUTS[layout][0])))
    with context as (mesh, rules):
        if mesh is not None:
            x = _place(x, NORM_AXES, mesh, rules)
            cotangent = _place(cotangent, _output_axes(kind), mesh, rules)
        if framework == "linen":
            layer = _linen_layer(kind, recipe)
            variables = _linen_init(layer, x, mesh, rules)
            step = _linen_step(layer, _output_axes(kind))
        else:
            graphdef, variables = _nnx_init(_nnx_maker(kind, recipe), mesh)
            step = _nnx_step(graphdef, _output_axes(kind))
        out, grads = jax.jit(step)(variables, x, cotangent)
    placement = None
    if mesh is not None:
        params = (
            variables["params"]
            if framework == "linen"
            else nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, variables), nnx.Param))
        )
        placement = {
            "x": _spec(x),
            "params": {name: _spec(p) for name, p in params.items()},
            "grads": {name: _spec(g) for name, g in grads["params"].items()},
        }
    return out, jax.tree.map(np.asarray, grads), placement


_SINGLE_DEVICE: dict = {}


def _single_device(framework: str, kind: str, recipe):
    key = (framework, kind, recipe is not None)
    if key not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[key] = _run(framework, kind, recipe, None)[:2]
    return _SINGLE_DEVICE[key]


# ----------------------------------------------------------------------------- sharded == single


_EXPECTED_INPUT_SPECS = {
    "dp_fsdp_tp": (("data", "fsdp"), None, None),
    "tp_sp": ("data", "tensor", None),  # data has size 1 here
    "fsdp": (("data", "fsdp"), None, None),
}


# The cases that run by default; the others are marked slow.
_FAST_STEP_CASES = {
    ("dp_fsdp_tp", "linen", "layernorm_dense"),
    ("dp_fsdp_tp", "linen", "layernorm_mlp"),
    ("dp_fsdp_tp", "nnx", "layernorm_dense"),
    ("dp_fsdp_tp", "nnx", "layernorm_mlp"),
    ("tp_sp", "linen", "layernorm_mlp"),
    ("tp_sp", "nnx", "layernorm_dense"),
    ("fsdp", "linen", "layernorm_dense"),
    ("fsdp", "nnx", "layernorm_mlp"),
}


def _step_cases():
    for layout in ("dp_fsdp_tp", "tp_sp", "fsdp"):
        for framework in ("linen", "nnx"):
            for kind in ("layernorm_dense", "layernorm_mlp"):
                for fp8 in (False, True):
                    fast = fp8 and (layout, framework, kind) in _FAST_STEP_CASES
                    marks = [] if fast else [pytest.mark.slow]
                    yield pytest.param(
                        layout,
                        framework,
                        kind,
                        fp8,
                        id=f"{layout}-{framework}-{kind}-{'fp8' if fp8 else 'nofp8'}",
                        marks=marks,
                    )


@pytest.mark.parametrize(("layout", "framework", "kind", "fp8"), list(_step_cases()))
def test_sharded_training_step_equals_the_single_device_step(layout, framework, kind, fp8):
    recipe = DELAYED if fp8 else None
    expected_out, expected = _single_device(framework, kind, recipe)
    out, grads, placement = _run(framework, kind, recipe, layout)
    assert placement["x"] == _EXPECTED_INPUT_SPECS[layout]
    kernels = ["kernel"] if kind == "layernorm_dense" else ["wi_kernel", "wo_kernel"]
    for name in kernels:
        # Every kernel is split on these layouts, and its gradient the same way (the ops
        # constrain it with the kernel's axes).
        assert any(placement["params"][name]), (name, placement["params"][name])
        assert placement["grads"][name] == placement["params"][name], name
    assert_close(out, expected_out, VALUE_TOLERANCE, "output")
    assert sorted(grads["params"]) == sorted(expected["params"])
    for name, grad in grads["params"].items():
        assert_close(grad, expected["params"][name], VALUE_TOLERANCE, f"d {name}")
    assert sorted(grads["fp8"]) == sorted(expected["fp8"])
    assert bool(grads["fp8"]) == fp8
    for name, state in grads["fp8"].items():
        # Under jit the amax of a sharded tensor is global: the new FP8 state is the
        # single-device one (up to the rounding of the gradients whose amax it records).
        np.testing.assert_allclose(state, expected["fp8"][name], rtol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- collectives

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<shapes>.+?) "
    r"(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\("
)
_SHAPE = re.compile(r"([a-z0-9]+\[[0-9,]*\])")


def _collectives(hlo: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(op, result shapes)`` of each collective of a compiled module, e.g.
    ``("all-gather", ("f32[32,2,64]",))``; a combined all-reduce lists all its operands."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.match(line)
        if match:
            found.append((match["op"], tuple(_SHAPE.findall(match["shapes"]))))
    return found


def _training_step_hlo(layout: str, recipe) -> str:
    """The compiled HLO of one SGD step of LayerNormMLP on the layout, as a layer inside a
    model: the input's gradient goes on to the layer before it."""
    layer = _linen_layer("layernorm_mlp", recipe)
    tx = optax.sgd(0.1)
    x, cotangent_key = _inputs()
    cotangent = normal(cotangent_key, x.shape)

    def loss(variables, x, cotangent):
        out, _ = layer.apply(merge_fp8_state(variables), x)
        return jnp.sum(with_logical_constraint(out, NORM_AXES) * cotangent)

    def step(variables, x, cotangent):
        # value_and_grad: with jax.grad XLA would drop the forward GEMM 2, whose output only
        # the (linear) loss value reads.
        value, (grads, d_x) = jax.value_and_grad(loss, argnums=(0, 1))(variables, x, cotangent)
        new_variables, _ = apply_gradients(tx, variables, grads, init_optimizer(tx, variables))
        return value, new_variables, d_x

    with _layout(layout) as (mesh, rules):
        x = _place(x, NORM_AXES, mesh, rules)
        cotangent = _place(cotangent, NORM_AXES, mesh, rules)
        shardings = _linen_shardings(layer, x, mesh, rules)
        variables = _linen_init(layer, x, mesh, rules)
        step = jax.jit(step, out_shardings=(None, shardings, x.sharding))
        return step.lower(variables, x, cotangent).compile().as_text()


# One SGD step of LayerNormMLP (gated, with biases; batch 8, sequence 8, hidden 32,
# intermediate 64). ``gathered``: the result shapes of the all-gathers. ``reduced``: the
# operands of the all-reduces (XLA combines several into one instruction; ``all_reduces``
# counts the instructions). XLA:CPU has no reduce-scatter: its partitioner writes one as an
# all-reduce whose result each device slices by partition id, so the reduce-scatters of FSDP
# gradients and of the sequence-parallel GEMM-2 output appear as all-reduces of full-size
# values. XLA:CPU has no float8 collectives either: a float8 value is widened to f16 for an
# all-gather (quantized per shard, then gathered), so "f16" below is a float8 payload.
_GRADS_DP = ["f32[32]"] * 3 + ["f32[2,64]", "f32[32,2,64]", "f32[64,32]"]
_GRADS_TP = ["f32[32]"] * 3 + ["f32[2,16]", "f32[32,2,16]", "f32[16,32]"]
EXPECTED_COLLECTIVES = {
    # Data parallel: one all-reduce of the loss and the six parameter gradients over the
    # batch shards; FP8 adds one all-reduce of four amaxes (x and gradient of both GEMMs; the
    # kernels are whole on every device).
    ("dp", False): dict(gathered=[], all_reduces=1, reduced=["f32[]", *_GRADS_DP]),
    ("dp", True): dict(gathered=[], all_reduces=2, reduced=["f32[]"] * 5 + _GRADS_DP),
    # FSDP: only parameters are gathered, never an activation. Without FP8 the f32 kernels
    # are gathered for the forward GEMM and again for the backward (XLA does not keep the
    # gathered copy alive), and the embed-sharded vectors where the norm, its backward and the
    # bias add read them (scale x3, ln_bias x2, wo_bias x1). With FP8 each kernel is gathered
    # once, quantized (the backward reuses the gathered float8 copy of the forward), and the
    # vectors four times (scale x2). The gradients are reduce-scattered (full-size all-reduce,
    # see above); FP8 adds the six amaxes (the kernels are sharded too).
    ("fsdp", False): dict(
        gathered=["f32[32]"] * 6 + ["f32[32,2,64]"] * 2 + ["f32[64,32]"] * 2,
        all_reduces=1,
        reduced=["f32[]", *_GRADS_DP],
    ),
    ("fsdp", True): dict(
        gathered=["f32[32]"] * 4 + ["f16[32,2,64]", "f16[64,32]"],
        all_reduces=2,
        reduced=["f32[]"] * 7 + _GRADS_DP,
    ),
    # Tensor parallel (data 2 x tensor 4): no all-gather. The row-parallel GEMM-2 output and
    # the input gradient of the column-parallel GEMM 1 are all-reduced over tensor
    # ([4 = 8/2 batch, 8, 32], one combined instruction); the gradients over data. FP8 adds
    # eight amax reductions in two instructions: x_0, x_1, grad_0, grad_1 over data; x_1,
    # grad_1 (the activation gradient) and both kernels over tensor.
    ("tp", False): dict(
        gathered=[],
        all_reduces=2,
        reduced=["f32[4,8,32]"] * 2 + ["f32[]", *_GRADS_TP],
    ),
    ("tp", True): dict(
        gathered=[],
        all_reduces=4,
        reduced=["f32[4,8,32]"] * 2 + ["f32[]"] * 9 + _GRADS_TP,
    ),
    # Tensor + sequence parallel (tensor 4): the sequence is gathered for GEMM 1 (the norm
    # output; in float8 under FP8, gathered once and reused by the wgrad, where without FP8 it
    # is gathered again for the wgrad) and the output gradient for GEMM 2's backward (float8
    # under FP8: both are quantized on their sequence shards and gathered quantized); the
    # GEMM-2 output is reduce-scattered back onto the sequence and so is the GEMM-1 input
    # gradient (both full-size all-reduces, see above). The scale, ln_bias and wo_bias
    # gradients are summed over the sequence shards; the kernels' gradients stay local. FP8
    # adds the six amaxes (every tensor is split over tensor).
    ("tp_sp", False): dict(
        gathered=["f32[8,8,32]"] * 3,
        all_reduces=3,
        reduced=["f32[8,8,32]"] * 2 + ["f32[]"] + ["f32[32]"] * 3,
    ),
    ("tp_sp", True): dict(
        gathered=["f16[8,8,32]"] * 2,
        all_reduces=4,
        reduced=["f32[8,8,32]"] * 2 + ["f32[]"] * 7 + ["f32[32]"] * 3,
    ),
    # data 2 x fsdp 2 x tensor 2: the FSDP gathers of the tensor-sharded kernels ([32, 2, 32],
    # [32, 32]) and of the vectors; the tensor all-reduces of tp ([2 = 8/4 batch, 8, 32]). The
    # kernel gradients are summed in two steps, full size over fsdp (the reduce-scatter) and
    # then the fsdp shards ([16, 2, 32], [32, 16]) over data; the vectors' over the batch.
    # With FP8 each float8 kernel is gathered twice (forward GEMM and dgrad: here XLA does not
    # keep the gathered copy), the vectors four times, and the six amaxes take ten reductions
    # in five instructions (the four split over tensor and the batch or fsdp are reduced in two
    # steps). XLA 0.12 combines two of those instructions into one (8).
    ("dp_fsdp_tp", False): dict(
        gathered=["f32[32]"] * 6 + ["f32[32,2,32]"] * 2 + ["f32[32,32]"] * 2,
        all_reduces=4,
        reduced=["f32[2,8,32]"] * 2
        + ["f32[32,2,32]", "f32[32,32]", "f32[16,2,32]", "f32[32,16]"]
        + ["f32[]", "f32[32]", "f32[32]", "f32[2,32]", "f32[32]"],
    ),
    ("dp_fsdp_tp", True): dict(
        gathered=["f32[32]"] * 4 + ["f16[32,2,32]"] * 2 + ["f16[32,32]"] * 2,
        all_reduces=9 if JAX_VERSION < (0, 12) else 8,
        reduced=["f32[2,8,32]"] * 2
        + ["f32[32,2,32]", "f32[32,32]", "f32[16,2,32]", "f32[32,16]"]
        + ["f32[]"] * 11
        + ["f32[32]", "f32[32]", "f32[2,32]", "f32[32]"],
    ),
}


def _collective_cases():
    for layout in LAYOUTS:
        for fp8 in (False, True):
            fast = (layout, fp8) in {
                ("fsdp", True),
                ("tp", False),
                ("tp_sp", True),
                ("dp_fsdp_tp", True),
            }
            marks = [] if fast else [pytest.mark.slow]
            yield pytest.param(layout, fp8, id=f"{layout}-{'fp8' if fp8 else 'nofp8'}", marks=marks)


@pytest.mark.parametrize(("layout", "fp8"), list(_collective_cases()))
def test_collectives_of_a_layernorm_mlp_training_step(layout, fp8):
    collectives = _collectives(_training_step_hlo(layout, DELAYED if fp8 else None))
    counts = Counter(op for op, _ in collectives)
    expected = EXPECTED_COLLECTIVES[layout, fp8]
    assert counts["reduce-scatter"] == 0  # XLA:CPU writes them as all-reduces (see above)
    assert counts["all-to-all"] == counts["collective-permute"] == 0
    assert counts["all-gather"] == len(expected["gathered"])
    assert counts["all-reduce"] == expected["all_reduces"]
    gathered = Counter(shapes[0] for op, shapes in collectives if op == "all-gather")
    assert gathered == Counter(expected["gathered"])
    reduced = Counter(s for op, shapes in collectives if op == "all-reduce" for s in shapes)
    assert reduced == Counter(expected["reduced"])
    if fp8:
        # The kernels, the sequence-parallel norm output and output gradient cross the network
        # quantized: no matrix is gathered in float32.
        wide = [s for s in gathered.elements() if s.startswith("f32") and "," in s]
        assert wide == []


# ----------------------------------------------------------------------------- collective table

# An instruction: its name, its type (a tuple type for combined collectives), op and operands.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>\(.+?\)|\S+) (?P<op>[a-z][a-z0-9-]*)\((?P<args>.*)"
)
_COMPUTATION = re.compile(r"^%(?P<name>\S+) .*\{$")
_CALLS = re.compile(r"calls=%([^\s,}]+)")
# Ops that move or widen a value without changing what it holds.
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape", "transpose")
_FLOAT8 = ("f8e4m3fn", "f8e5m2")


def _computations(hlo: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """Each computation's instructions: ``{computation: {name: (type, op, args)}}``."""
    computations: dict[str, dict[str, tuple[str, str, str]]] = {}
    current: dict[str, tuple[str, str, str]] = {}
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            current = computations.setdefault(match["name"], {})
        elif match := _INSTRUCTION.match(line):
            current[match["name"]] = (match["type"], match["op"], match["args"])
            if line.lstrip().startswith("ROOT"):
                current["ROOT"] = current[match["name"]]
    return computations


def _payload(computations, instructions, name: str) -> str:
    """The element type a collective operand carries: a float8 value that XLA:CPU widened to
    f16 for the collective (the cast into float8 and back fused before it) reads as float8."""
    type_, op, args = instructions[name]
    seen = []
    while True:
        seen.append(type_.split("[")[0])
        if op == "fusion":
            callee = computations[_CALLS.search(args)[1]]
            type_, op, args = callee["ROOT"]
            instructions = callee
            continue
        operands = re.findall(r"%([^\s,()]+)", args.split(")")[0])
        if op not in _PASS_THROUGH or len(operands) != 1 or operands[0] not in instructions:
            break
        type_, op, args = instructions[operands[0]]
    float8 = [t for t in seen if t in _FLOAT8]
    return float8[0] if float8 else seen[0]


def collective_table(hlo: str) -> list[tuple[str, str, str]]:
    """``(collective, payload element type, operand shape)`` for each operand of each
    collective of a compiled module, in program order."""
    computations = _computations(hlo)
    rows = []
    for instructions in computations.values():
        for name, (_, op, args) in instructions.items():
            if name == "ROOT":  # the root's second entry
                continue
            kind = op.removesuffix("-start")
            if kind not in (
                "all-gather",
                "reduce-scatter",
                "all-reduce",
                "all-to-all",
                "collective-permute",
            ):
                continue
            for operand in re.findall(r"%([^\s,()]+)", args.split(")")[0]):
                shape = instructions[operand][0].split("{")[0]  # without the layout
                rows.append((kind, _payload(computations, instructions, operand), shape))
    return rows


def format_table(rows) -> str:
    return "\n".join(f"{kind:20} {payload:9} {shape}" for kind, payload, shape in rows)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("layout", ["tp_sp", "fsdp"])
def test_fp8_step_all_gathers_its_gemm_operands_in_float8(layout, recipe):
    recipe = DELAYED if recipe == "delayed" else Float8CurrentScaling()
    rows = collective_table(_training_step_hlo(layout, recipe))
    table = format_table(rows)
    gathered = [(payload, shape) for kind, payload, shape in rows if kind == "all-gather"]
    # GEMM operands are the gathered matrices (FSDP also gathers the embed-split norm scale,
    # norm shift and bias vectors, which no GEMM reads in float8).
    matrices = [(payload, shape) for payload, shape in gathered if "," in shape]
    assert matrices, table
    assert all(payload in _FLOAT8 for payload, _ in matrices), table
    if layout == "tp_sp":
        # The norm output (e4m3) and the output gradient (e5m2), each gathered once.
        assert sorted(payload for payload, _ in matrices) == ["f8e4m3fn", "f8e5m2"], table
    else:
        # Each kernel once, in e4m3; never an activation.
        assert [payload for payload, _ in matrices] == ["f8e4m3fn"] * 2, table


# ----------------------------------------------------------------------------- placement


def _mlp_specs(scale, wi_kernel, wi_bias, wo_kernel, wo_bias) -> dict:
    return dict(
        scale=scale,
        ln_bias=scale,
        wi_kernel=wi_kernel,
        wi_bias=wi_bias,
        wo_kernel=wo_kernel,
        wo_bias=wo_bias,
    )


# LayerNormMLP's default parameter axes: scale, ln_bias, wo_bias ("embed",), wi_kernel
# ("embed", "act", "mlp"), wi_bias ("act", "mlp"), wo_kernel ("mlp", "embed").
_TP_SPECS = _mlp_specs((None,), (None, None, "tensor"), (None, "tensor"), ("tensor", None), (None,))
MLP_SPECS = {
    "dp": _mlp_specs((None,), (None, None, None), (None, None), (None, None), (None,)),
    "fsdp": _mlp_specs(("fsdp",), ("fsdp", None, None), (None, None), (None, "fsdp"), ("fsdp",)),
    "tp": _TP_SPECS,
    "tp_sp": _TP_SPECS,
    "dp_fsdp_tp": _mlp_specs(
        ("fsdp",), ("fsdp", None, "tensor"), (None, "tensor"), ("tensor", "fsdp"), ("fsdp",)
    ),
}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            layout, marks=[] if layout in ("fsdp", "tp_sp", "dp_fsdp_tp") else [pytest.mark.slow]
        )
        for layout in LAYOUTS
    ],
)
def test_linen_parameters_are_created_sharded_as_the_rules_say(layout):
    layer = _linen_layer("layernorm_mlp", DELAYED)
    x, _ = _inputs()
    with _layout(layout) as (mesh, rules):
        variables = _linen_init(layer, _place(x, NORM_AXES, mesh, rules), mesh, rules)
    assert {name: _spec(p) for name, p in variables["params"].items()} == MLP_SPECS[layout]
    # The FP8 state is a handful of scalars per GEMM: replicated.
    assert all(_spec(s) == (None,) for s in variables[OVERWRITE_WITH_GRADIENT].values())
    assert len(variables[OVERWRITE_WITH_GRADIENT]) == 12


def test_layernorm_dense_general_parameters_are_created_sharded_as_the_rules_say():
    layer = _linen_layer("layernorm_dense", DELAYED)
    x, _ = _inputs()
    with _layout("dp_fsdp_tp") as (mesh, rules):
        variables = _linen_init(layer, _place(x, NORM_AXES, mesh, rules), mesh, rules)
        graphdef, state = _nnx_init(_nnx_maker("layernorm_dense", DELAYED), mesh)
    expected = {
        "scale": ("fsdp",),
        "ln_bias": ("fsdp",),
        "kernel": ("fsdp", "tensor"),
        "bias": ("tensor",),
    }
    assert {name: _spec(p) for name, p in variables["params"].items()} == expected
    nnx_params = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state), nnx.Param))
    assert {name: _spec(p) for name, p in nnx_params.items()} == expected


def test_nnx_partition_specs_follow_the_shipped_rules():
    # The shipped rule sets replicate a logical name they do not mention (``act`` in all of
    # them, ``embed`` in tp): Linen's ``logical_to_mesh_axes`` maps it to None, and the NNX
    # specs must too, or they name axes the mesh does not have.
    layer = _nnx_maker("layernorm_mlp", DELAYED)()
    for layout in ("dp_fsdp_tp", "tp"):
        with nn.logical_axis_rules(load_axis_rules(LAYOUTS[layout][0])):
            specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
        assert {name: tuple(spec) for name, spec in specs.items()} == MLP_SPECS[layout], layout
        with _layout(layout) as (mesh, _):
            graphdef, state = _nnx_init(_nnx_maker("layernorm_mlp", DELAYED), mesh)
        params = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state), nnx.Param))
        assert {name: _spec(p) for name, p in params.items()} == MLP_SPECS[layout]


def _same_sharding(state_tree, params) -> None:
    """Every leaf of ``state_tree`` (a tree shaped like ``params``) is sharded like its param."""
    for (path, leaf), (_, param) in zip(
        jax.tree_util.tree_leaves_with_path(state_tree),
        jax.tree_util.tree_leaves_with_path(params),
        strict=True,
    ):
        assert _spec(leaf) == _spec(param), jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "tx",
    [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)],
    ids=["adam", "sgd-momentum"],
)
def test_linen_optimizer_state_follows_the_parameter_sharding(tx):
    layer = _linen_layer("layernorm_mlp", DELAYED)
    x, _ = _inputs()
    with _layout("dp_fsdp_tp") as (mesh, rules):
        x = _place(x, NORM_AXES, mesh, rules)
        shardings = _linen_shardings(layer, x, mesh, rules)
        # Boxed (logically partitioned) variables: optax's state of a boxed parameter is boxed
        # with the same logical axes, so its partition specs come out of the same rules.
        boxed = jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)
        init = lambda variables: init_optimizer(tx, variables)  # noqa: E731
        abstract = jax.eval_shape(init, boxed)
        opt_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        opt_state = nn.meta.unbox(jax.jit(init, out_shardings=opt_shardings)(boxed))
    params = nn.meta.unbox(boxed)["params"]
    tx_state = opt_state.tx_state[0]
    moments = [tx_state.mu, tx_state.nu] if hasattr(tx_state, "mu") else [tx_state.trace]
    for moment in moments:
        _same_sharding(moment, params)
    assert _spec(params["wi_kernel"]) == ("fsdp", None, "tensor")


def test_nnx_optimizer_state_follows_the_parameter_sharding():
    make_layer = _nnx_maker("layernorm_mlp", DELAYED)

    def make():
        layer = make_layer()
        return layer, nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)

    rules = _complete_rules(load_axis_rules("dp_fsdp_tp"))
    with _layout("dp_fsdp_tp", rules) as (mesh, _):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
        shardings = nnx.get_named_sharding(abstract_state, mesh)
        state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    layer, optimizer = nnx.merge(graphdef, state)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    adam = optimizer.opt_state[0]
    for moment in (adam.mu, adam.nu):
        _same_sharding(nnx.to_pure_dict(nnx.state(moment)), params)
    assert _spec(params["wi_kernel"]) == ("fsdp", None, "tensor")


# ----------------------------------------------------------------------------- shard_map


def _shard_map_problem():
    keys = jax.random.split(jax.random.key(7), 3)
    # Each batch row (device) has a different range, so one device's amax is not the global one.
    x = normal(keys[0], (BATCH, SEQ, HIDDEN)) * (1.0 + jnp.arange(BATCH, dtype=F32))[:, None, None]
    kernel = normal(keys[1], (HIDDEN, INTERMEDIATE), scale=0.2)
    rows = (BATCH - jnp.arange(BATCH, dtype=F32))[:, None, None]
    cotangent = normal(keys[2], (BATCH, SEQ, INTERMEDIATE)) * rows
    return x, kernel, cotangent, QuantizerFactory.create_set(fp8_recipe=DELAYED)


def _dense_loss(x, kernel, quantizer_set, cotangent):
    out = dense(x, kernel, input_axes=("batch", None, "embed"), quantizer_set=quantizer_set)
    return jnp.sum(out * cotangent), out


def _assert_same_state(actual, expected) -> None:
    for role in ("x", "kernel", "dgrad"):
        for field in ("amax_history", "scale_inv"):
            np.testing.assert_array_equal(
                getattr(getattr(actual, role), field),
                getattr(getattr(expected, role), field),
                err_msg=f"{role}.{field}",
            )


@pytest.mark.parametrize(
    ("where", "check_vma"),
    [
        ("inside", True),
        pytest.param("inside", False, marks=pytest.mark.slow),
        ("outside", True),
    ],
    ids=["grad-inside", "grad-inside-no-vma", "grad-outside"],
)
def test_dense_in_shard_map_has_the_single_device_fp8_state(where, check_vma):
    x, kernel, cotangent, quantizer_set = _shard_map_problem()
    grad = jax.value_and_grad(_dense_loss, argnums=(0, 1, 2), has_aux=True)
    (_, expected_out), (expected_dx, expected_dkernel, expected_state) = jax.jit(grad)(
        x, kernel, quantizer_set, cotangent
    )
    data = P("data")

    def replicated_kernel(kernel):
        # The kernel is the same on every device; marked varying, its gradient is summed over
        # the devices by the transpose of the mark, as for a plain dot.
        return jax.lax.pcast(kernel, "data", to="varying") if check_vma else kernel

    def inside(x, kernel, quantizer_set, cotangent):  # blocks of one batch row
        assert x.shape == (1, SEQ, HIDDEN)
        assert jax.sharding.get_abstract_mesh().manual_axes == ("data", "fsdp", "tensor")
        step = jax.value_and_grad(
            lambda x, k, q: _dense_loss(x, replicated_kernel(k), q, cotangent),
            argnums=(0, 1, 2),
            has_aux=True,
        )
        (_, out), (d_x, d_kernel, new_state) = step(x, kernel, quantizer_set)
        if not check_vma:
            d_kernel = jax.lax.psum(d_kernel, "data")
        return out, d_x, d_kernel, new_state

    with use_sharding("dp", {"data": 8}) as mesh:
        if where == "inside":
            fn = jax.shard_map(
                inside,
                mesh=mesh,
                in_specs=(data, P(), P(), data),
                out_specs=(data, data, P(), P()),
                check_vma=check_vma,
            )
            out, d_x, d_kernel, new_state = jax.jit(fn)(x, kernel, quantizer_set, cotangent)
        else:

            def body(x, kernel, quantizer_set, cotangent):
                value, out = _dense_loss(x, replicated_kernel(kernel), quantizer_set, cotangent)
                return jax.lax.psum(value, "data"), out

            fn = jax.shard_map(
                body, mesh=mesh, in_specs=(data, P(), P(), data), out_specs=(P(), data)
            )
            outer = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)
            (_, out), (d_x, d_kernel, new_state) = jax.jit(outer)(
                x, kernel, quantizer_set, cotangent
            )
    # pmax over the manual axes: every device quantized with the global amax.
    _assert_same_state(new_state, expected_state)
    assert float(new_state.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert_close(out, expected_out, VALUE_TOLERANCE, "out")
    assert_close(d_x, expected_dx, VALUE_TOLERANCE, "d x")
    assert_close(d_kernel, expected_dkernel, VALUE_TOLERANCE, "d kernel")


def test_dense_in_shard_map_differentiates_a_replicated_kernel_like_a_plain_dot():
    # Under shard_map's default check_vma the gradient of a replicated (unmapped) operand is
    # summed over the devices by autodiff: a plain dot gets the global kernel gradient. dense
    # must give the same, not a custom_vjp type error about manual axes.
    x, kernel, cotangent, _ = _shard_map_problem()

    def plain_loss(x, kernel, cotangent):
        return jnp.sum(jnp.einsum("bsh,hf->bsf", x, kernel) * cotangent)

    def dense_loss(x, kernel, cotangent):
        return jnp.sum(dense(x, kernel) * cotangent)

    expected = jax.grad(plain_loss, argnums=1)(x, kernel, cotangent)
    mesh = make_mesh({"data": 8})
    for loss in (plain_loss, dense_loss):
        fn = jax.shard_map(
            jax.grad(loss, argnums=1),
            mesh=mesh,
            in_specs=(P("data"), P(), P("data")),
            out_specs=P(),
        )
        assert_close(jax.jit(fn)(x, kernel, cotangent), expected, VALUE_TOLERANCE, loss.__name__)


# ----------------------------------------------------------------------------- helpers


def test_make_mesh_gives_missing_axes_size_one_and_auto_axis_types():
    mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert list(mesh.devices.flat) == jax.devices()[:4]
    assert dict(make_mesh({}, devices=jax.devices()[:1]).shape) == {
        "data": 1,
        "fsdp": 1,
        "tensor": 1,
    }
    assert dict(make_mesh({"data": 2, "fsdp": 4}).shape) == {"data": 2, "fsdp": 4, "tensor": 1}


def test_make_mesh_refuses_unknown_axes_and_wrong_device_counts():
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]; the axes are"):
        make_mesh({"data": 2, "model": 4})
    with pytest.raises(ValueError, match=r"has 4 devices, not 8"):
        make_mesh({"data": 2, "tensor": 2})
    with pytest.raises(ValueError, match=r"has 8 devices, not 4"):
        make_mesh({"fsdp": 8}, devices=jax.devices()[:4])


def test_every_shipped_rule_set_loads_and_names_only_mesh_axes():
    names = sorted(path.stem for path in RULES_DIR.glob("*.yaml"))
    assert names == ["cp", "dp", "dp_fsdp_tp", "ep", "fsdp", "tp", "tp_sp"]
    for name in names:
        rules = load_axis_rules(name)
        assert rules == load_axis_rules(RULES_DIR / f"{name}.yaml")
        for logical, mesh_axes in rules:
            axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
            assert set(axes) <= {"data", "fsdp", "tensor", "context"}, (name, logical)
    assert dict(load_axis_rules("dp_fsdp_tp"))["batch"] == ("data", "fsdp")
    assert dict(load_axis_rules("tp_sp"))["length"] == "tensor"


def test_load_axis_rules_refuses_an_unknown_rule_set_with_the_known_ones():
    with pytest.raises(FileNotFoundError, match=r"no rule set 'ddp'; the shipped ones are \["):
        load_axis_rules("ddp")
    with pytest.raises(FileNotFoundError, match=r"no rule set"):
        load_axis_rules("/nonexistent/rules.yaml")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "rules: [batch, data]",
        "rules:\n  - [batch]",
        "rules:\n  - [batch, data, fsdp]",
        "rules:\n  - [1, data]",
        "axis_rules:\n  - [batch, data]",
        "rules: {batch: data}",
    ],
    ids=[
        "empty",
        "flat-list",
        "one-element",
        "three-elements",
        "non-string-name",
        "no-rules-key",
        "mapping",
    ],
)
def test_load_axis_rules_refuses_malformed_files(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(
        ValueError, match=r"expected 'rules: \[\[logical_name, mesh_axes\], \.\.\.\]'"
    ):
        load_axis_rules(path)


def test_load_axis_rules_names_the_file_of_invalid_yaml(tmp_path):
    # A rule set that is not YAML at all is refused like a malformed one: a ValueError that
    # names the file, not a parser error about "<unicode string>".
    path = tmp_path / "broken.yaml"
    path.write_text("rules: [[batch, data]\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_axis_rules(path)


def test_load_axis_rules_reads_a_custom_file(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("rules:\n  - [batch, [data, fsdp]]\n  - [mlp, tensor]\n  - [embed, null]\n")
    rules = load_axis_rules(path)
    assert rules[:3] == (("batch", ("data", "fsdp")), ("mlp", "tensor"), ("embed", None))
    # The layers' other logical names are replicated explicitly, once each.
    given = ("batch", "mlp", "embed")
    assert dict(rules[3:]) == {name: None for name in LOGICAL_AXES if name not in given}


def test_use_sharding_activates_the_mesh_and_rules_and_restores_them():
    assert jax.sharding.get_abstract_mesh().empty
    with use_sharding("tp", {"data": 2, "tensor": 4}) as mesh:
        assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
        assert dict(jax.sharding.get_abstract_mesh().shape) == dict(mesh.shape)
        assert nn.get_logical_axis_rules() == load_axis_rules("tp")
        out = jax.jit(lambda x: with_logical_constraint(x * 2.0, ("batch", "mlp")))(
            jnp.ones((4, 8))
        )
        assert _spec(out) == ("data", "tensor")
    assert jax.sharding.get_abstract_mesh().empty
    assert not nn.get_logical_axis_rules()


def test_use_sharding_refuses_bad_arguments_and_leaves_nothing_active():
    with (
        pytest.raises(FileNotFoundError, match="no rule set 'nope'"),
        use_sharding("nope", {"data": 8}),
    ):
        pass
    with pytest.raises(ValueError, match="unknown mesh axes"), use_sharding("dp", {"pipeline": 8}):
        pass
    with pytest.raises(ValueError, match="has 2 devices, not 8"), use_sharding("dp", {"data": 2}):
        pass
    assert jax.sharding.get_abstract_mesh().empty
    assert not nn.get_logical_axis_rules()


@pytest.mark.parametrize(
    "recipe",
    [MXFP8BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True)],
    ids=["mxfp8", "nvfp4"],
)
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_block_scaled_sharded_step_equals_the_single_device_step(framework, recipe):
    # Blocks run along the global tensors' contractions, whatever the sharding; NVFP4's tensor
    # scale is the global amax.
    expected_out, expected = _run(framework, "layernorm_mlp", recipe, None)[:2]
    out, grads, _ = _run(framework, "layernorm_mlp", recipe, "dp_fsdp_tp")
    assert not grads["fp8"] and not expected["fp8"]
    assert_close(out, expected_out, VALUE_TOLERANCE, "output")
    for name, grad in grads["params"].items():
        assert_close(grad, expected["params"][name], VALUE_TOLERANCE, f"d {name}")
