"""Op stages and kernels: the forward and backward stages the custom_vjp ops are built from, the
Pallas kernels behind one switch, and the FP8 products of stock models."""
