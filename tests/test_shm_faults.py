"""Faults in the shared-memory world: mismatched calls, a rank that never arrives, is stopped or killed,
Ctrl-C while waiting, more ranks than cores. Every survivor is told, by name, within bounds; nothing of
ours is left in /dev/shm.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time

import numpy as np
import pytest

from axonml_distributed import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
)
from deaths import DEATHS, UNKNOWN, kernel_tells_exit_status, survivor_says
from finished_then_aborted import CASES, expect_abort_reported_next, finish_then_abort
from interrupts import sigint_once_in
from reference import same_bits
from shm_run import (
    PREFIX,
    SHM,
    connect,
    ok,
    run_world,
    segments_unchanged,
)

no_leak = pytest.fixture(autouse=True)(segments_unchanged)


def w_mismatch(rank, n, ports, job, timeout, q):
    """One fresh world per kind of mismatch; returns what each call raised and whether buffers changed."""
    out = []
    for i, kind in enumerate(["op", "shape", "dtype", "root", "kind"]):
        pg = connect(rank, n, ports[i], timeout)
        odd = rank == n - 1
        length = 1000 + (rank if kind == "shape" and odd else 0)
        x = np.arange(length, dtype=np.float64 if kind == "dtype" and odd else np.float32) + rank
        before = x.copy()
        try:
            if kind == "op":
                pg.all_reduce(x, "MAX" if odd else "SUM")
            elif kind == "root":
                pg.broadcast(x, 1 if odd else 0)
            elif kind == "kind" and odd:
                pg.broadcast(x, 0)
            else:
                pg.all_reduce(x)
            out.append((kind, "no error", ""))
        except CollectiveMismatchError as e:
            out.append((kind, "mismatch", str(e)))
        assert same_bits(x, before), f"{kind}: the buffer was changed"
        del pg
    return out


@pytest.mark.timeout(60)
def test_mismatches_raise_on_every_rank_and_leave_buffers_untouched():
    res = ok(run_world(3, w_mismatch, worlds=5, timeout=10))
    for rank, cases in enumerate(res):
        for kind, what, msg in cases:
            assert what == "mismatch", f"rank {rank} {kind}: {what}"
            assert "rank 2" in msg, msg


def w_timeout(rank, n, ports, job, timeout, q):
    pg = connect(rank, n, ports[0], timeout)
    if rank == n - 1:
        time.sleep(timeout + 2)
        return "slept"
    t = time.time()
    try:
        pg.all_reduce(np.ones(100_000, np.float32))
    except CollectiveTimeoutError as e:
        return ("timeout", str(e), time.time() - t)


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out_naming_it():
    res = run_world(3, w_timeout, timeout=1.5)
    for rank in (0, 1):
        status, val, _ = res[rank]
        assert status == "ok" and val is not None, res[rank]
        kind, msg, waited = val
        assert "[2]" in msg, msg
        assert 1.0 < waited < 4.0, waited


def w_interrupt(rank, n, ports, job, timeout, q):
    """Rank 0 gets Ctrl-C while it waits for rank 1, which arrives late."""
    pg = connect(rank, n, ports[0], timeout)
    if rank == 1:
        time.sleep(1.5)
        try:
            pg.barrier()
        except PeerFailureError as e:
            return ("aborted", str(e))
        return ("no error", "")
    sigint_once_in("pg.all_reduce(np.ones(10, np.float32))  # rank 1 comes late")
    t = time.time()
    try:
        pg.all_reduce(np.ones(10, np.float32))  # rank 1 comes late
    except KeyboardInterrupt:
        return ("interrupted", time.time() - t)
    return ("no error", 0)


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_interrupts_and_the_peer_is_told():
    res = ok(run_world(2, w_interrupt, timeout=30))
    assert res[0][0] == "interrupted" and res[0][1] < 1.0, res[0]
    assert res[1][0] == "aborted" and "rank 0" in res[1][1], res[1]


def w_loop(rank, n, ports, job, timeout, q, size, segment):
    """Reduce until a peer dies; report the error and when it was raised."""
    pg = connect(rank, n, ports[0], timeout, job)
    x = pg.empty(size, np.float32) if segment else np.ones(size, np.float32)
    q.put((rank, "started"))
    end = time.time() + 20
    while time.time() < end:
        pg.all_reduce(x)
    return "no failure"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,segment,size", [(2, False, 1 << 20), (3, True, 1 << 20), (4, False, 1000)])
def test_a_rank_killed_mid_collective_is_named_by_every_survivor_within_2s(n, segment, size):
    killed: dict[str, float] = {}

    def kill(procs):
        time.sleep(0.3)
        killed["t"] = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)

    job = secrets.token_hex(16)
    res = run_world(n, w_loop, size, segment, timeout=30, job=job, on_started=kill)
    assert res[1][0] == "killed"
    for rank in [r for r in range(n) if r != 1]:
        status, msg, t = res[rank]
        assert status == "PeerFailureError", res[rank]
        assert "rank 1" in msg, msg
        assert t - killed["t"] < 2.0, t - killed["t"]
    assert not os.path.exists(f"{SHM}/{PREFIX}{job}")


def w_finished_then_aborted(rank, n, ports, job, timeout, q, case, segment):
    """One fresh world per trial of `finish_then_abort`; what each trial's next call raised (or the
    error that ended the trial)."""
    out = []
    for trial, port in enumerate(ports):
        pg = connect(rank, n, port, timeout)
        try:
            out.append(finish_then_abort(pg, case, trial, segment))
        except Exception as e:  # noqa: BLE001 - the parent asserts on every rank's outcome
            out.append(e)
        del pg
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("segment", [False, True], ids=["private", "segment"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_collective_every_rank_finished_succeeds_everywhere_though_a_rank_aborts_right_after(case, segment):
    # As in the thread world (tests/finished_then_aborted.py): one world per trial, as the abort ends it.
    per_rank = ok(run_world(3, w_finished_then_aborted, case, segment, worlds=12, timeout=20, limit=200))
    for trial, ran in enumerate(zip(*per_rank, strict=True)):
        expect_abort_reported_next(list(ran), f"{case}, trial {trial}")


def w_child_dies(rank, n, ports, job, timeout, q, code, failed):
    """Rank 1 is a child that rank 1's process forks, started by hand (no launcher), and dies by `code`
    after a barrier; its parent reaps it as it dies (as a shell does), or, given the path `failed`, only
    once rank 0 has failed (rank 0 then creates that file). Rank 0 reduces until it fails."""
    if rank == 1:
        child = os.fork()
        if child == 0:
            connect(rank, n, ports[0], timeout, job).barrier()
            exec(code)
        deadline = time.monotonic() + 30
        while failed and not os.path.exists(failed) and time.monotonic() < deadline:
            time.sleep(0.01)
        return child, os.waitpid(child, 0)[1]
    pg = connect(rank, n, ports[0], timeout, job)
    pg.barrier()
    try:
        while True:
            pg.all_reduce(np.ones(1000, np.float32))
    finally:
        if failed:
            open(failed, "w").close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("death", DEATHS.values(), ids=DEATHS.keys())
def test_a_dead_peer_is_named_with_its_exit_status(death):
    res = run_world(2, w_child_dies, death.code, None, timeout=30)
    assert res[1][0] == "ok", res[1]
    child, _ = res[1][1]
    status, msg, _ = res[0]
    assert status == "PeerFailureError", res[0]
    assert msg.startswith("peer rank 1 died during "), msg
    assert f"(pid {child} {survivor_says(death)}" in msg, msg


@pytest.mark.timeout(60)
def test_a_dead_peer_not_yet_reaped_has_an_unknown_exit_status(tmp_path):
    res = run_world(2, w_child_dies, DEATHS["sigkill"].code, str(tmp_path / "failed"), timeout=30)
    assert res[1][0] == "ok", res[1]
    child, wait_status = res[1][1]
    assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL
    status, msg, _ = res[0]
    assert status == "PeerFailureError", res[0]
    assert f"(pid {child} {UNKNOWN}" in msg, msg
    if kernel_tells_exit_status():
        assert "its parent had not reaped it yet" in msg, msg


def w_crowd(rank, n, ports, job, timeout, q):
    """More ranks than cores: waits must yield and sleep, not spin each other out."""
    pg = connect(rank, n, ports[0], timeout)
    x = np.empty(64 << 10, np.float32)
    t = time.time()
    for i in range(30):
        x[:] = rank + i
        pg.all_reduce(x)
        assert x[0] == sum(range(n)) + n * i
    pg.barrier()
    return time.time() - t


@pytest.mark.timeout(60)
def test_more_ranks_than_cores_make_progress():
    took = ok(run_world(6, w_crowd, timeout=20))
    assert max(took) < 15, took


def w_late_barrier(rank, n, ports, job, timeout, q):
    """Rank 2 completes one all_reduce, then never comes to the barrier."""
    pg = connect(rank, n, ports[0], timeout)
    pg.all_reduce(np.ones(4, np.float32))
    if rank == 2:
        time.sleep(timeout + 3)
        return "left"
    pg.barrier()
    return "no error"


@pytest.mark.timeout(90)
def test_every_waiting_shm_rank_gets_the_timeout_with_where_each_rank_is():
    res = run_world(3, w_late_barrier, timeout=6.0)  # room for a slow start on a busy machine
    for r in (0, 1):
        status, msg, _ = res[r]
        assert status == "CollectiveTimeoutError", res[r]
        assert "[2]" in msg and "rank 2 completed #1 all_reduce" in msg, msg
        assert f"rank {r} completed #1 all_reduce and waits in #2 barrier" in msg, msg


def w_stopped_peer(rank, n, ports, job, timeout, q):
    """Rank 2 never calls; rank 1 arrives and is then SIGSTOPped by the test; rank 0 times out."""
    pg = connect(rank, n, ports[0], timeout)
    x = pg.empty(1 << 16, np.float32)  # segment arrays: peers may write them (the zero-copy path)
    x[:] = 1
    q.put((rank, "started"))
    if rank == 2:
        time.sleep(25)
        return "left"
    pg.all_reduce(x)
    return "no error"


@pytest.mark.timeout(90)
def test_a_stopped_peer_does_not_hold_a_timed_out_rank_forever():
    times: dict[str, float] = {}

    def stop_then_resume(procs):
        def run():
            time.sleep(0.5)
            os.kill(procs[1].pid, signal.SIGSTOP)
            times["stopped"] = time.time()
            time.sleep(14)  # longer than the bound below
            os.kill(procs[1].pid, signal.SIGCONT)

        threading.Thread(target=run, daemon=True).start()

    res = run_world(3, w_stopped_peer, timeout=4.0, on_started=stop_then_resume)
    status, msg, t = res[0]
    assert status == "CollectiveTimeoutError", res[0]
    # Its own timeout, then at most one more for the drain, not the 14 s until rank 1 resumes.
    assert t - times["stopped"] < 2 * 4.0 + 3, (t - times["stopped"], msg)
    assert res[1][0] in ("CollectiveTimeoutError", "PeerFailureError"), res[1]
