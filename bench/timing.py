"""Interleaved wall-clock timing: every candidate runs once per round, in a rotating order.

Other processes on the machine then slow all candidates of a round alike, and the ratio of two
candidates is taken round by round (paired), which cancels most of that drift. Each candidate is
warmed up first (compile and first runs excluded).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

__all__ = ["Stats", "interleaved", "paired_ratio", "stats"]

Stats = dict[str, float]


def interleaved(
    runners: dict[str, Callable[[], object]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per call of each runner over ``repeats`` rounds, after ``warmup`` rounds.

    A runner performs one call and returns its (possibly asynchronous) result; the clock stops
    when the result is ready. Round ``r`` starts with runner ``r mod n`` so no runner always
    goes first.
    """
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            jax.block_until_ready(runners[name]())
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def stats(samples: list[float]) -> Stats:
    """Median, min, max and the relative spread (max - min) / median."""
    median = statistics.median(samples)
    return {
        "median": median,
        "min": min(samples),
        "max": max(samples),
        "spread": (max(samples) - min(samples)) / median,
        "n": len(samples),
    }


def paired_ratio(numerator: list[float], denominator: list[float]) -> Stats:
    """Statistics of the round-by-round ratios ``numerator[i] / denominator[i]``."""
    return stats([a / b for a, b in zip(numerator, denominator, strict=True)])
