"""What TE's ``examples/jax/encoder/common.py`` provides, and the built-in data.

TE's example reads GLUE CoLA with ``datasets`` and tokenizes it with ``nltk``; this one builds a
synthetic task instead, with a fixed seed and no downloads, in the same layout as TE's
``data_preprocess`` returns: ``sentence`` int32 ``[n, max_seq_len]`` token ids (0 is padding),
``label`` ``[n]`` and ``mask`` ``[n, 1, max_seq_len, max_seq_len]``, True where a query may not
attend a key (TE's convention: True masks out).

The task: does the sentence contain the token ``MARKER``? Sentences have between 4 and
``max_seq_len`` tokens, drawn from the rest of the vocabulary; half of them get the marker at
one to three random positions. Labels are int32 (TE's are float32; see ``encoder.py``).
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np

from te_flax.quantize import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

__all__ = [
    "MARKER",
    "RECIPES",
    "VOCAB_SIZE",
    "get_datasets",
    "get_quantization_recipe_from_name_string",
]

VOCAB_SIZE = 64  # token ids 0 (padding) .. 63
MARKER = 1
MIN_SEQ_LEN = 4
RECIPES = {
    "DelayedScaling": DelayedScaling,
    "Float8CurrentScaling": Float8CurrentScaling,
    "MXFP8BlockScaling": MXFP8BlockScaling,
    "NVFP4BlockScaling": NVFP4BlockScaling,
}


def get_quantization_recipe_from_name_string(name: str):
    """Query recipe from a given name string (TE's recipe class names)."""
    if name not in RECIPES:
        raise ValueError(f"Invalid fp8_recipe, got {name!r}; use one of {sorted(RECIPES)}")
    return RECIPES[name]()


def synthetic_dataset(size: int, max_seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """``size`` sentences of the marker task, in TE's ``data_preprocess`` layout."""
    if max_seq_len < MIN_SEQ_LEN:
        raise ValueError(f"max_seq_len must be at least {MIN_SEQ_LEN}, got {max_seq_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_SEQ_LEN, max_seq_len + 1, size)  # [n]
    words = rng.integers(MARKER + 1, VOCAB_SIZE, (size, max_seq_len))  # [n, seq], no marker
    labels = rng.integers(0, 2, size).astype(np.int32)  # [n], balanced
    for j in np.flatnonzero(labels):
        count = rng.integers(1, 4)
        words[j, rng.integers(0, lengths[j], count)] = MARKER
    positions = np.arange(max_seq_len)[None, :]  # [1, seq]
    sentence = np.where(positions < lengths[:, None], words, 0).astype(np.int32)  # [n, seq]
    # [n, 1, seq, seq]: Flax's mask (True: attend) from the padding, inverted to TE's.
    mask = np.logical_not(nn.make_attention_mask(sentence > 0, sentence > 0, dtype=np.bool_))
    return {"sentence": sentence, "label": labels, "mask": np.asarray(mask)}


def get_datasets(max_seq_len: int, train_size: int = 8192, test_size: int = 1024, seed: int = 0):
    """Train and test sets of the marker task, and the vocabulary size (TE's return values)."""
    train_ds = synthetic_dataset(train_size, max_seq_len, seed)
    test_ds = synthetic_dataset(test_size, max_seq_len, seed + 1)
    return train_ds, test_ds, VOCAB_SIZE
