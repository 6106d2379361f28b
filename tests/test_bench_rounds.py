"""benchmarks/rounds.py: the median's order-statistic interval (ranks against exact binomial sums and the
classic table; coverage on simulated rounds)."""
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from rounds import median_ci_ranks, spread  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.parametrize("n,ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (41, (14, 28))])
def test_ranks_match_the_table(n, ranks):
    assert median_ci_ranks(n) == ranks


@pytest.mark.parametrize("n", range(6, 80))
def test_ranks_are_the_widest_inside_the_tail(n):
    k, _ = median_ci_ranks(n)
    below = lambda j: sum(math.comb(n, i) for i in range(j)) / 2 ** n   # P(X ≤ j − 1)
    assert below(k) <= 0.025 < below(k + 1)


def test_too_few_rounds_have_no_interval():
    assert median_ci_ranks(5) is None
    assert spread([1.0, 2.0, 3.0])["ci95"] is None


def test_spread_reads_the_sorted_values():
    s = spread([5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 0.5, 7.0, 6.0, 8.0])
    assert s["ci95"] == [1.0, 8.0] and s["median"] == 4.5 and (s["min"], s["max"]) == (0.5, 9.0)


def test_the_interval_covers_the_median_at_least_95_percent_of_the_time():
    rng = np.random.default_rng()
    trials, n, covered = 4000, 15, 0
    for _ in range(trials):
        ci = spread(list(rng.lognormal(0.0, 0.3, n)))["ci95"]   # true median 1.0
        covered += ci[0] <= 1.0 <= ci[1]
    assert covered / trials > 0.95 - 3 * math.sqrt(0.05 * 0.95 / trials)


def test_each_round_starts_one_job_later():
    """The in-process benchmarks ran their variants in one order every round, the baseline always first."""
    from rounds import rotated  # pylint: disable=import-outside-toplevel
    jobs = {"current": 1, "a": 2, "b": 3}
    orders = [[name for name, _ in rotated(jobs.items(), r)] for r in range(4)]
    assert orders == [["current", "a", "b"], ["a", "b", "current"], ["b", "current", "a"], ["current", "a", "b"]]
    assert rotated([], 3) == [] and rotated(("xla", "onednn"), 1) == ["onednn", "xla"]
    firsts = [rotated(jobs.items(), r)[0][0] for r in range(30)]
    assert all(firsts.count(name) == 10 for name in jobs)      # every job first in a third of the rounds
