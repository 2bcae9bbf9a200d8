"""Benchmarks of te_flax against the same layers written with Flax alone.

``python -m bench`` runs the CPU and deviceless-H100 suite and writes ``bench/RESULTS.md``,
``bench/results.json`` and ``bench/results.png``; ``python -m bench.gpu`` runs the comparison on
a GPU. Importing this package imports nothing else (the entry points set JAX's environment
before JAX starts).
"""
