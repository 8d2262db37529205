"""Regression tests for the defects a review and a fault campaign found (hardening issue), in the
in-process world. Each failed (wrong result, hang, crash) before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import axonml_distributed as ad
from interrupts import sigint_once_in
from threads_run import outcomes


def _world(n: int, timeout: float = 30) -> list[Any]:
    return ad.MockBackend.create_world(n, timeout=timeout)


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

    for res in _threads(_world(2), fn):
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

    for res in _threads(_world(2), fn):
        assert res == [(30.0, 3.0)] * 100, res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [10, 1 << 16, 1 << 20])
def test_the_isend_recv_exchange_completes_at_any_size(n: int) -> None:
    def fn(pg: ad.ProcessGroup) -> bool:
        peer = 1 - pg.rank()
        x = np.arange(n, dtype=np.float32) + 1000 * pg.rank()
        y = np.zeros(n, np.float32)
        w = pg.send(x, peer, async_op=True)
        pg.recv(y, peer)
        w.wait()
        r = pg.recv(y2 := np.zeros(n, np.float32), peer, tag=5, async_op=True)
        pg.send(x * 2, peer, tag=5)
        r.wait()
        expect = np.arange(n, dtype=np.float32) + 1000 * peer
        return bool(np.array_equal(y, expect) and np.array_equal(y2, expect * 2))

    assert ad.spawn(fn, 2, timeout=30) == [True, True]


@pytest.mark.timeout(60)
def test_isends_with_two_tags_received_in_the_other_order_complete() -> None:
    n = 1 << 18  # 1 MiB of float32: above the eager limit, so each send waits for its receive

    def fn(pg: ad.ProcessGroup) -> bool:
        if pg.rank() == 0:
            works = [pg.send(np.full(n, float(tag), np.float32), 1, tag, async_op=True) for tag in (1, 2)]
        else:
            bufs = {tag: np.zeros(n, np.float32) for tag in (2, 1)}
            works = [pg.recv(bufs[tag], 0, tag, async_op=True) for tag in (2, 1)]
        for w in works:
            w.wait()
        return pg.rank() == 0 or all(bool((bufs[t] == t).all()) for t in (1, 2))

    assert ad.spawn(fn, 2, timeout=30) == [True, True]


@pytest.mark.timeout(60)
def test_queued_sends_to_one_peer_keep_their_order() -> None:
    def fn(pg: ad.ProcessGroup) -> list[float]:
        if pg.rank() == 0:
            works = [pg.send(np.full(1 << 15, float(i), np.float64), 1, async_op=True) for i in range(6)]
            for w in works:
                w.wait()
            return []
        got = []
        for _ in range(6):
            y = np.zeros(1 << 15, np.float64)
            pg.recv(y, 0)
            got.append(float(y[0]))
        return got

    assert ad.spawn(fn, 2, timeout=30) == [[], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


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


@pytest.mark.parametrize("timeout", [1e19, float("inf"), float("nan"), -1.0, 0.0, 2e9])
def test_absurd_timeouts_are_refused_clearly(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ad.MockBackend.create_world(2, timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        ad.spawn(lambda pg: None, 2, timeout=timeout)


@pytest.mark.parametrize("backend", ["shm", "mpi"])
def test_absurd_init_timeouts_are_refused_before_anything_starts(backend: str) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ad.init_process_group(backend, timeout=1e19)
    assert not ad.is_initialized()


def test_the_longest_timeout_accepted_works() -> None:
    assert ad.spawn(lambda pg: pg.all_reduce_tensor(np.ones(2)).tolist(), 2, timeout=1e9) == [[2.0, 2.0]] * 2


_GIL_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    import axonml_distributed as ad

    backends = ad.MockBackend.create_world(2, timeout=20)
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


@pytest.mark.timeout(60)
def test_ctrl_c_ends_a_work_wait() -> None:
    backends = _world(2, timeout=60)
    pg = ad.ProcessGroup(backends[0])
    w = pg.barrier(async_op=True)  # rank 1 never arrives
    start = time.monotonic()
    sigint_once_in("w.wait()  # interrupted")
    with pytest.raises(KeyboardInterrupt):
        w.wait()  # interrupted
    assert time.monotonic() - start < 3
    with pytest.raises(ad.PeerFailureError, match="interrupted"):
        ad.ProcessGroup(backends[1]).barrier()  # the peer is told
    with pytest.raises(ad.DistributedError):
        w.wait()  # the queued barrier itself failed too, and said so


@pytest.mark.timeout(60)
def test_ctrl_c_ends_a_blocking_calls_wait_for_queued_work() -> None:
    backends = _world(2, timeout=60)
    pg = ad.ProcessGroup(backends[0])
    pg.barrier(async_op=True)  # rank 1 never arrives
    start = time.monotonic()
    sigint_once_in("pg.all_reduce(np.ones(2, np.float32))  # interrupted")
    with pytest.raises(KeyboardInterrupt):
        pg.all_reduce(np.ones(2, np.float32))  # interrupted
    assert time.monotonic() - start < 3


@pytest.mark.timeout(60)
def test_every_waiting_rank_gets_the_timeout_naming_the_missing_rank_and_where_each_rank_is() -> None:
    def fn(pg: ad.ProcessGroup) -> None:
        x = np.ones(4, np.float32)
        pg.all_reduce(x)
        if pg.rank() == 2:
            time.sleep(3)  # never arrives at the barrier in time
            return
        pg.barrier()

    res = outcomes(3, fn, timeout=1.0)
    for r in (0, 1):
        assert isinstance(res[r], ad.CollectiveTimeoutError), res[r]
        msg = str(res[r])
        assert "[2]" in msg, msg
        assert "rank 2 completed #1 all_reduce" in msg, msg
        assert f"rank {r} completed #1 all_reduce and waits in #2 barrier" in msg, msg


@pytest.mark.timeout(60)
def test_a_rank_that_timed_out_is_not_reported_as_having_completed_the_call() -> None:
    def fn(pg: ad.ProcessGroup) -> None:
        pg.all_reduce(np.ones(4, np.float32))
        if pg.rank() == 3:
            time.sleep(4)  # never comes to the second call in time
            return
        if pg.rank() == 1:
            time.sleep(0.5)  # enters late: its deadline fires after rank 0's
        pg.all_reduce(np.ones(4, np.float32))

    res = outcomes(4, fn, timeout=1.0)
    for r in (0, 1, 2):
        assert isinstance(res[r], ad.CollectiveTimeoutError), res[r]
        msg = str(res[r])
        assert "rank 3 completed #1 all_reduce" in msg, msg
        for peer in (0, 1, 2):
            assert f"rank {peer} completed #2" not in msg, msg
            assert f"rank {peer} completed #1 all_reduce and " in msg, msg


_IMPORT_ON_A_THREAD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    t = threading.Thread(target=lambda: __import__("axonml_distributed"))
    t.start(); t.join()
    import axonml_distributed as ad
    from interrupts import sigint_once_in
    backends = ad.MockBackend.create_world(2, timeout=20)
    pg = ad.ProcessGroup(backends[0])
    sigint_once_in("pg.barrier()  # interrupted")
    start = time.monotonic()
    try:
        pg.barrier()  # interrupted
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - start, 2))
    """
)


@pytest.mark.timeout(60)
def test_ctrl_c_works_when_the_package_was_first_imported_on_another_thread(tmp_path: Any) -> None:
    script = tmp_path / "import_on_a_thread.py"  # a file: the interrupter reads the call's source line
    script.write_text(_IMPORT_ON_A_THREAD)
    tests = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, str(script), tests], capture_output=True, text=True, timeout=50)
    assert p.stdout.startswith("interrupted after"), (p.stdout, p.stderr)
    assert float(p.stdout.split()[-1]) < 5, p.stdout


def test_new_group_is_a_method_of_every_group() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = pg.new_group([1, 2])
        if not sub.contains(pg.rank()):
            return None
        return sub.all_reduce_tensor(np.full(2, float(pg.rank()))).tolist()

    assert ad.spawn(fn, 3, timeout=30) == [None, [3.0, 3.0], [3.0, 3.0]]


def test_a_torch_tensor_is_reduced_in_place_and_tensor_helpers_return_tensors() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        t = torch.full((3,), float(pg.rank() + 1), requires_grad=True)
        pg.all_reduce(t, ad.ReduceOp.AVG)
        g = torch.arange(4, dtype=torch.int64) * (pg.rank() + 1)
        out = pg.all_reduce_tensor(g, "sum")
        return t.detach().tolist(), type(out).__name__, out.tolist()

    res = ad.spawn(fn, 2, timeout=30)
    assert res == [([1.5] * 3, "Tensor", [0, 3, 6, 9])] * 2


def test_tensor_helpers_keep_bfloat16_and_take_non_contiguous_tensors() -> None:
    import torch

    def fn(pg: ad.ProcessGroup) -> Any:
        t = torch.full((4,), 1.5 + pg.rank(), dtype=torch.bfloat16)
        out = pg.all_reduce_tensor(t)
        nc = (torch.arange(8.0).reshape(2, 4) + 10 * pg.rank()).t()  # a transposed view
        b = pg.broadcast_tensor(nc, 0)
        return out.dtype, out.tolist(), b.tolist(), float(t[0])

    for r, (dtype, out, b, mine) in enumerate(ad.spawn(fn, 2, timeout=30)):
        assert dtype == torch.bfloat16 and out == [4.0] * 4
        assert b == torch.arange(8.0).reshape(2, 4).t().tolist()
        assert mine == 1.5 + r  # the input is left alone
