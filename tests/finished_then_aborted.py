"""A collective every rank finishes, right after which rank 1 makes a call its own checks refuse (a
non-contiguous view), which aborts the world: the finished collective must succeed, with the reference
result, on every rank however late a rank looks, and the next call of every other rank must report the
abort. Run on the thread world (tests/test_threads_faults.py) and the shm world (tests/test_shm_faults.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import axonml_distributed as ad
from conformance import placed
from reference import all_inputs, expect_same, reduce_ref

# Each case: per-member elements, and the collective run on (group, every rank's inputs, this rank,
# how to place a buffer), returning this rank's result and the reference for it. Sizes put each on the
# routes its world has.
Place = Callable[[np.ndarray], np.ndarray]
Run = Callable[[Any, np.ndarray, int, Place], tuple[np.ndarray, np.ndarray]]


def _reduce_scatter(pg: Any, inputs: np.ndarray, me: int, place: Place) -> tuple[np.ndarray, np.ndarray]:
    n = len(inputs)
    recv = place(np.zeros(inputs.shape[1] // n, inputs.dtype))
    pg.reduce_scatter(place(inputs[me]), recv)
    return recv, np.split(reduce_ref(inputs, "SUM"), n)[me]


def _all_reduce(pg: Any, inputs: np.ndarray, me: int, place: Place) -> tuple[np.ndarray, np.ndarray]:
    buf = place(inputs[me])
    pg.all_reduce(buf)
    return buf, reduce_ref(inputs, "SUM")


def _all_gather(pg: Any, inputs: np.ndarray, me: int, place: Place) -> tuple[np.ndarray, np.ndarray]:
    recv = place(np.zeros_like(inputs))
    pg.all_gather(place(inputs[me]), recv)
    return recv, inputs


CASES: dict[str, tuple[int, Run]] = {
    "reduce_scatter": (3 * 1000, _reduce_scatter),  # the issue's
    "reduce_scatter large": (3 * 300_000, _reduce_scatter),
    "all_reduce one-shot": (64, _all_reduce),
    "all_reduce": (200_000, _all_reduce),
    "all_gather": (50_000, _all_gather),
}


def finish_then_abort(pg: Any, case: str, trial: int, segment: bool = False) -> str:
    """Run `case` on this rank (buffers in the group's memory when `segment`; raising unless it gives
    the reference result), then rank 1's refused call and the others' next one; returns what that call
    raised (its type and message)."""
    n, me = pg.size(), pg.rank()
    count, run = CASES[case]
    inputs = all_inputs(n, f"{case}-{trial}", (count,), np.float32)
    got, expected = run(pg, inputs, me, lambda arr: placed(pg, arr, segment))
    expect_same(got, expected, f"{case}, trial {trial}, rank {me}")
    try:
        if me == 1:
            pg.all_reduce(np.ones(8, np.float32)[::2])
        else:
            pg.all_reduce(np.ones(4, np.float32))
    except (ValueError, ad.PeerFailureError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def expect_abort_reported_next(outcomes: list[Any], what: str) -> None:
    """Every rank's `finish_then_abort` returned (no exception: the finished call succeeded with the
    reference result); rank 1 had its call refused and every other rank's next call reported the abort."""
    for rank, after in enumerate(outcomes):
        assert isinstance(after, str), f"{what}, rank {rank}: {after!r}"
        if rank == 1:
            assert after.startswith("ValueError") and "contiguous" in after, f"{what}: {after}"
        else:
            assert after.startswith("PeerFailureError") and "aborted by rank 1" in after, f"{what}: {after}"
