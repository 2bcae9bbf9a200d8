"""A stock NNX language model (Flax's own layers, as a model zoo writes them) trained in FP8 by
one call to ``te_flax.quantize_model``, against the same model in BF16."""
