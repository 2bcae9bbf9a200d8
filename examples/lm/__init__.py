"""A GPT-style byte-level language model trained with te_flax layers, in FP8 and in BF16.

``python -m examples.lm`` (see ``__main__``) trains it on built-in data and writes a report.
"""
