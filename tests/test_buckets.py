"""GradientBucket and GradientSynchronizer against numpy references; sizes no memory could hold are
errors, not crashes; the synchronizer's waits release the GIL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axonml_distributed as ad
from axonml_distributed._core import GradientBucket, GradientSynchronizer, GradSyncStrategy, assign_buckets
from reference import DTYPES, data, reduce_ref, same_bits

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3), min_size=1, max_size=6),
    dtype=st.sampled_from(DTYPES),
)
def test_bucket_round_trips_shapes_and_values(shapes: list[list[int]], dtype: type) -> None:
    grads = [data(i, int(np.prod(s)), dtype).reshape(s) for i, s in enumerate(shapes)]
    bucket = GradientBucket(sum(g.size for g in grads))
    assert all(bucket.add(g) for g in grads)
    assert bucket.is_full() and bucket.size() == sum(g.size for g in grads)
    out = bucket.extract()
    assert len(out) == len(grads) and all(same_bits(a, b) for a, b in zip(out, grads, strict=True))


def test_bucket_overflow_dtype_mixing_and_views() -> None:
    b = GradientBucket(5)
    assert b.is_empty()
    assert b.add(np.array([0.1, 0.2], np.float32))
    assert not b.add(np.ones(4, np.float32)), "overflow adds nothing"
    assert b.size() == 2
    with pytest.raises(ValueError, match="float32"):
        b.add(np.ones(1, np.float64))
    view = b.data_mut()
    view *= 10
    assert same_bits(b.extract()[0], np.array([1.0, 2.0], np.float32)), "data_mut is zero-copy"
    ro = b.data()
    assert not ro.flags.writeable
    with pytest.raises(ValueError):
        ro[0] = 1


def test_the_readme_bucket_flow_averages_in_place() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        b = GradientBucket(1000)
        b.add(data(pg.rank(), 2, np.float32))
        b.add(data(pg.rank(), 3, np.float32).reshape(3, 1))
        pg.backend().all_reduce(b.data_mut(), ad.ReduceOp.AVERAGE)
        return b.extract()

    res = ad.spawn(fn, 3)
    want = [
        reduce_ref([data(r, 2, np.float32) for r in range(3)], ad.ReduceOp.AVERAGE),
        reduce_ref([data(r, 3, np.float32).reshape(3, 1) for r in range(3)], ad.ReduceOp.AVERAGE),
    ]
    for out in res:
        assert all(same_bits(a, b) for a, b in zip(out, want, strict=True))


@pytest.mark.parametrize("strategy", [GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.OVERLAPPED])
@pytest.mark.parametrize("bucket_size", [1, 7, 100, 25_000_000])
def test_synchronizer_writes_averages_back_in_place(strategy: GradSyncStrategy, bucket_size: int) -> None:
    shapes = [(3,), (2, 2), (5,), (1,)]

    def fn(pg: ad.ProcessGroup) -> Any:
        sync = GradientSynchronizer(strategy, bucket_size)
        out = []
        for step in range(2):
            grads = [data(pg.rank() + 10 * step, int(np.prod(s)), np.float32).reshape(s) for s in shapes]
            sync.prepare(len(grads), pg)
            bucket, used = 0, 0
            for g in grads:
                if used and used + g.size > bucket_size:
                    bucket, used = bucket + 1, 0
                sync.add_gradient(bucket, g)
                used += g.size
            sync.sync_all(pg)
            out.append(grads)
        return out

    res = ad.spawn(fn, 3)
    for step in range(2):
        for i, s in enumerate(shapes):
            n = int(np.prod(s))
            want = reduce_ref(
                [data(r + 10 * step, n, np.float32).reshape(s) for r in range(3)], ad.ReduceOp.AVERAGE
            )
            assert all(same_bits(res[r][step][i], want) for r in range(3)), (step, i)


def test_sync_all_without_a_group_averages_over_the_default_group() -> None:
    def fn(pg: ad.ProcessGroup) -> np.ndarray:
        sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, 10)
        g = data(pg.rank(), 7, np.float32)
        sync.prepare(1)
        sync.add_gradient(0, g)
        sync.sync_all()
        return g

    want = reduce_ref([data(r, 7, np.float32) for r in range(2)], ad.ReduceOp.AVERAGE)
    assert all(same_bits(g, want) for g in ad.spawn(fn, 2))


def test_no_sync_leaves_gradients_alone() -> None:
    def fn(pg: ad.ProcessGroup) -> np.ndarray:
        sync = GradientSynchronizer(GradSyncStrategy.NO_SYNC, 10)
        assert sync.strategy() == GradSyncStrategy.NO_SYNC
        g = np.full(3, float(pg.rank()), np.float32)
        sync.prepare(1)
        sync.add_gradient(0, g)
        sync.sync_all(pg)
        return g

    assert [g[0] for g in ad.spawn(fn, 2)] == [0.0, 1.0]


def test_overlapped_buckets_start_before_sync_all() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sync = GradientSynchronizer(GradSyncStrategy.OVERLAPPED, 4)
        sync.prepare(3, pg)
        a, b, c = (np.full(4, float(pg.rank() + i), np.float64) for i in range(3))
        sync.add_gradient(0, a)  # full: its all-reduce starts now, while this thread goes on
        started_early = sync.launched_buckets()
        sync.add_gradient(1, b)
        sync.add_gradient(2, c)  # the last announced gradient completes the last bucket
        launched = sync.launched_buckets()
        sync.sync_all(pg)
        return started_early, launched, (a[0], b[0], c[0])

    assert ad.spawn(fn, 2) == [(1, 3, (0.5, 1.5, 2.5))] * 2


def test_synchronous_strategy_waits_for_sync_all() -> None:
    sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, 1)
    sync.prepare(1, ad.ProcessGroup(ad.ThreadBackend.single()))
    sync.add_gradient(0, np.ones(1, np.float32))
    assert sync.launched_buckets() == 0


def test_synchronizer_refuses_misuse() -> None:
    sync = GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, 2)
    sync.prepare(4)
    sync.add_gradient(0, np.ones(1, np.float32))
    with pytest.raises(ValueError, match="full"):
        sync.add_gradient(0, np.ones(3, np.float32))
    sync.add_gradient(1, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="already complete"):
        sync.add_gradient(0, np.ones(1, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        ro = np.ones(1, np.float32)
        ro.setflags(write=False)
        sync.add_gradient(2, ro)
    with pytest.raises(ValueError):
        GradientSynchronizer(GradSyncStrategy.SYNCHRONOUS, 0)
    assert GradientSynchronizer().bucket_size() == 25_000_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [2**62 + 16, 2**61, 2**64 - 1])
def test_huge_bucket_capacities_are_an_error_not_a_crash(capacity: int) -> None:
    bucket = ad.GradientBucket(capacity)
    with pytest.raises((ValueError, MemoryError)):
        bucket.add(np.ones(4, np.float32))
    assert bucket.size() == 0
    sync = ad.GradientSynchronizer(ad.GradSyncStrategy.SYNCHRONOUS, capacity)
    with pytest.raises((ValueError, MemoryError)):
        sync.add_gradient(0, np.ones(4, np.float32))


@pytest.mark.parametrize("count", [2**64 + 1, -1])
def test_counts_no_buffer_could_hold_are_a_value_error(count: int) -> None:
    with pytest.raises(ValueError, match="element count"):
        ad.GradientBucket(count)
    with pytest.raises(ValueError, match="element count"):
        ad.GradientSynchronizer(ad.GradSyncStrategy.OVERLAPPED, count)


def test_a_bucket_larger_than_memory_is_a_memory_error() -> None:
    with pytest.raises(MemoryError):
        ad.GradientBucket(2**45).add(np.ones(4, np.float64))  # 256 TiB


_GIL_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    import axonml_distributed as ad

    backends = ad.ThreadBackend.create_world(2, timeout=20)
    def rank(r):
        pg = ad.ProcessGroup(backends[r])
        sync = ad.GradientSynchronizer(ad.GradSyncStrategy.OVERLAPPED, 4)
        x = np.ones(1000, np.float32)
        if r == 1:
            time.sleep(0.5)
        w = pg.all_reduce(x, async_op=True)  # a Python-issued job: it needs the GIL to finish
        sync.prepare(1, pg)
        sync.add_gradient(0, np.ones(4, np.float32))  # bucket 0 launched behind it
        sync.prepare(1, pg)  # waits for bucket 0 (with the GIL held before the fix)
        sync.clear()
        w.wait()
        assert x[0] == 2.0
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    print("ok")
    """
)


@pytest.mark.timeout(120)
def test_synchronizer_waits_release_the_gil() -> None:
    p = subprocess.run([sys.executable, "-c", _GIL_SCRIPT], capture_output=True, text=True, timeout=90)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# -- the engine the DDPs use: buckets laid out from the parameters ----------------------------------------

_PARAMS = [((2, 3), np.float32), ((4,), np.float64), ((1,), np.float32), ((5,), np.float32)]


def test_laid_out_buckets_start_in_order_and_average_in_place() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sync = GradientSynchronizer.for_parameters(pg, _PARAMS, 12)
        views = sync.views()
        for i, v in enumerate(views):
            v[...] = data(pg.rank() + i, v.size, v.dtype).reshape(v.shape)
        started = []
        for i in reversed(range(len(views))):
            sync.ready(i)
            started.append(sync.launched_buckets())
        in_flight = sync.in_flight()
        assert sync.finish([True] * len(views), False) is None
        return sync.bucket_assignment(), started, in_flight, sync.in_flight(), [v.copy() for v in views]

    for layout, started, in_flight, after, got in ad.spawn(fn, 3):
        assert layout == assign_buckets([24, 32, 4, 20], [np.float32, np.float64, np.float32, np.float32], 12)
        assert layout == [[3], [2], [1], [0]]
        assert started == [1, 2, 3, 3], "in bucket order as each completes; the last waits for finish"
        assert in_flight and not after
        for i, ((shape, dtype), g) in enumerate(zip(_PARAMS, got, strict=True)):
            want = reduce_ref(
                [data(r + i, g.size, dtype).reshape(shape) for r in range(3)], ad.ReduceOp.AVERAGE
            )
            assert g.dtype == dtype and same_bits(g, want), i


def test_finish_counts_missing_gradients_as_zeros_and_agrees_on_use() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sync = GradientSynchronizer.for_parameters(pg, _PARAMS, 1 << 20)
        views = sync.views()
        for v in views:
            v[...] = 9  # an older step's average: what a missing gradient must not count
        used = [True, False, pg.rank() == 0, False]
        for i, v in enumerate(views):
            if used[i]:
                v[...] = pg.rank() + 1
        sync.ready(0)
        agreed = sync.finish(used, True)
        return agreed, [v.copy() for v in views], sync.waiting()

    for agreed, got, waiting in ad.spawn(fn, 2):
        assert agreed == [True, False, True, False]
        assert [float(g.flat[0]) for g in got] == [1.5, 0.0, 0.5, 0.0]
        assert waiting == [0, 1, 2, 3], "every gradient is out again after finish"


def test_laid_out_buckets_over_a_python_group_use_its_all_reduce() -> None:
    class Recording:  # a group written in Python (as MPI's)
        def __init__(self, pg: ad.ProcessGroup) -> None:
            self.pg, self.calls = pg, []

        def all_reduce(self, buf: np.ndarray, op: Any, *, async_op: bool = False) -> Any:
            self.calls.append((op, buf.size, async_op))
            return self.pg.all_reduce(buf, op, async_op=async_op)

    def fn(pg: ad.ProcessGroup) -> Any:
        group = Recording(pg)
        sync = GradientSynchronizer.for_parameters(group, _PARAMS, 12)
        views = sync.views()
        for v in views:
            v[...] = pg.rank()
        sync.ready(3)
        agreed = sync.finish([True] * 4, True)
        return group.calls, agreed, [float(v.flat[0]) for v in views], sync.in_shared_memory()

    for calls, agreed, got, shared in ad.spawn(fn, 2):
        avg, mx = ad.ReduceOp.AVERAGE, ad.ReduceOp.MAX
        assert calls == [(avg, 5, True), (mx, 4, False), (avg, 1, True), (avg, 4, True), (avg, 6, False)]
        assert agreed == [True] * 4 and got == [0.5] * 4 and not shared


def test_a_python_groups_exception_is_raised_as_it_is() -> None:
    class Failing:
        def all_reduce(self, buf: np.ndarray, op: Any, *, async_op: bool = False) -> Any:
            raise ad.CollectiveTimeoutError("the group timed out")

    sync = GradientSynchronizer.for_parameters(Failing(), _PARAMS, 1 << 20)
    with pytest.raises(ad.CollectiveTimeoutError, match="timed out"):
        sync.finish([True] * 4, False)
    assert not sync.in_flight()


def _shm_ddp(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    from shm_run import connect

    pg = connect(rank, n, ports[0], timeout, job)
    sync = GradientSynchronizer.for_parameters(pg, _PARAMS, 12)
    for i, v in enumerate(sync.views()):
        v[...] = rank + i
    sync.finish([True] * 4, False)
    return sync.in_shared_memory(), [float(v.flat[0]) for v in sync.views()]


@pytest.mark.timeout(120)
def test_buckets_live_in_the_shm_segment_and_average_there() -> None:
    from shm_run import ok, run_world

    for shared, got in ok(run_world(2, _shm_ddp)):
        assert shared, "the buckets were allocated in the group's shared memory"
        assert got == [0.5, 1.5, 2.5, 3.5]
