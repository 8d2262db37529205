"""async_op=True: work handles, issue order, and errors surfacing from wait()."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from reference import data, reduce_ref, same_bits

pytestmark = pytest.mark.timeout(60)


def test_async_collectives_complete_in_issue_order_with_results() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        xs = [data(pg.rank(), 5000 + i, np.float32) for i in range(6)]
        works = [pg.all_reduce(x, ad.ReduceOp.SUM, async_op=True) for x in xs]
        gathered = pg.all_gather_tensor(np.array([pg.rank()], np.int32), async_op=True)
        sync = np.ones(2, np.float64)
        pg.all_reduce(sync)  # a blocking call after queued work waits for it, keeping the order
        assert all(w.is_completed() for w in works)
        for w in works:
            assert w.wait() is None
        return xs, gathered.wait(), sync

    res = ad.spawn(fn, 3)
    for xs, gathered, sync in res:
        for i, x in enumerate(xs):
            assert same_bits(
                x, reduce_ref([data(r, 5000 + i, np.float32) for r in range(3)], ad.ReduceOp.SUM)
            )
        assert gathered.ravel().tolist() == [0, 1, 2]
        assert sync.tolist() == [3.0, 3.0]


def test_errors_resurface_from_wait() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        op = ad.ReduceOp.MAX if pg.rank() == 0 else ad.ReduceOp.SUM
        w = pg.all_reduce(np.ones(4, np.float32), op, async_op=True)
        with pytest.raises(ad.CollectiveMismatchError):
            w.wait()
        with pytest.raises(ad.CollectiveMismatchError):
            w.wait()  # every wait reports the same outcome
        assert w.is_completed()

    ad.spawn(fn, 2)


def test_the_caller_is_free_while_work_runs() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        if pg.rank() == 1:
            # Rank 0's work cannot finish before rank 1 arrives, yet rank 0 keeps running Python.
            import time

            time.sleep(0.3)
            pg.barrier()
            return None
        w = pg.barrier(async_op=True)
        done_early = w.is_completed()
        w.wait()
        return done_early

    assert ad.spawn(fn, 2)[0] is False


def test_comm_helpers_take_async_op() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        x = np.full(3, float(pg.rank()), np.float64)
        w = ad.all_reduce_mean(x, async_op=True)
        w.wait()
        return x.tolist()

    assert ad.spawn(fn, 2) == [[0.5] * 3] * 2


def test_work_completes_while_the_caller_holds_the_gil() -> None:
    # The lane's thread must not need the GIL to finish a work: a caller polling is_completed() in a
    # Python loop holds it (here for good: no switch interval), and must see the work complete.
    pg = ad.ProcessGroup(ad.ThreadBackend.single())
    x = data(0, 5, np.float32)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e6)
    try:
        for _ in range(20):
            work = pg.all_reduce(x, ad.ReduceOp.SUM, async_op=True)
            deadline = time.monotonic() + 10.0
            while not work.is_completed() and time.monotonic() < deadline:
                pass
            assert work.is_completed(), "the work waited for the GIL its caller held"
    finally:
        sys.setswitchinterval(interval)
    assert same_bits(x, data(0, 5, np.float32))


def _threads(backends: list[Any], fn: Any) -> list[Any]:
    """Run fn(rank, backend) on one thread per rank; results (or the exception) in rank order."""
    out: list[Any] = [None] * len(backends)

    def run(r: int) -> None:
        try:
            out[r] = fn(r, backends[r])
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(len(backends))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


@pytest.mark.timeout(120)
def test_two_groups_over_one_backend_match_calls_in_program_order() -> None:
    def fn(rank: int, b: Any) -> list[tuple[float, float]]:
        g1, g2 = ad.ProcessGroup(b), ad.ProcessGroup(b)
        seen = []
        for i in range(200):
            a = np.full(4, 10.0 * (rank + 1) + i, np.float64)  # 10+i and 20+i: sum 30+2i
            c = np.full(4, 1.0 * (rank + 1), np.float64)  # 1 and 2: sum 3
            w = g1.all_reduce(a, async_op=True)
            g2.all_reduce(c)
            w.wait()
            seen.append((float(a[0]), float(c[0])))
        return seen

    for res in _threads(ad.ThreadBackend.create_world(2, timeout=30), fn):
        assert not isinstance(res, BaseException), res
        assert res == [(30.0 + 2 * i, 3.0) for i in range(200)]


@pytest.mark.timeout(120)
def test_a_group_and_direct_backend_calls_match_in_program_order() -> None:
    def fn(rank: int, b: Any) -> list[tuple[float, float]]:
        g = ad.ProcessGroup(b)
        seen = []
        for _ in range(100):
            a = np.full(3, 10.0 * (rank + 1), np.float32)
            c = np.full(3, 1.0 * (rank + 1), np.float32)
            w = g.all_reduce(a, async_op=True)
            b.all_reduce(c)
            w.wait()
            seen.append((float(a[0]), float(c[0])))
        return seen

    for res in _threads(ad.ThreadBackend.create_world(2, timeout=30), fn):
        assert res == [(30.0, 3.0)] * 100, res
