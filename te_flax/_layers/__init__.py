"""Layer descriptions: what each layer is (parameters, FP8 state, forward), shared by the Linen and
NNX shells."""
