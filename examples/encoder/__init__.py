"""TransformerEngine's JAX encoder example (a sentence classifier) on te_flax.

``python -m examples.encoder --use-fp8`` trains it on a built-in synthetic task; see
``encoder.py`` for the lines that differ from TE's ``test_single_gpu_encoder.py``.
"""
