"""te_flax: FP8 training layers for Flax Linen and NNX, with TransformerEngine's JAX API.

The functional ops live in ``te_flax.layernorm``, ``te_flax.dense`` and
``te_flax.layernorm_dense``; recipes and quantizer state in ``te_flax.quantize``.
``quantize_model`` runs a model written with Flax's own layers in FP8. ``explain`` says which
GEMMs of a compiled step run in FP8; ``inspect_fp8`` records the FP8 statistics of every GEMM
operand (saturation, underflow, scales), which ``fp8_stats_table`` and ``plot_fp8_stats`` show.
``as_transformer_engine()`` (or ``TE_FLAX_AS_TRANSFORMER_ENGINE=1`` before this import) serves
TransformerEngine's import paths (``transformer_engine.jax...``) from te_flax.
"""

import importlib.metadata

from te_flax._explain import explain
from te_flax._te_paths import as_transformer_engine, from_environment
from te_flax._tools.explain import CollectiveInfo, ExplainReport, GemmInfo
from te_flax._tools.fp8_stats import fp8_stats_table, plot_fp8_stats
from te_flax._tools.show_config import show_config
from te_flax.inject import DEFAULT_RULES, QuantizeModelNote, QuantizeRule, quantize_model
from te_flax.quantize.autocast import autocast, fp8_autocast
from te_flax.quantize.inspection import inspect_fp8
from te_flax.sharding import MeshResource

try:
    # One source for the version: the installed package's metadata (pyproject.toml's version).
    __version__: str = importlib.metadata.version("te-flax")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"

__all__ = [
    "DEFAULT_RULES",
    "CollectiveInfo",
    "ExplainReport",
    "GemmInfo",
    "MeshResource",
    "QuantizeModelNote",
    "QuantizeRule",
    "__version__",
    "as_transformer_engine",
    "autocast",
    "explain",
    "fp8_autocast",
    "fp8_stats_table",
    "inspect_fp8",
    "plot_fp8_stats",
    "quantize_model",
    "show_config",
]

from_environment()  # TE_FLAX_AS_TRANSFORMER_ENGINE=1: TransformerEngine's import paths, on request
