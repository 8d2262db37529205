"""The facts an error's message tells are attributes too (`rank`, `ranks`, `call`, `seq`, `group`, and
per class `calls`, `waited`, `pid`, `exit_code`, `signal`), on the thread world, the shm world and MPI.

Every scenario makes one barrier first, so the failing call is the group's second (`seq` 2), and the
expected calls are written out by hand, as a user reads them in the message."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed import CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError
from deaths import kernel_tells_exit_status
from mpi_run import needs_mpi, passes
from shm_run import connect, ok, run_world, segments_unchanged
from threads_run import outcomes

no_leak = pytest.fixture(autouse=True)(segments_unchanged)

FACTS = ("rank", "ranks", "call", "seq", "group", "calls", "waited", "pid", "exit_code", "signal")
ALL_REDUCE = "all_reduce(#2, 4 x float32, op=SUM)"
BROADCAST = "broadcast(#2, 4 x float32, root=0)"


def facts(e: BaseException) -> dict[str, Any]:
    """The error's class and every fact it has (picklable, for the shm workers)."""
    return {"class": type(e).__name__, **{k: getattr(e, k) for k in FACTS if hasattr(e, k)}}


# --- The scenarios: each rank's part, on a group whose world times out after `timeout` seconds ---------


def mismatched(pg: Any, timeout: float) -> dict[str, Any]:
    """Rank 2 broadcasts where ranks 0 and 1 all-reduce."""
    pg.barrier()
    x = np.ones(4, np.float32)
    try:
        pg.broadcast(x, 0) if pg.rank() == 2 else pg.all_reduce(x)
    except CollectiveMismatchError as e:
        return facts(e)
    return {"class": None}


def late(pg: Any, timeout: float) -> dict[str, Any]:
    """Rank 2 comes after the timeout; ranks 0 and 1 give up on it."""
    pg.barrier()
    if pg.rank() == 2:
        time.sleep(timeout + 1)
        return {"class": "slept"}
    try:
        pg.all_reduce(np.ones(4, np.float32))
    except CollectiveTimeoutError as e:
        return facts(e)
    return {"class": None}


def check_mismatch(res: list[dict[str, Any]]) -> None:
    calls = {0: ALL_REDUCE, 1: ALL_REDUCE, 2: BROADCAST}
    for r in res:
        assert r["class"] == "CollectiveMismatchError", res
        assert (r["ranks"], r["seq"], r["group"], r["calls"]) == ((2,), 2, (0, 1, 2), calls), r
        assert (r["rank"], r["call"]) == (None, None), r  # the error is the group's, not one rank's


def check_timeout(res: list[dict[str, Any]], timeout: float) -> None:
    for r in res[:2]:
        assert r["class"] == "CollectiveTimeoutError", res
        assert (r["ranks"], r["seq"], r["call"], r["group"]) == ((2,), 2, ALL_REDUCE, (0, 1, 2)), r
        assert r["rank"] in (0, 1) and r["waited"] == pytest.approx(timeout), r  # who gave up, after what


# --- Thread world ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_thread_world_mismatch() -> None:
    check_mismatch(outcomes(3, lambda pg: mismatched(pg, 10)))


@pytest.mark.timeout(60)
def test_thread_world_timeout_names_the_missing_rank() -> None:
    check_timeout(outcomes(3, lambda pg: late(pg, 1.0), timeout=1.0), 1.0)


@pytest.mark.timeout(60)
def test_thread_world_peer_that_left() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        pg.barrier()
        if pg.rank() == 1:
            return None  # leaves the world
        try:
            pg.all_reduce(np.ones(4, np.float32))
        except PeerFailureError as e:
            return e

    e = outcomes(2, fn)[0]
    assert isinstance(e, PeerFailureError), e
    assert (e.ranks, e.seq, e.call, e.pid, e.exit_code, e.signal) == ((1,), 2, ALL_REDUCE, None, None, None)
    copy = pickle.loads(pickle.dumps(e))  # facts survive a trip to another process
    assert (type(copy), str(copy), facts(copy)) == (type(e), str(e), facts(e))


# --- Shared-memory world --------------------------------------------------------------------------------


def w_scenario(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any, name: str) -> Any:
    return {"mismatched": mismatched, "late": late}[name](connect(rank, n, ports[0], timeout), timeout)


@pytest.mark.timeout(60)
def test_shm_world_mismatch() -> None:
    check_mismatch(ok(run_world(3, w_scenario, "mismatched", timeout=10)))


@pytest.mark.timeout(60)
def test_shm_world_timeout_names_the_missing_rank() -> None:
    check_timeout(ok(run_world(3, w_scenario, "late", timeout=1.5)), 1.5)


def w_child_exits(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    """Rank 1 is a child of rank 1's process that exits with code 3 after the barrier; its parent reaps
    it (so the kernel can tell its status)."""
    if rank == 1:
        child = os.fork()
        if child == 0:
            connect(rank, n, ports[0], timeout).barrier()
            os._exit(3)
        os.waitpid(child, 0)
        return child
    pg = connect(rank, n, ports[0], timeout)
    pg.barrier()
    try:
        pg.all_reduce(np.ones(4, np.float32))
    except PeerFailureError as e:
        return facts(e)


@pytest.mark.timeout(60)
def test_shm_world_dead_peer_with_its_pid_and_exit_code() -> None:
    got, child = ok(run_world(2, w_child_exits, timeout=30))
    assert got["class"] == "PeerFailureError", got
    assert (got["ranks"], got["seq"], got["call"], got["pid"]) == ((1,), 2, ALL_REDUCE, child), got
    known = kernel_tells_exit_status()  # Linux 6.15: else the message says why it is unknown
    assert (got["exit_code"], got["signal"]) == ((3 if known else None), None), got


# --- MPI ------------------------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_mismatch_has_the_native_worlds_facts() -> None:
    assert "error facts ok" in passes(3, "error_facts.py")
