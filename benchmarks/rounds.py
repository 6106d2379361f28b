"""Summaries of per-round ratios for the benchmarks: median, spread, and a distribution-free 95% interval.

    spread(values) -> {'median', 'min', 'max', 'per_round', 'ci95'}
    rotated(items, r) -> the jobs of round r in their order: each round starts one later, so none always runs first

`ci95` is the order-statistic confidence interval of the median: with the n values sorted,
(x₍ₖ₎, x₍ₙ₋ₖ₊₁₎) for the largest k with P(Binomial(n, ½) ≤ k − 1) ≤ 0.025, so it covers the true median with
probability ≥ 95% whatever the distribution of the rounds, provided they are independent. None for n < 6, where
even (min, max) covers it with less than 95%.
"""
from __future__ import annotations

import math
import statistics


def median_ci_ranks(n: int, level: float = 0.95) -> tuple[int, int] | None:
    """1-based ranks (k, n − k + 1) of the order-statistic interval for the median, or None if n is too small."""
    tail = (1.0 - level) / 2.0
    k, cumulative = 0, 0.0
    while k < n:
        cumulative += math.comb(n, k) / 2.0 ** n      # now P(X ≤ k)
        if cumulative > tail:
            break
        k += 1
    return (k, n - k + 1) if k >= 1 else None


def spread(values: list[float]) -> dict:
    """Median of `values` with min, max, the values themselves and the median's 95% interval (module docstring)."""
    ranks = median_ci_ranks(len(values))
    ordered = sorted(values)
    ci = [ordered[ranks[0] - 1], ordered[ranks[1] - 1]] if ranks else None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "ci95": ci,
            "per_round": list(values)}


def rotated(items, round_index: int) -> list:
    """`items` (a list, or a dict's items) in round `round_index`'s order: shifted by one more each round, so no job
    always runs first, or always right after the same one."""
    items = list(items)
    shift = round_index % len(items) if items else 0
    return items[shift:] + items[:shift]
