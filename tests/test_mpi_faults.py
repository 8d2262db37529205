"""Faults in the MPI world, under real `mpiexec` jobs (see mpi_run): mismatched calls raise on every rank
in the native worlds' words, a rank that raises, never arrives or never creates a group ends the job
naming it, Ctrl-C ends a wait, and waiting for a late rank does not burn a core.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_run import (
    JOBS,
    MPIEXEC,
    launcher_flags,
    needs_mpi,
    passes,
    remove_segments_of_aborted_jobs,
    run_job,
)

_segments = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)


@needs_mpi
@pytest.mark.timeout(300)  # four polling MPI ranks on 2 loaded cores: minutes
@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_calls_raise_on_every_rank(n: int) -> None:
    assert f"mismatch OK on {n} ranks" in passes(n, "mismatch.py")


@needs_mpi
@pytest.mark.timeout(240)
def test_an_op_the_dtype_does_not_support_raises_type_error_on_every_rank_and_moves_nothing() -> None:
    assert "unsupported ok" in passes(3, "unsupported_ops.py")


@needs_mpi
@pytest.mark.timeout(60)
def test_a_rank_that_raises_ends_the_job() -> None:
    result, wall = run_job(2, "failures.py", "raise", limit=30)
    assert result.returncode != 0
    assert "rank 1 fails in user code" in result.stderr
    assert wall < 10, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", ["timeout", "timeout-unchecked", "group-timeout"])
def test_a_rank_that_never_arrives_times_out_and_aborts_the_job(scenario: str) -> None:
    result, wall = run_job(2, "failures.py", scenario, limit=30)
    assert result.returncode != 0
    assert "CollectiveTimeoutError: all_reduce (seq 1)" in result.stderr, result.stderr
    assert "did not complete within 1.5 s" in result.stderr
    # Rank 1 sleeps 60 s: the job must end at rank 0's deadline, not when rank 1 wakes up.
    assert wall < 15, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("scenario", "call"),
    [
        ("init-missing", "init_mpi_process_group (duplicating COMM_WORLD)"),
        ("new-group-missing", "new_group([0, 1, 2]) in MPI group [0, 1, 2]"),
    ],
)
def test_a_rank_that_never_creates_the_group_is_named_by_a_timeout(scenario: str, call: str) -> None:
    # Creating a communicator is a blocking MPI call: without a deadline of its own the others would
    # wait for rank 2 (asleep for 60 s) forever.
    result, wall = run_job(3, "failures.py", scenario, limit=30)
    assert result.returncode != 0
    # Whichever of ranks 0 and 1 gives up first aborts the job; either names rank 2.
    named = re.search(
        rf"CollectiveTimeoutError: {re.escape(call)}: rank [01] waited 1.5 s, but rank\(s\) \[2\] of group "
        r"\[0, 1, 2\] never arrived",
        result.stderr,
    )
    assert named, result.stderr
    assert wall < 15, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_the_wait_for_a_missing_rank(tmp_path: Path) -> None:
    # Rank 0 waits (timeout 120 s) for a rank that never calls init; SIGINT must end that wait at once.
    pidfile = tmp_path / "rank0.pid"
    assert MPIEXEC is not None
    cmd = [MPIEXEC, *launcher_flags(), "-n", "2", sys.executable, "-m", "mpi4py"]
    cmd += [str(JOBS / "failures.py"), "init-interrupted", str(pidfile)]
    job = subprocess.Popen(cmd, cwd=JOBS, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists():
            assert time.monotonic() < deadline and job.poll() is None, "rank 0 never started waiting"
            time.sleep(0.05)
        time.sleep(0.5)  # into the wait
        interrupted = time.monotonic()
        os.kill(int(pidfile.read_text()), signal.SIGINT)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0
    assert "KeyboardInterrupt" in err, err
    assert time.monotonic() - interrupted < 15


@needs_mpi
@pytest.mark.timeout(60)
def test_waiting_for_a_late_rank_does_not_burn_a_core() -> None:
    assert "waited" in passes(2, "failures.py", "late")


HUNG_ABORT = """
import time
from axonml_distributed.exceptions import CollectiveTimeoutError
from axonml_distributed.mpi import queue

class StuckComm:
    def Abort(self, code):  # a launcher that never ends the job
        time.sleep(3600)

queue.ABORT_GRACE = 1.0
raise queue.abort_job(StuckComm(), CollectiveTimeoutError("all_reduce did not complete"))
"""


@needs_mpi
@pytest.mark.timeout(60)
def test_a_rank_whose_abort_never_ends_the_job_exits_by_itself() -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_ABORT], capture_output=True, text=True, timeout=50)
    wall = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert "CollectiveTimeoutError: all_reduce did not complete" in proc.stderr
    assert "aborting the MPI job" in proc.stderr
    assert wall < 30, f"the rank took {wall:.1f} s to exit"
