"""Examples built on te_flax."""
