"""The package layout's rules (docs/architecture.md), checked on the source: imports point one way
(no cycle, no import hidden in a function or under ``TYPE_CHECKING`` but for optional
dependencies), no private name is imported from another module, and files and functions stay
small enough to read whole."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "te_flax"
MAX_FILE_LINES = 600
MAX_FUNCTION_CODE_LINES = 80
# Imported where they are used: installed only with an extra, or heavy and needed by one tool.
OPTIONAL = {"orbax", "tokamax", "matplotlib", "omegaconf", "tqdm", "yaml", "jaxlib", "pytest"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _target(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str) -> Iterator[tuple[str, str | None, ast.AST]]:
    """(imported module, imported name or None, node) for every te_flax import of ``module``."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node
        elif isinstance(node, ast.ImportFrom):
            target = _target(module, path, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, None, node
                else:
                    yield target, alias.name, node


def _graph() -> dict[str, set[str]]:
    return {
        module: {t for t, _, _ in _imports(module) if t in MODULES and t != module}
        for module in MODULES
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle():
    # Package __init__ files re-export their children: an edge from a child to its own package's
    # __init__ is the re-export, not a cycle of the design, so it is left out.
    graph = {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in _graph().items()
    }
    assert _cycles(graph) == []


# The rows of docs/architecture.md: a module imports from its own row or a lower one.
ROWS = {
    "te_flax._base": 0,
    "te_flax.sharding": 1,
    "te_flax.collective": 1,
    "te_flax._tools": 1,
    "te_flax.quantize": 2,
    "te_flax._ops": 3,
    **dict.fromkeys(
        [
            *("dense", "layernorm", "layernorm_dense", "layernorm_mlp", "activation"),
            *("attention", "permutation", "router", "_parallel", "ep"),
        ],
        4,
    ),
    **dict.fromkeys(["_layers", "_quantize_model", "moe"], 5),
    **dict.fromkeys(["linen", "nnx", "training", "accumulate"], 6),
    **dict.fromkeys(["inject", "convert", "__main__"], 7),
    "te_flax": 7,
}


def _row(module: str) -> int:
    """The row of ``module``: that of its longest listed prefix."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        for key in (prefix, prefix.removeprefix("te_flax.")):
            if key in ROWS:
                return ROWS[key]
    raise AssertionError(f"{module} is in no row of docs/architecture.md")


def test_imports_point_down():
    upward = [
        f"{module} (row {_row(module)}) imports {target} (row {_row(target)})"
        for module, targets in _graph().items()
        for target in targets
        if _row(target) > _row(module) and not module.startswith(target + ".")
    ]
    assert upward == []


def _enclosing(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def test_imports_at_module_level_but_for_optional_dependencies():
    hidden = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        parents = _enclosing(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [_target(module, path, node)]
            )
            if all(name.split(".")[0] in OPTIONAL for name in names):
                continue
            parent = parents.get(node)
            while parent is not None and not isinstance(parent, ast.Module):
                if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
                    hidden.append(f"{module}:{node.lineno} (in a function)")
                    break
                if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
                    hidden.append(f"{module}:{node.lineno} (under TYPE_CHECKING)")
                    break
                parent = parents.get(parent)
    assert hidden == []


def test_no_private_name_imported_from_another_module():
    borrowed = [
        f"{module} imports {target}.{name}"
        for module in MODULES
        for target, name, _ in _imports(module)
        if name is not None
        and name.startswith("_")
        and not name.startswith("__")
        and target.startswith("te_flax")
    ]
    assert borrowed == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_library_file_is_small(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{module} has {lines} lines"


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Lines of a function's body that hold code: no blank lines, comments or docstring."""
    body = function.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        body = body[1:] if isinstance(first.value.value, str) else body
    if not body:
        return 0
    lines = source[body[0].lineno - 1 : function.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_functions_are_short():
    long = []
    for module, path in MODULES.items():
        source = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(source))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count = _code_lines(node, source)
                if count > MAX_FUNCTION_CODE_LINES:
                    long.append(f"{module}.{node.name}: {count} code lines")
    assert long == []


# ----------------------------------------------------------------------------- the call's depth

# From a layer's __call__ to lax.dot_general (docs/architecture.md, "How a call flows"): the
# layer's call (its description's, the same for Linen and NNX), its forward from the arrays,
# the public op, the fused-op wrapper (whose custom_vjp rule is its second frame), the op's
# forward rule, the norm+GEMM stage and the GEMM stage.
LAYER_NORM_MLP_WALK = [
    "_layers/linear.py:__call__",
    "_layers/linear.py:forward",
    "layernorm_mlp.py:layernorm_mlp",
    "_ops/custom_op.py:__call__",
    "_ops/custom_op.py:{rule}",
    "layernorm_mlp.py:_forward",
    "_ops/norm_gemm.py:norm_gemm_forward",
    "_ops/gemm.py:gemm",
]


def _frames_to_first_gemm(call) -> list[str]:
    """The te_flax frames on the stack when ``call`` first reaches ``lax.dot_general``,
    outermost first, as ``path:function`` relative to the package."""
    import inspect
    from unittest import mock

    import jax

    found: list[list[str]] = []
    dot_general = jax.lax.dot_general

    def spy(*args, **kwargs):
        if not found:
            stack = inspect.stack(context=0)
            found.append(
                [
                    f"{pathlib.Path(f.filename).relative_to(PACKAGE).as_posix()}:{f.function}"
                    for f in reversed(stack)
                    if pathlib.Path(f.filename).is_relative_to(PACKAGE)
                ]
            )
        return dot_general(*args, **kwargs)

    with mock.patch.object(jax.lax, "dot_general", spy):
        call()
    return found[0]


@pytest.mark.parametrize("front", ["linen", "nnx"])
@pytest.mark.parametrize("differentiated", [False, True], ids=["primal", "grad"])
def test_a_layers_call_reaches_its_gemm_in_seven_steps(front, differentiated):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import te_flax.linen as te_nn
    import te_flax.nnx as te_nnx
    from te_flax.quantize import DelayedScaling

    x = jnp.ones((2, 8, 16), jnp.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    if front == "linen":
        layer = te_nn.LayerNormMLP(intermediate_dim=32, recipe=recipe)
        variables = layer.init(jax.random.key(0), x)
        apply = lambda x: layer.apply(variables, x)[0]  # noqa: E731
    else:
        module = te_nnx.LayerNormMLP(16, intermediate_dim=32, recipe=recipe, rngs=nnx.Rngs(0))
        apply = lambda x: module(x)[0]  # noqa: E731
    if differentiated:
        call = lambda: jax.grad(lambda x: jnp.sum(apply(x).astype(jnp.float32)))(x)  # noqa: E731
    else:
        call = lambda: apply(x)  # noqa: E731
    walk = [
        step.format(rule="op_forward" if differentiated else "op") for step in LAYER_NORM_MLP_WALK
    ]
    assert _frames_to_first_gemm(call) == walk


# ----------------------------------------------------------------------------- one layer, one place


# docs/architecture.md, "How a call flows", step 1: a layer is its description; a module of
# either front end names it as a base and runs its __call__, reaching the front end only
# through its host.
def test_a_layer_is_written_once_for_both_front_ends():
    import inspect

    import te_flax.linen as te_nn
    import te_flax.nnx as te_nnx
    from te_flax._layers.host import Layer

    layers = [name for name in te_nnx.__all__ if hasattr(getattr(te_nnx, name), "description")]
    assert len(layers) == 9, layers  # the four linear layers, MoE, attention, transformer
    for name in layers:
        linen, nnx_module = getattr(te_nn, name), getattr(te_nnx, name)
        description = linen.description
        assert nnx_module.description is description
        assert issubclass(description, Layer) and description in linen.__bases__
        assert description in nnx_module.__bases__
        # The call is the description's: NNX inherits it, Linen wraps it (compact scope) unchanged.
        assert "__call__" in vars(description)
        assert nnx_module.__call__ is description.__call__
        assert inspect.unwrap(linen.__call__) is description.__call__
        # Neither module class writes a call of its own.
        assert "__call__" not in vars(nnx_module)
        assert inspect.signature(linen.__call__) == inspect.signature(nnx_module.__call__)


def test_a_description_alone_says_it_runs_in_a_front_end():
    import jax.numpy as jnp

    from te_flax._layers.linear import DenseGeneralDescription

    with pytest.raises(TypeError, match=r"te_flax\.linen or te_flax\.nnx"):
        DenseGeneralDescription(features=4)(jnp.ones((2, 3)))


def test_a_users_subclass_of_a_layer_runs_and_leaves_the_sublayers_to_te_flax():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import te_flax.linen as te_nn
    import te_flax.nnx as te_nnx
    from te_flax.linen._shell import LinenHost

    class Doubled(te_nn.LayerNormMLP):
        @nn.compact
        def __call__(self, x):
            return super().__call__(x)[0] * 2

    class Plain(te_nnx.LayerNormMLP):
        pass

    x = jnp.ones((2, 8))
    variables = Doubled(intermediate_dim=16).init(jax.random.key(0), x)
    assert sorted(nn.meta.unbox(variables)["params"]) == [
        "ln_bias", "scale", "wi_kernel", "wo_kernel"
    ]  # fmt: skip
    assert Plain(8, intermediate_dim=16, rngs=nnx.Rngs(0))(x)[0].shape == (2, 8)
    # A transformer still builds its MLP from te_flax's own module, not from a subclass.
    layer = te_nn.TransformerLayer(hidden_size=8, mlp_hidden_size=16, num_attention_heads=2)
    built = layer.bind({}, rngs={"params": jax.random.key(0)})
    host = LinenHost(built, built.children(8))
    assert type(host.layer("mlp")) is te_nn.LayerNormMLP
    nnx_layer = te_nnx.TransformerLayer(
        hidden_size=8, mlp_hidden_size=16, num_attention_heads=2, rngs=nnx.Rngs(0)
    )
    assert type(nnx_layer.mlp) is te_nnx.LayerNormMLP
