"""Receives from any source in the native worlds (threads, shm): which sender goes first, how they share
messages with receives from a given source, subgroups, and their errors. What every world does alike
(MPI too) is the conformance suite's `any_source` check."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed import CollectiveTimeoutError, PeerFailureError
from shm_run import connect, ok, run_world, segments_unchanged

no_leak = pytest.fixture(autouse=True)(segments_unchanged)


def round_robin(pg: Any) -> list[int]:
    """Every sender has two messages ready before rank 0 receives: the senders take turns."""
    me, n = pg.rank(), pg.size()
    if me != 0:
        for i in range(2):
            pg.send(np.full(2, i, np.int32), 0, 4)  # small: sent eagerly, before the barrier
    pg.barrier()
    if me != 0:
        return []
    return [pg.recv_any(np.zeros(2, np.int32), 4) for _ in range(2 * (n - 1))]


def shared_with_recv(pg: Any) -> list[Any]:
    """A message an any-source receive took is not delivered again to a receive from its sender."""
    me = pg.rank()
    if me == 1:
        for v in (1.0, 2.0, 3.0):
            pg.send(np.full(3, v), 0, 5)
    if me != 0:
        return []
    got = []
    for use_any in (True, False, True):
        buf = np.zeros(3)
        src = pg.recv_any(buf, 5) if use_any else (pg.recv(buf, 1, 5), 1)[1]
        got.append((src, buf[0]))
    return got


def posted_order(pg: Any) -> list[Any]:
    """Queued receives with one tag match in the order they were issued, any-source or not: rank 1's
    messages 1, 2 go to the first-issued receive, then the next."""
    me = pg.rank()
    if me == 1:
        for v in (1, 2, 3, 4):
            pg.send(np.full(1, v), 0, 8)
    if me != 0:
        return []
    bufs = [np.zeros(1, np.int64) for _ in range(4)]
    works = [
        pg.recv(bufs[0], 1, 8, async_op=True),
        pg.recv_any(bufs[1], 8, async_op=True),
        pg.recv_any(bufs[2], 8, async_op=True),
        pg.recv(bufs[3], 1, 8, async_op=True),
    ]
    for w in works:
        w.wait()
    return [int(b[0]) for b in bufs]


def subgroup(pg: Any) -> list[Any]:
    """An any-source receive on a subgroup takes only its members' messages."""
    me = pg.rank()
    sub = pg.new_group([0, 1, 2])
    if me == 3:
        pg.send(np.full(1, 30), 0, 9)
    if me in (1, 2):
        sub.send(np.full(1, me * 10), 0, 9)
    got = []
    if me == 0:
        for _ in range(2):
            buf = np.zeros(1, np.int64)
            got.append((sub.recv_any(buf, 9), int(buf[0])))
        buf = np.zeros(1, np.int64)
        got.append((pg.recv_any(buf, 9), int(buf[0])))
    pg.barrier()
    return got


def mismatch(pg: Any) -> str:
    """A message whose length differs from the receive's is refused, naming its sender."""
    if pg.rank() == 1:
        pg.send(np.zeros(4), 0, 3)
        return ""
    try:
        pg.recv_any(np.zeros(3), 3)
    except ValueError as e:
        return str(e)
    return "no error"


def nobody_sends(pg: Any) -> str:
    """Rank 0 waits for a message nobody sends. The others wait too, for rank 0, starting later so
    that rank 0's timeout comes first (theirs would abort the world under it)."""
    try:
        if pg.rank() == 0:
            pg.recv_any(np.zeros(1), 2)
        else:
            time.sleep(1.5)
            pg.recv(np.zeros(1), 0, 2)
    except CollectiveTimeoutError as e:
        return str(e)
    except PeerFailureError:
        return "aborted"
    return "no error"


def shm_worker(
    rank: int, n: int, ports: list[int], job: str | None, timeout: float, q: Any, fn: Callable
) -> Any:
    return fn(connect(rank, n, ports[0], timeout))


def on(world: str, fn: Callable[[Any], Any], n: int, timeout: float = 60) -> list[Any]:
    if world == "threads":
        return ad.spawn(fn, n, timeout=timeout)
    return ok(run_world(n, shm_worker, fn, timeout=timeout, limit=120))


WORLDS = ["threads", "shm"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_ready_senders_take_turns(world: str) -> None:
    got = on(world, round_robin, 4)[0]
    # Round robin in rank order, starting after the previous any-source receive's sender.
    assert got == [1, 2, 3, 1, 2, 3]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_each_message_is_received_once_in_send_order(world: str) -> None:
    assert on(world, shared_with_recv, 2)[0] == [(1, 1.0), (1, 2.0), (1, 3.0)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_a_subgroup_receives_from_its_members_only(world: str) -> None:
    got = on(world, subgroup, 4)[0]
    assert sorted(got[:2]) == [(1, 10), (2, 20)] and got[2] == (3, 30), got


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_a_mismatched_message_is_refused(world: str) -> None:
    msg = on(world, mismatch, 2)[0]
    assert "from any source" in msg and "4 x float64 from rank 1" in msg and "differ" in msg, msg


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_a_timeout_names_the_group(world: str) -> None:
    msg = on(world, nobody_sends, 3, timeout=2)[0]
    assert "recv(1 x float64 from any source, tag 2)" in msg and "group [0, 1, 2]" in msg, msg


def leave_early(pg: Any) -> Any:
    """Rank 1 returns at once (its thread leaves, its process exits); rank 2 sends a second later."""
    if pg.rank() == 1:
        return None
    if pg.rank() == 2:
        time.sleep(1.0)
        pg.send(np.ones(1), 0, 6)
        return None
    return pg.recv_any(np.zeros(1), 6)


def all_leave(pg: Any) -> str:
    if pg.rank() != 0:
        return ""
    try:
        pg.recv_any(np.zeros(1), 6)
    except PeerFailureError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_a_sender_that_left_fails_the_wait_only_once_every_sender_left() -> None:
    assert ad.spawn(leave_early, 3, timeout=20)[0] == 2
    assert "left the world" in ad.spawn(all_leave, 3, timeout=20)[0]


@pytest.mark.timeout(150)
def test_a_sender_that_exited_fails_the_wait_only_once_every_sender_exited() -> None:
    # The shared-memory world: rank 1's process ends at once, rank 2 sends later.
    assert on("shm", leave_early, 3, timeout=20)[0] == 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", WORLDS)
def test_queued_receives_match_in_issue_order(world: str) -> None:
    assert on(world, posted_order, 2)[0] == [1, 2, 3, 4]
