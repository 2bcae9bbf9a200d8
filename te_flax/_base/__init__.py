"""Base of every layer of the design: the private JAX internals te_flax uses, and input checks."""
