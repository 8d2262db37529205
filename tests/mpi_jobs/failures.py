"""Jobs that must end on their own. Usage: failures.py SCENARIO

- raise:            rank 1 raises in user code while rank 0 waits in all_reduce (timeout 120 s); under
                    `python -m mpi4py` the whole job must end at once with a non-zero exit.
- timeout:          rank 1 never arrives; rank 0 (timeout 1.5 s) reports CollectiveTimeoutError naming
                    all_reduce and aborts the job.
- timeout-unchecked: the same with the signature check off, so the data operation itself times out.
- group-timeout:    the same on a group over every rank made with a timeout of 1.5 s, in a job of 120 s:
                    the group's own timeout ends the wait.
- late:             rank 1 arrives 2 s late; rank 0 waits without burning a core, and both finish
                    (exit 0).
- init-missing:     the last rank never calls init_mpi_process_group; the others (timeout 1.5 s) report
                    CollectiveTimeoutError naming it and abort the job.
- new-group-missing: the last rank never calls new_group over every rank; the same.
- init-interrupted PIDFILE: as init-missing with a timeout of 120 s; rank 0 writes its pid to PIDFILE
                    before it waits, so that the test can interrupt it (SIGINT, as Ctrl-C).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from axonml_distributed.mpi import init_mpi_process_group


def main(scenario: str) -> None:
    if scenario == "late":
        late()
        return
    if scenario in ("init-missing", "new-group-missing", "init-interrupted"):
        missing(scenario)
        return
    if scenario not in ("raise", "timeout", "timeout-unchecked", "group-timeout"):
        raise SystemExit(f"unknown scenario {scenario!r}")
    timeout = 1.5 if scenario in ("timeout", "timeout-unchecked") else 120
    pg = init_mpi_process_group(timeout=timeout, check_signatures=scenario != "timeout-unchecked")
    if scenario == "group-timeout":
        pg = pg.new_group(range(pg.size()), timeout=1.5)
    if pg.rank() == 1:
        if scenario == "raise":
            raise RuntimeError("rank 1 fails in user code")
        time.sleep(60)
    pg.all_reduce(np.ones(1000, np.float32))
    raise SystemExit(f"scenario {scenario}: all_reduce should never have returned")


def missing(scenario: str) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    last = rank == MPI.COMM_WORLD.Get_size() - 1
    if scenario != "new-group-missing" and last:
        time.sleep(60)
    if scenario == "init-interrupted" and rank == 0:
        with open(sys.argv[2] + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    pg = init_mpi_process_group(timeout=120 if scenario == "init-interrupted" else 1.5)
    if last:
        time.sleep(60)
    pg.new_group(list(range(pg.size())))
    raise SystemExit(f"scenario {scenario}: should never get here")


def late() -> None:
    pg = init_mpi_process_group(timeout=120)
    buf = np.ones(1000, np.float32)
    if pg.rank() == 1:
        time.sleep(2.0)
    wall, cpu = time.monotonic(), time.process_time()
    pg.all_reduce(buf)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert buf[0] == pg.size()
    if pg.rank() == 0:
        print(f"waited {wall:.2f} s using {cpu:.3f} s of CPU", flush=True)
        assert wall > 1.5 and cpu < 0.2 * wall, f"waiting burned the CPU: {cpu:.3f} s in {wall:.2f} s"


if __name__ == "__main__":
    main(sys.argv[1])
