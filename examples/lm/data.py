"""Built-in training text: the Python standard library's own source, as bytes.

The files are a fixed list of long-lived modules, read in a fixed order, so every machine with
Python 3.11+ builds (nearly) the same corpus with no download. The last 10% is held out.
Batches are drawn at offsets derived from (seed, step), so a resumed run sees the same data.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import jax
import numpy as np

__all__ = ["Corpus", "load_corpus"]

_STDLIB_FILES = (
    "argparse.py", "ast.py", "calendar.py", "collections/__init__.py", "csv.py",
    "dataclasses.py", "datetime.py", "decimal.py", "difflib.py", "email/message.py",
    "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py", "inspect.py",
    "ipaddress.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "pickle.py", "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py",
    "tarfile.py", "textwrap.py", "threading.py", "typing.py", "unittest/case.py",
    "urllib/parse.py", "uuid.py", "zipfile/__init__.py",
)  # fmt: skip


class Corpus:
    """Byte tokens split into train and eval parts."""

    def __init__(self, data: np.ndarray, eval_fraction: float = 0.1):
        split = int(len(data) * (1 - eval_fraction))
        self.train, self.eval = data[:split], data[split:]

    def batch(self, split: str, seed: int, step: int, batch: int, seq_len: int):
        """``(inputs, targets)``, each ``int32[batch, seq_len]``, for one step."""
        data = self.train if split == "train" else self.eval
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} text has {len(data)} bytes; need > seq_len + 1")
        seed = seed + (split == "eval") * 1_000_003
        starts = np.asarray(_starts(seed, step, len(data) - seq_len - 1, batch))
        windows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32, copy=False)
        return jax.device_put((windows[:, :-1], windows[:, 1:]))


# The draw compiled once instead of dispatched op by op on every call (the same numbers): a
# small model's step takes a few milliseconds, and the eager draw took another one or two. The
# key is made inside, so that no array of one run's devices outlives it into the next run's.
@functools.partial(jax.jit, static_argnums=3)
def _starts(seed, step, high, batch: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.randint(key, (batch,), 0, high)


def load_corpus(path: str | None = None) -> Corpus:
    """The text of ``path`` (any file, read as bytes), or the built-in standard-library text."""
    if path is not None:
        data = Path(path).read_bytes()
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        parts = [(root / name).read_bytes() for name in _STDLIB_FILES if (root / name).exists()]
        data = b"\n".join(parts)
    if len(data) < 10_000:
        raise ValueError(f"the training text has {len(data)} bytes; give at least 10 kB")
    return Corpus(np.frombuffer(data, np.uint8).astype(np.int32))
