"""``python -m te_flax``: prints what ``te_flax.show_config()`` prints.

``python -m te_flax explain MODULE:FUNCTION [--target h100]`` prints ``te_flax.explain``'s
report of a program: ``FUNCTION`` (in the module ``MODULE``, or in the file ``MODULE`` when it
ends in ``.py``) takes no arguments and returns ``(fn, args)`` or ``(fn, args, kwargs)``, the
function to compile and its example arguments (arrays or ``jax.ShapeDtypeStruct``).

``python -m te_flax run [--shadow-installed] (-m MODULE | SCRIPT) [ARGS...]`` runs a program
with TransformerEngine's import paths served by te_flax (``te_flax.as_transformer_engine``),
e.g. ``python -m te_flax run -m maxtext.trainers.pre_train.train CONFIG.yml ...``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from te_flax._explain import TARGETS, explain
from te_flax._te_paths import as_transformer_engine
from te_flax._tools.show_config import show_config

_USAGE = (
    "python -m te_flax [explain MODULE:FUNCTION [--target TARGET] | "
    "run [--shadow-installed] (-m MODULE | SCRIPT) [ARGS...]]"
)
_RUN_USAGE = "python -m te_flax run [--shadow-installed] (-m MODULE | SCRIPT) [ARGS...]"


class _UsageError(Exception):
    """A command line that names no program ``explain`` can compile."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m te_flax",
        usage=_USAGE,
        description="Without a command: the versions, backend and devices (show_config).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    explained = commands.add_parser(
        "explain",
        usage="python -m te_flax explain MODULE:FUNCTION [--target TARGET]",
        help="which GEMMs of a compiled program run in FP8, and where",
        description="Prints te_flax.explain's report of the program FUNCTION gives: a "
        "function of no arguments that returns (fn, args) or (fn, args, kwargs).",
    )
    explained.add_argument(
        "program", metavar="MODULE:FUNCTION", help="e.g. my_model:train_step or model.py:step"
    )
    explained.add_argument("--target", default="h100", choices=TARGETS, help="default: h100")
    commands.add_parser(
        "run",
        usage=_RUN_USAGE,
        help="run a program with TransformerEngine's import paths served by te_flax",
        description="Switches te_flax.as_transformer_engine() on, then runs the module (-m) or "
        "script with the arguments that follow, as python would.",
    )
    return parser


def _run(argv: list[str]) -> int:
    """``run``: the switch on, then the module or script with its own arguments."""
    shadow = bool(argv) and argv[0] == "--shadow-installed"
    program = argv[1:] if shadow else argv
    if program[:1] in (["-h"], ["--help"]):
        print(f"usage: {_RUN_USAGE}")
        return 0
    if not program or program == ["-m"]:
        print(f"usage: {_RUN_USAGE}\nrun: name a module (-m MODULE) or a script", file=sys.stderr)
        return 2
    as_transformer_engine(shadow_installed=shadow)
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path.insert(0, str(Path(program[0]).resolve().parent))  # as python puts it
        runpy.run_path(program[0], run_name="__main__")
    return 0


def _load(spec: str) -> Callable[[], Any]:
    """The function ``FUNCTION`` of ``MODULE:FUNCTION`` (a module name or a ``.py`` file)."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise _UsageError(f"expected MODULE:FUNCTION (e.g. my_model:train_step), got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        file_spec = importlib.util.spec_from_file_location(path.stem, path)
        if file_spec is None or file_spec.loader is None or not path.is_file():
            raise _UsageError(f"no Python file {module_name!r}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[path.stem] = module
        file_spec.loader.exec_module(module)
    else:
        if "" not in sys.path:  # the working folder, as ``python`` has it
            sys.path.insert(0, "")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise  # the module imports something missing: its own traceback says what
            raise _UsageError(
                f"no module {module_name!r} here: run from the folder that holds it, or name "
                "its file (path/to/model.py:FUNCTION)"
            ) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise _UsageError(f"{module_name} has no function {function_name!r}")
    return function


def _program(function: Callable[[], Any], spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    made = function()
    if not (isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0])):
        raise _UsageError(
            f"{spec} must return (fn, args) or (fn, args, kwargs): the function to compile and "
            f"its arguments; it returned {type(made).__name__}"
        )
    fn, args, *rest = made
    return fn, tuple(args), dict(rest[0]) if rest else {}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 for a wrong command line)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["run"]:
        return _run(arguments[1:])
    parser = _parser()
    options = parser.parse_args(arguments)
    if options.command is None:
        show_config()
        return 0
    try:
        fn, args, kwargs = _program(_load(options.program), options.program)
    except _UsageError as error:
        parser.error(str(error))  # the usage and the error on stderr, exit status 2
    print(explain(fn, *args, target=options.target, **kwargs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
