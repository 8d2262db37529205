"""Faults in the thread world: mismatches, timeouts, aborts, bad input, interrupts, oversubscription."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from finished_then_aborted import CASES, expect_abort_reported_next, finish_then_abort
from interrupts import sigint_once_in
from reference import data, same_bits
from threads_run import outcomes

pytestmark = pytest.mark.timeout(60)


MISMATCHES: dict[str, Callable[[ad.ProcessGroup, np.ndarray], Any]] = {
    "op": lambda pg, x: pg.all_reduce(x, ad.ReduceOp.MAX if pg.rank() == 1 else ad.ReduceOp.SUM),
    "shape": lambda pg, x: pg.all_reduce(x[: 100 if pg.rank() == 1 else 200]),
    "dtype": lambda pg, x: pg.all_reduce(x.astype(np.float64) if pg.rank() == 1 else x),
    "root": lambda pg, x: pg.broadcast(x, 1 if pg.rank() == 1 else 0),
    "kind": lambda pg, x: pg.broadcast(x, 0) if pg.rank() == 1 else pg.all_reduce(x),
    "small vs large": lambda pg, x: pg.all_reduce(x[:2] if pg.rank() == 1 else x),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_fails_every_rank_and_touches_nothing(case: str) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        x = data(pg.rank(), 20_000, np.float32)
        err = None
        try:
            MISMATCHES[case](pg, x)
        except ad.CollectiveMismatchError as e:
            err = e
        return err, same_bits(x, data(pg.rank(), 20_000, np.float32))

    for rank, (err, untouched) in enumerate(outcomes(3, fn)):
        assert isinstance(err, ad.CollectiveMismatchError), f"rank {rank}: {err!r}"
        assert "rank 1 called" in str(err), str(err)
        assert untouched, f"rank {rank}'s buffer changed"


def test_world_is_unusable_after_a_mismatch() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        with pytest.raises(ad.CollectiveMismatchError):
            pg.all_reduce(np.ones(3, np.float32), ad.ReduceOp.MAX if pg.rank() else ad.ReduceOp.SUM)
        with pytest.raises(ad.PeerFailureError):
            pg.barrier()

    assert outcomes(2, fn) == [None, None]


def test_a_rank_that_never_arrives_is_named_by_a_timeout() -> None:
    start = time.monotonic()

    def fn(pg: ad.ProcessGroup) -> Any:
        if pg.rank() == 2:
            time.sleep(1.5)
        pg.all_reduce(np.ones(10, np.float32))

    res = outcomes(3, fn, timeout=0.5)
    assert time.monotonic() - start < 10
    assert any(isinstance(e, ad.CollectiveTimeoutError) and "[2]" in str(e) for e in res[:2]), res
    assert all(isinstance(e, ad.DistributedError) for e in res)
    assert isinstance(res[2], ad.PeerFailureError), "the late rank fails at once instead of waiting"


def test_a_raising_rank_aborts_the_others_quickly_and_spawn_names_it() -> None:
    seen: list[BaseException] = []

    def fn(pg: ad.ProcessGroup) -> None:
        if pg.rank() == 1:
            time.sleep(0.2)
            raise KeyError("boom")
        try:
            pg.barrier()
        except ad.DistributedError as e:
            seen.append(e)
            raise

    start = time.monotonic()
    with pytest.raises(ad.SpawnError) as info:
        ad.spawn(fn, 3, timeout=60)
    assert time.monotonic() - start < 5, "peers were aborted, not left to time out"
    assert info.value.rank == 1 and isinstance(info.value.__cause__, KeyError)
    assert len(seen) == 2 and all(isinstance(e, ad.PeerFailureError) and "rank 1" in str(e) for e in seen)


BAD_INPUTS: dict[str, tuple[type[Exception], Callable[[ad.ProcessGroup, np.ndarray], Any]]] = {
    "non-contiguous": (ValueError, lambda pg, x: pg.all_reduce(x[::2])),
    "read-only": (ValueError, lambda pg, x: (x.setflags(write=False), pg.all_reduce(x))),
    "unsupported dtype": (TypeError, lambda pg, x: pg.all_reduce(np.ones(4, np.longdouble))),
    "datetime dtype": (TypeError, lambda pg, x: pg.all_reduce(np.ones(4, "datetime64[s]"))),
    "not an array": (TypeError, lambda pg, x: pg.all_reduce([1.0, 2.0])),
    "unknown op": (ValueError, lambda pg, x: pg.all_reduce(x, "median")),
    "root out of range": (ValueError, lambda pg, x: pg.broadcast(x, 7)),
    "reduce_scatter does not divide": (
        ValueError,
        lambda pg, x: pg.reduce_scatter_tensor(np.ones(5, np.float32)),
    ),
    "all_gather output too small": (ValueError, lambda pg, x: pg.all_gather(x, np.zeros(3, np.float32))),
    "dtype of output differs": (ValueError, lambda pg, x: pg.all_gather(x, np.zeros((2, 64), np.float64))),
    "same array twice": (ValueError, lambda pg, x: pg.all_gather(x, x)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error_and_aborts_the_peers(case: str) -> None:
    kind, call = BAD_INPUTS[case]

    def fn(pg: ad.ProcessGroup) -> Any:
        x = data(pg.rank(), 64, np.float32)
        if pg.rank() == 0:
            with pytest.raises(kind):
                call(pg, x)
            assert same_bits(x, data(0, 64, np.float32)), "nothing lost"
            return None
        with pytest.raises(ad.PeerFailureError, match="rank 0"):
            pg.all_reduce(x)
        return None

    start = time.monotonic()
    assert outcomes(2, fn, timeout=30) == [None, None]
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "dtype", [pytest.param(bool, id="average of bools"), pytest.param(np.int32, id="average of ints")]
)
def test_a_reduction_refused_on_one_rank_only_is_a_type_error_there_at_once_and_its_next_call_a_mismatch(
    dtype: Any,
) -> None:
    # Only rank 0 asks for what its dtype does not take: it is told why at once, locally, with its
    # peers busy elsewhere (not in a collective); its next collective meets theirs as a mismatch on
    # every rank, and nothing moved.
    def fn(pg: ad.ProcessGroup) -> Any:
        x = data(pg.rank(), 64, np.float32)
        if pg.rank() == 0:
            with pytest.raises(TypeError, match="AVERAGE is not defined for"):
                pg.all_reduce(np.ones(4, dtype), ad.ReduceOp.AVERAGE)
            pg.send(np.ones(1, np.float32), 1)
            with pytest.raises(ad.CollectiveMismatchError, match="rank 0 called barrier"):
                pg.barrier()
        else:
            if pg.rank() == 1:
                pg.recv(np.zeros(1, np.float32), 0)
            with pytest.raises(ad.CollectiveMismatchError, match="rank 0 called barrier"):
                pg.all_reduce(x)
        assert same_bits(x, data(pg.rank(), 64, np.float32)), "nothing moved"

    start = time.monotonic()
    assert outcomes(3, fn, timeout=60) == [None, None, None]
    assert time.monotonic() - start < 30, "the refusal was local: nobody waited for the timeout"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_a_collective_every_rank_finished_succeeds_everywhere_though_a_rank_aborts_right_after(
    case: str,
) -> None:
    # Issue 26: the slower ranks must not take rank 1's abort, which comes from its next call, for a
    # failure of the call every rank finished; that abort is for their own next call to report.
    for trial in range(30):
        ran = outcomes(3, lambda pg: finish_then_abort(pg, case, trial))  # noqa: B023 - run at once
        expect_abort_reported_next(ran, f"{case}, trial {trial}")


def test_a_non_member_cannot_call_a_group_collective() -> None:
    members_done = threading.Barrier(3, timeout=30)  # rank 2's bad call comes after the members' barrier

    def fn(pg: ad.ProcessGroup) -> Any:
        sub = ad.World(pg.backend()).new_group([0, 1])
        if pg.rank() == 2:
            assert not sub.contains(2)
            members_done.wait()
            with pytest.raises(ValueError, match="not a member"):
                sub.barrier()
        else:
            sub.barrier()
            members_done.wait()
            with pytest.raises(ad.PeerFailureError, match="rank 2"):
                pg.barrier()  # rank 2 never gets here: its bad call aborted the world

    assert outcomes(3, fn) == [None, None, None]


def test_two_threads_on_one_rank_are_a_usage_error_that_does_not_abort() -> None:
    backends = ad.ThreadBackend.create_world(2, timeout=30)
    pg = ad.ProcessGroup(backends[0])
    got: list[object] = []

    def first() -> None:
        x = np.ones(2, np.float32)
        pg.all_reduce(x)  # waits for rank 1, which comes after the refused call below
        got.append(x.copy())

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.3)
    with pytest.raises(ad.DistributedError, match="another collective is already running") as e:
        pg.all_reduce(np.ones(2, np.float32))
    assert not isinstance(e.value, (ValueError, ad.PeerFailureError))
    y = np.full(2, 2.0, np.float32)
    ad.ProcessGroup(backends[1]).all_reduce(y)  # the world was not aborted: the first call completes
    t.join()
    np.testing.assert_array_equal(got[0], [3.0, 3.0])
    np.testing.assert_array_equal(y, [3.0, 3.0])


def test_ctrl_c_interrupts_a_waiting_collective() -> None:
    backends = ad.ThreadBackend.create_world(2, timeout=60)
    pg = ad.ProcessGroup(backends[0])
    sigint_once_in("pg.barrier()  # rank 1 never arrives")
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pg.barrier()  # rank 1 never arrives
    assert time.monotonic() - start < 3
    with pytest.raises(ad.PeerFailureError):
        ad.ProcessGroup(backends[1]).barrier()


def test_eight_ranks_on_two_cores_make_progress() -> None:
    def fn(pg: ad.ProcessGroup) -> float:
        x = np.ones(8, np.float64)
        for _ in range(200):
            pg.all_reduce(x, ad.ReduceOp.AVERAGE)
        big = np.full(100_000, pg.rank(), np.float32)
        for _ in range(5):
            pg.all_reduce(big)
        return float(x[0] + big[0])

    assert ad.spawn(fn, 8, timeout=30) == [1.0 + 28 * 8**4] * 8


def test_a_rank_that_returns_early_fails_its_waiting_peers_at_once() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = ad.World(pg.backend()).new_group([1, 2])
        if pg.rank() == 0:
            return None  # leaves without the final barrier
        x = np.ones(4, np.float32)
        sub.all_reduce(x)  # a subgroup without rank 0 is unaffected
        with pytest.raises(ad.PeerFailureError, match="rank 0"):
            pg.barrier()
        return float(x[0])

    start = time.monotonic()
    assert outcomes(3, fn, timeout=60) == [None, 2.0, 2.0]
    assert time.monotonic() - start < 5, "not a timeout"


@pytest.mark.timeout(60)
def test_ctrl_c_ends_a_work_wait() -> None:
    backends = ad.ThreadBackend.create_world(2, timeout=60)
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
    backends = ad.ThreadBackend.create_world(2, timeout=60)
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
    backends = ad.ThreadBackend.create_world(2, timeout=20)
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
