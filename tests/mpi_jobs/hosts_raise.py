"""An mpiexec job for tests/test_hosts_mpi.py: after two two-level all_reduces across the hosts, rank 3
(on the second host) raises in user code while the others wait in the third (the group's timeout is
120 s). Under `python -m mpi4py` the whole job must end at once, with a non-zero exit."""

from __future__ import annotations

import socket

import numpy as np

import axonml_distributed as ad

pg = ad.init_process_group("mpi", timeout=120)
for _ in range(2):
    pg.all_reduce(np.ones(100_000, np.float32))
if pg.rank() == 3:
    raise RuntimeError(f"rank 3 on {socket.gethostname()} fails in user code")
pg.all_reduce(np.ones(100_000, np.float32))
raise SystemExit(f"rank {pg.rank()}: the all_reduce should never have returned")
