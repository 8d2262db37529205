"""The timeline overhead bench: it really turns the timeline on for its "on" rounds, takes the slowest rank
per round, and pairs each "on" loop with the "off" loop beside it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from axonml_distributed.bench import timeline_overhead
from axonml_distributed.trace import timeline_file


@pytest.mark.timeout(120)
def test_each_round_pairs_on_with_off_and_takes_the_slowest_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_time_op(pg: Any, op: Any, iters: int, rounds: int = 5) -> float:
        # 2 us off, 3 us on, plus 1 us on rank 1: the slowest rank's on/off is 4/3 in every round.
        op()
        return (3e-6 if timeline_file._active else 2e-6) + pg.rank() * 1e-6

    monkeypatch.setattr(timeline_overhead, "time_op", fake_time_op)
    result = timeline_overhead.measure(ranks=2, params=1000, ddp_iters=1, rounds=5, timeout=60.0)
    assert len(result) == 2
    for t in result.values():
        assert t["off"] == pytest.approx(3e-6)
        assert t["on"] == pytest.approx(4e-6)
        assert t["ratio"] == pytest.approx([4 / 3] * 3)
        assert t["ratio_ci"] == pytest.approx((4 / 3, 4 / 3))
    assert timeline_file._active is None


@pytest.mark.parametrize("n", [6, 25, 100, 300, 1001])
def test_the_median_interval_covers_the_median_95_percent_of_the_time(n: int) -> None:
    """`median_ci` picks order statistics l < h of n values: the true median lies between them unless
    fewer than l or at least h values fall below it, whose probability the binomial(n, 1/2) says
    exactly. Its coverage is at least 95%, and not much more (a wider interval resolves less)."""
    low, high = timeline_overhead.median_ci([float(i) for i in range(n)])
    lo, hi = int(low) + 1, int(high) + 1  # the values are their own 0-based ranks
    coverage = sum(math.comb(n, i) for i in range(lo, hi)) / 2**n
    assert 0.95 <= coverage < 0.99, (lo, hi, coverage)
