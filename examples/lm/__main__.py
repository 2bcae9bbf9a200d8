"""``python -m examples.lm [compare|train] [--config FILE] [--resume] [--data PATH] [key=value]``

``compare`` (the default) trains the model in FP8 and in BF16 on the same data and seed and
writes ``report.md`` and ``loss.png`` to ``output_dir``; ``train`` runs one configuration.
Overrides use the config's dotted keys, e.g. ``train.steps=100 model.frontend=nnx``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .config import DEFAULT_CONFIG, ConfigError, load_config
from .data import load_corpus
from .report import write_report
from .train import ResumeError, train


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("compare", "train") else "compare"
    parser = argparse.ArgumentParser(prog="python -m examples.lm [compare|train]")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a YAML config file")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--data", help="train on this text file instead of the built-in text")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides) + ([f"data={args.data}"] if args.data else [])
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        parser.error(str(error))  # one line and exit status 2, as for a wrong option
    corpus = load_corpus(config.data)
    progress = not args.no_progress
    if mode == "train":
        result = train(config, "train", resume=args.resume, corpus=corpus, progress=progress)
        print(f"final eval loss {result.eval_loss[-1]:.4f}, {result.tokens_per_s:.0f} tokens/s")
        return 0
    fp8 = (
        config
        if config.train.recipe != "none"
        else dataclasses.replace(config, train=dataclasses.replace(config.train, recipe="delayed"))
    )
    bf16 = dataclasses.replace(config, train=dataclasses.replace(config.train, recipe="none"))
    results = [
        train(fp8, "fp8", resume=args.resume, corpus=corpus, progress=progress),
        train(bf16, "bf16", resume=args.resume, corpus=corpus, progress=progress),
    ]
    path = write_report(fp8, results)
    print(f"wrote {path}")
    return 0


def _main_or_error() -> int:
    try:
        return main()
    except ResumeError as error:  # one line, as for a configuration error
        print(f"python -m examples.lm: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main_or_error())
