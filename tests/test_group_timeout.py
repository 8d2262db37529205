"""A subgroup's own timeout: its waits (collectives, receives) last as long as it says, not the world's,
in the thread and shm worlds; timeout messages carry torch's words. (The torch backend's is in
test_torch_backend.py.)"""

from __future__ import annotations

import math
import re
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from shm_run import connect, ok, run_world, segments_unchanged
from threads_run import outcomes

pytestmark = pytest.mark.timeout(90)

no_leak = pytest.fixture(autouse=True)(segments_unchanged)

# How torch's tests and users' scripts recognise a timeout.
TORCH_TIMEOUT = re.compile(r" (Timed out|closed|timeout) ")
WORLD_TIMEOUT = 30.0
GROUP_TIMEOUT = 1.0
# Far below the world's timeout, generous for a loaded machine: the group's timeout, not the world's.
WITHIN = 8.0
SILENT = 4.0  # how long the member that never calls stays alive (one that returned is reported at once)


def silent_member(sub: ad.ProcessGroup, call: str) -> tuple[str, str, float]:
    """Rank 0 waits on `sub` (a barrier or a receive from rank 1) while rank 1 stays silent (and rank 2,
    outside the group, stays alive); returns what rank 0 raised, its message and how long it waited."""
    if sub.rank() != 0:
        time.sleep(SILENT)
        return ("silent", "", 0.0)
    start = time.monotonic()
    try:
        if call == "barrier":
            sub.barrier()
        else:
            sub.recv(np.zeros(4, np.float32), 1)
    except ad.DistributedError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", time.monotonic() - start)


def check_timed_out(got: tuple[str, str, float], op: str) -> None:
    kind, message, waited = got
    assert kind == "CollectiveTimeoutError", got
    assert TORCH_TIMEOUT.search(message), message
    assert f"Timed out after 1s in {op}" in message and "rank(s) [1]" in message, message
    assert waited < WITHIN, waited


@pytest.mark.parametrize("call", ["barrier", "recv"])
def test_a_thread_subgroup_times_out_after_its_own_timeout(call: str) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = pg.new_group([0, 1], timeout=GROUP_TIMEOUT)
        return silent_member(sub, call)

    res = outcomes(3, fn, timeout=WORLD_TIMEOUT)
    check_timed_out(res[0], call)


def w_silent_member(rank, n, ports, job, timeout, q, call):
    pg = connect(rank, n, ports[0], timeout)
    return silent_member(pg.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT)), call)


@pytest.mark.parametrize("call", ["barrier", "recv"])
def test_an_shm_subgroup_times_out_after_its_own_timeout(call: str) -> None:
    res = ok(run_world(3, w_silent_member, call, timeout=WORLD_TIMEOUT))
    check_timed_out(res[0], call)


def test_a_groups_timeout_is_its_own_or_the_worlds() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        world = ad.World(pg.backend())
        subs = [
            pg.new_group([0, 1], timeout=2.5),
            pg.new_group([0, 1]),
            world.new_group([0, 1], timedelta(milliseconds=1500)),
            ad.ProcessGroup(pg.backend(), [0, 1], 0.5),
            ad.ProcessGroup(pg.backend(), timeout=4),  # a group of its own over every rank
            ad.new_group([0, 1], timeout=2),  # the comm helper, on the default group
        ]
        for sub in subs:  # every one works
            x = np.ones(3, np.float32)
            sub.all_reduce(x)
            assert x.tolist() == [2.0] * 3
        return [pg.timeout(), *(s.timeout() for s in subs)]

    want = [WORLD_TIMEOUT, 2.5, WORLD_TIMEOUT, 1.5, 0.5, 4.0, 2.0]
    assert outcomes(2, fn, timeout=WORLD_TIMEOUT) == [want, want]


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, 1e10, timedelta(0)])
def test_a_bad_group_timeout_is_a_value_error(bad: Any) -> None:
    pg = ad.ProcessGroup(ad.ThreadBackend.single())
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        pg.new_group([0], timeout=bad)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        ad.World(pg.backend()).new_group([0], bad)


def test_a_group_timeout_of_another_type_is_a_type_error() -> None:
    pg = ad.ProcessGroup(ad.ThreadBackend.single())
    with pytest.raises(TypeError, match="datetime.timedelta"):
        pg.new_group([0], timeout="1")
