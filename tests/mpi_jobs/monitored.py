"""monitored_barrier over MPI. Usage: monitored.py SCENARIO

- ok:       every rank arrives: the group's method (seconds, a timedelta, None) and the module helper
            pass, also on a group without the signature check, and the group still works after them;
            rank 0 prints "monitored ok".
- mismatch: rank 1 calls all_reduce where the others call monitored_barrier: every rank raises
            CollectiveMismatchError, as on the native worlds, and the group stays usable; a plain barrier
            meets a monitored one (both are the group's barrier). Rank 0 prints "monitored mismatch ok".
- missing-use, missing-exit: every rank from 2 on never arrives (the job's timeout is 120 s); ranks 0
            and 1 (monitored_barrier of 1 s) catch CollectiveTimeoutError naming all of them and print
            "rank R caught ..."; then they use the group again (missing-use) or return (missing-exit),
            either of which aborts the job.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import numpy as np

import axonml_distributed as ad
from axonml_distributed.mpi import init_mpi_process_group


def main(scenario: str) -> None:
    pg = init_mpi_process_group(timeout=120)
    me = pg.rank()
    if scenario == "ok":
        pg.monitored_barrier(30)
        pg.monitored_barrier(timedelta(seconds=30), True)
        pg.monitored_barrier()
        ad.monitored_barrier(30, group=pg)
        init_mpi_process_group(timeout=120, check_signatures=False).monitored_barrier(30)
        buf = np.ones(3, np.float32)
        pg.all_reduce(buf)
        assert (buf == pg.size()).all()
        if me == 0:
            print("monitored ok", flush=True)
        return
    if scenario == "mismatch":
        buf = np.ones(3, np.float32)
        try:
            pg.all_reduce(buf) if me == 1 else pg.monitored_barrier(20)
            raise AssertionError(f"rank {me}: the mismatch was not detected")
        except ad.CollectiveMismatchError as exc:
            assert "all_reduce" in str(exc) and "barrier" in str(exc), str(exc)
        pg.barrier() if me == 1 else pg.monitored_barrier(20)
        pg.all_reduce(buf)
        assert (buf == pg.size()).all(), buf
        if me == 0:
            print("monitored mismatch ok", flush=True)
        return
    if scenario not in ("missing-use", "missing-exit"):
        raise SystemExit(f"unknown scenario {scenario!r}")
    if me >= 2:
        time.sleep(60)
        return
    try:
        pg.monitored_barrier(1.0)
        raise SystemExit("monitored_barrier should never have returned")
    except ad.CollectiveTimeoutError as exc:
        print(f"rank {me} caught {type(exc).__name__}: {exc}", flush=True)
    if scenario == "missing-use":
        pg.all_reduce(np.ones(3, np.float32))
        raise SystemExit("the group was used after its monitored_barrier timed out")
    print(f"rank {me} returns", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
