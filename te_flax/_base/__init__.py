"""Base of every layer of the design: the private JAX internals te_flax uses (``jax_compat``),
input checks (``checks``), scoped settings (``settings``) and the sharding helpers of
``Explicit`` mesh axes (``explicit_sharding``, public through ``te_flax.sharding``)."""
