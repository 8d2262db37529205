"""monitored_barrier in every world: a barrier with its own timeout that, when members do not arrive,
makes every member that did raise CollectiveTimeoutError naming all the missing ones (so
wait_all_ranks changes nothing), well before the world's timeout; the world is then aborted, as by
any timeout (the late ranks get PeerFailureError; over MPI, where nothing can cancel the barrier, the
caller gets the error first and the job ends at the group's next use or at exit). It is the group's
barrier: it meets a plain one, and a member calling anything else is a mismatch. On the torch backend it
is the group's method (torch's own dist.monitored_barrier refuses a backend that is a ProcessGroup)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from mpi_run import needs_mpi, passes, remove_segments_of_aborted_jobs, run_job
from shm_run import connect, ok, run_world, segments_unchanged
from threads_run import outcomes

no_leak = pytest.fixture(autouse=True)(segments_unchanged)
no_mpich_leftovers = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)

WORLD_TIMEOUT = 60.0  # the world's; every monitored barrier here waits far less


def late_ranks(pg: Any, missing: set[int], timeout: Any, wait_all_ranks: bool = False) -> Any:
    """Ranks in `missing` come 2 s late to a plain barrier; the others wait in a monitored one."""
    start = time.monotonic()
    if pg.rank() in missing:
        time.sleep(2)
        pg.barrier()
        return "passed"
    try:
        pg.monitored_barrier(timeout, wait_all_ranks)
    except ad.CollectiveTimeoutError as exc:
        return str(exc), time.monotonic() - start
    return "passed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_every_arrived_rank_names_every_missing_one_before_the_worlds_timeout(wait_all_ranks: bool) -> None:
    res = outcomes(4, lambda pg: late_ranks(pg, {1, 3}, 0.5, wait_all_ranks), timeout=WORLD_TIMEOUT)
    for r in (0, 2):
        message, waited = res[r]
        assert "rank(s) [1, 3] of group [0, 1, 2, 3] never arrived" in message, message
        # The timeout of this call, on the rank that hit it and on the one the abort told alike.
        assert "Timed out after 500ms in barrier" in message, message
        assert waited < 20, waited
    for r in (1, 3):
        assert isinstance(res[r], ad.PeerFailureError), res[r]


@pytest.mark.timeout(60)
def test_the_timeout_may_be_a_timedelta_and_the_module_helper_takes_the_group() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        pg.monitored_barrier(timedelta(seconds=30))
        pg.monitored_barrier()  # the world's timeout
        ad.monitored_barrier(30, group=pg)
        ad.monitored_barrier(timedelta(seconds=30), True, pg)
        # It meets the plain barrier of another rank: both are the group's barrier.
        if pg.rank() == 0:
            pg.barrier()
        else:
            pg.monitored_barrier(30)
        return late_ranks(pg, {2}, timedelta(milliseconds=300))

    res = outcomes(3, fn, timeout=WORLD_TIMEOUT)
    for r in (0, 1):
        assert "Timed out after 300ms" in res[r][0] and "rank(s) [2] of group" in res[r][0], res[r]


@pytest.mark.timeout(60)
def test_a_subgroup_names_its_missing_members_by_global_rank() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = pg.new_group([1, 2, 3])
        if pg.rank() == 0:
            return "outside"
        return late_ranks(sub, {3}, 0.5)

    res = outcomes(4, fn, timeout=WORLD_TIMEOUT)
    assert "rank(s) [3] of group [1, 2, 3] never arrived" in res[1][0], res[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (-1, ValueError, "timeout must be a positive number of seconds"),
        (timedelta(0), ValueError, "timeout must be a positive number of seconds"),
        ("1s", TypeError, "timeout must be a number of seconds or a datetime.timedelta, got str"),
    ],
)
def test_a_bad_timeout_is_refused_and_aborts_the_world(timeout: Any, error: type, message: str) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        if pg.rank() == 0:
            pg.monitored_barrier(timeout)
        pg.barrier()

    res = outcomes(2, fn, timeout=WORLD_TIMEOUT)
    assert isinstance(res[0], error) and message in str(res[0]), res[0]
    assert isinstance(res[1], ad.PeerFailureError), res[1]


def test_wait_all_ranks_in_the_groups_place_is_a_type_error_naming_the_fix() -> None:
    with pytest.raises(TypeError, match="pass the group as group="):
        ad.monitored_barrier(1.0, ad.ProcessGroup(ad.ThreadBackend.single()))  # type: ignore[arg-type]


def shm_late(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    pg = connect(rank, n, ports[0], timeout)
    return late_ranks(pg, {n - 1}, 0.5)


@pytest.mark.timeout(90)
def test_shm_world_names_the_missing_rank() -> None:
    res = run_world(3, shm_late, timeout=WORLD_TIMEOUT, limit=60)
    for r in (0, 1):
        status, value, _ = res[r]
        assert status == "ok", res[r]
        message, waited = value
        assert "Timed out after 500ms" in message and "rank(s) [2] of group [0, 1, 2]" in message, message
        assert waited < 20, waited
    assert res[2][0] == "PeerFailureError", res[2]


def shm_ok(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    pg = connect(rank, n, ports[0], timeout)
    pg.monitored_barrier(timedelta(seconds=30), True)
    buf = np.ones(4, np.float32)
    pg.all_reduce(buf)
    return buf.tolist()


@pytest.mark.timeout(90)
def test_shm_world_passes_when_everyone_arrives() -> None:
    assert ok(run_world(2, shm_ok, timeout=WORLD_TIMEOUT)) == [[2.0] * 4] * 2


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_passes_when_everyone_arrives() -> None:
    assert "monitored ok" in passes(3, "monitored.py", "ok")


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["use", "exit"])
def test_mpi_names_every_missing_rank_to_the_caller_then_ends_the_job(then: str) -> None:
    result, wall = run_job(4, "monitored.py", f"missing-{then}", limit=60)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode != 0, report
    # Rank 0's own code caught the error naming every missing rank, before anything was aborted.
    caught = "rank 0 caught CollectiveTimeoutError: monitored_barrier in MPI group [0, 1, 2, 3]"
    assert caught in result.stdout, report
    assert "but rank(s) [2, 3] of group [0, 1, 2, 3] never arrived" in result.stdout, report
    # Then the group's next use, or the end of the interpreter, aborts the job saying why.
    if then == "use":
        assert "all_reduce called on MPI group [0, 1, 2, 3], unusable since CollectiveTimeoutError" in (
            result.stderr
        ), report
    else:
        assert "rank 0 returns" in result.stdout, report
        assert "exiting with MPI group [0, 1, 2, 3] unusable (CollectiveTimeoutError" in result.stderr, report
    # The missing ranks sleep 60 s: the job ends at the monitored barrier's deadline (twice it, at most).
    assert wall < 30, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_call_matching_as_the_native_worlds() -> None:
    assert "monitored mismatch ok" in passes(3, "monitored.py", "mismatch")


@pytest.mark.timeout(180)
def test_torch_backend_groups_monitored_barrier_names_the_missing_rank(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = Path(__file__).parent / "torch_jobs" / "monitored.py"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AXONML_JOB_SECRET"]:
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    proc = subprocess.run([*cmd, str(job), tmp_path], env=env, capture_output=True, text=True, timeout=150)
    files = [tmp_path / f"rank{r}.txt" for r in (0, 1)]
    seen = [f.read_text() if f.exists() else None for f in files]
    assert all(seen), proc.stdout + proc.stderr
    assert "dist.monitored_barrier refused: monitored_barrier requires a group with a CPU" in seen[0], seen[0]
    assert "group.monitored_barrier passed" in seen[1], seen[1]
    assert "CollectiveTimeoutError: rank 0: Timed out after 1s in barrier" in seen[0], seen[0]
    assert "rank(s) [1] of group [0, 1] never arrived" in seen[0], seen[0]
