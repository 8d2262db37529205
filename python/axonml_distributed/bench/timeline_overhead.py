"""What the timeline costs (``python -m axonml_distributed.bench --timeline-overhead``): a 1 MiB all_reduce
and DDP's `sync_gradients` on a model of ``--ddp-params`` float32 parameters (25M by default), on an
in-process world of the first of ``--ranks`` ranks, timed with the timeline off and on in the same run.

Rounds alternate the two (off then on, then on then off, ...), so that a drift of the machine's speed
weighs on both alike; each round times one loop of calls per case (`threads.time_op`), the timeline
written at the end of each "on" round, outside the timed loops. It prints each case's median time per
call (the slowest rank's) off and on, and the median of the rounds' on/off ratios with its quartiles and
its 95% confidence interval (`median_ci`, from the ranks of the sorted ratios: no assumption on their
spread): each ratio compares an "on" loop with the "off" loop right beside it, so a loaded machine's slow
spells, which move both medians, cancel in it. Many short rounds resolve a small difference better than a
few long ones; the interval says whether a run resolved the 2% the timeline may cost.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from axonml_distributed._core import ProcessGroup, ReduceOp
from axonml_distributed.bench.threads import _Model, iterations, time_op
from axonml_distributed.ddp import DistributedDataParallel
from axonml_distributed.spawn import spawn
from axonml_distributed.trace import timeline_file

MESSAGE = 1 << 20
MODES = ("off", "on")
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median of `values`: the order statistics whose
    ranks the binomial(n, 1/2) count of values below the median reaches with 95% probability (normal
    approximation of its ranks, rounded outwards; the whole range below 6 values)."""
    xs = sorted(values)
    n = len(xs)
    half = Z95 * math.sqrt(n) / 2
    low = max(math.floor(n / 2 - half), 1)
    high = min(math.ceil(n / 2 + 1 + half), n)
    return xs[low - 1], xs[high - 1]


def measure(
    ranks: int, params: int, ddp_iters: int, rounds: int, timeout: float
) -> dict[str, dict[str, Any]]:
    """Per case, the median seconds per call with the timeline "off" and "on" (slowest rank), the
    quartiles of the rounds' on/off ratios ("ratio": lower quartile, median, upper quartile) and the 95%
    interval of their median ("ratio_ci")."""
    path = os.path.join(tempfile.mkdtemp(prefix="axonml-timeline-bench-"), "timeline.json")

    def rank_fn(pg: ProcessGroup) -> dict[str, dict[str, list[float]]]:
        x = np.ones(MESSAGE // 4, np.float32)
        ddp = DistributedDataParallel(_Model(params, pg.rank()), pg)
        cases: dict[str, tuple[Callable[[], object], int]] = {
            "all_reduce 1 MiB": (functools.partial(pg.all_reduce, x, ReduceOp.SUM), iterations(MESSAGE)),
            f"sync_gradients {params:,} params": (ddp.sync_gradients, ddp_iters),
        }
        times: dict[str, dict[str, list[float]]] = {case: {m: [] for m in MODES} for case in cases}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                # Rank 0 turns the process's timeline on or off while every rank waits.
                pg.barrier()
                if mode == "on" and pg.rank() == 0:
                    timeline_file.start(path)
                pg.barrier()
                for case, (op, iters) in cases.items():
                    times[case][mode].append(time_op(pg, op, iters, rounds=1))
                pg.barrier()
                if mode == "on" and pg.rank() == 0:
                    timeline_file.finish()
        return times

    per_rank = spawn(rank_fn, ranks, timeout=timeout)
    os.unlink(path)
    os.rmdir(os.path.dirname(path))
    result: dict[str, dict[str, Any]] = {}
    for case in per_rank[0]:
        slowest = {
            mode: [max(t) for t in zip(*(r[case][mode] for r in per_rank), strict=True)] for mode in MODES
        }
        result[case] = {mode: statistics.median(slowest[mode]) for mode in MODES}
        ratios = [on / off for off, on in zip(slowest["off"], slowest["on"], strict=True)]
        result[case]["ratio"] = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        result[case]["ratio_ci"] = median_ci(ratios)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks = args.ranks[0]
    print(f"timeline off against on, {ranks} ranks (threads), {args.timeline_rounds} rounds each")
    print(f"{'case':>34} {'off':>11} {'on':>11} {'on/off, median of rounds [quartiles] (95% CI)':>50}")
    report: dict[str, Any] = {"ranks": ranks, "cases": []}
    for case, t in measure(
        ranks, args.ddp_params, args.ddp_iters, args.timeline_rounds, args.timeout
    ).items():
        low, ratio, high = t["ratio"]
        ci = t["ratio_ci"]
        report["cases"].append(
            {
                "case": case,
                "off_s": t["off"],
                "on_s": t["on"],
                "ratio": ratio,
                "ratio_quartiles": [low, high],
                "ratio_ci95": list(ci),
            }
        )
        times = f"{t['off'] * 1e6:>9.1f}us {t['on'] * 1e6:>9.1f}us"
        print(f"{case:>34} {times} {ratio:>14.3f} [{low:.3f}, {high:.3f}] ({ci[0]:.3f}, {ci[1]:.3f})")
    return report
