"""monitored_barrier over MPI. Usage: monitored.py SCENARIO

- ok:      every rank arrives: the group's method (seconds, a timedelta, None) and the module helper
           pass, and the group still works after them; rank 0 prints "monitored ok".
- missing: every rank from 2 on never arrives (the job's timeout is 120 s); ranks 0 and 1
           (monitored_barrier of 1 s) report CollectiveTimeoutError naming all of them and abort the job.
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
    if scenario == "ok":
        pg.monitored_barrier(30)
        pg.monitored_barrier(timedelta(seconds=30), True)
        pg.monitored_barrier()
        ad.monitored_barrier(30, group=pg)
        buf = np.ones(3, np.float32)
        pg.all_reduce(buf)
        assert (buf == pg.size()).all()
        if pg.rank() == 0:
            print("monitored ok", flush=True)
        return
    if scenario != "missing":
        raise SystemExit(f"unknown scenario {scenario!r}")
    if pg.rank() >= 2:
        time.sleep(60)
    pg.monitored_barrier(1.0)
    raise SystemExit("monitored_barrier should never have returned")


if __name__ == "__main__":
    main(sys.argv[1])
