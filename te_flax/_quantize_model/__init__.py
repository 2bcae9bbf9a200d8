"""``te_flax.quantize_model``'s core: how a stock Flax model's matrix products are planned, run
in FP8 and, as a fallback, intercepted (``products``), and which products a model's call leaves
bare (``bare_products``). The Linen and NNX front ends are ``linen/quantized.py`` and
``nnx/quantized.py``; the public entry point is ``te_flax.inject``."""
