"""Type-checked with the library (``files`` in pyproject.toml's mypy section), never run: the NNX
constructors' options are visible to mypy. Each misspelt or mistyped option below must be an
error, or its ``type: ignore`` is unused, which strict mypy reports. (A function, so that
importing the file, as pytest's doctest collection does, builds nothing.)"""

from flax import nnx

import te_flax.nnx as te_nnx


def constructors() -> None:
    rngs = nnx.Rngs(0)
    te_nnx.DenseGeneral(8, 4, rngs=rngs, use_bias=False, kernel_axes=("embed", "mlp"))
    te_nnx.LayerNormMLP(8, intermediate_dim=32, activations=("silu", "linear"), rngs=rngs)
    te_nnx.LayerNorm(8, layernorm_type="rmsnorm", epsilon=1e-5, rngs=rngs)
    te_nnx.TransformerLayer(hidden_size=8, mlp_hidden_size=32, rngs=rngs)

    te_nnx.DenseGeneral(8, 4, rngs=rngs, use_bais=False)  # type: ignore[call-arg]
    te_nnx.LayerNormMLP(8, intermediate_dim="32", rngs=rngs)  # type: ignore[arg-type]
    te_nnx.LayerNorm(8, epsilon=1e-5)  # type: ignore[call-arg]
