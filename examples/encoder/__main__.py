"""``python -m examples.encoder [--epochs N] [--batch-size N] [--use-fp8] [--fp8-recipe NAME]``"""

from __future__ import annotations

from .encoder import encoder_parser, train_and_evaluate

if __name__ == "__main__":
    train_and_evaluate(encoder_parser(None))
