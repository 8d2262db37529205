"""An mpiexec job for tests/test_hosts_mpi.py, on 2 simulated hosts x 2 ranks: the host level of the MPI
group over several hosts (each host's shared-memory world). Run as ``hosts_host_level.py MODE``:

- ``meet``: the hosts' loopback interfaces are down (the test's doing): the host's ranks still meet
  (their rendezvous needs no TCP), and a two-level all_reduce of ones sums to 4 on every rank; rank 0
  prints ``host level met without loopback``.
- ``stall``: rank 3 (host h1) passes the signature check of a two-level all_reduce and then never takes
  part in the host level; rank 2, its host peer, times out there (ranks 2 and 3 wait 10 s, ranks 0 and 1,
  which only wait for the others between hosts, 120 s, so rank 2's error is the job's first) and aborts
  the job with its error, which must name rank 3 as the job numbers it.
- ``absent``: rank 3 never comes to its host's rendezvous (after the job's own); rank 2, which keeps the
  host's store, times out there (ranks 2 and 3 wait 10 s, ranks 0 and 1 120 s) and raises, naming rank 3
  as the job numbers it.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import axonml_distributed as ad
from axonml_distributed.mpi import MpiHostsProcessGroup, hosts

COUNT = 100_000  # above the test's cut (AXONML_HOSTS_FLAT_BELOW=0): both levels
mode = sys.argv[1]
me = MPI.COMM_WORLD.Get_rank()


class NeverJoins:
    @staticmethod
    def join(*_: object, **__: object) -> None:
        time.sleep(120)


if mode == "absent" and me == 3:
    hosts.ShmBackend = NeverJoins  # type: ignore[assignment,misc]
pg = ad.init_process_group("mpi", timeout=10 if mode in ("stall", "absent") and me >= 2 else 120)
assert isinstance(pg, MpiHostsProcessGroup), repr(pg)

if mode == "meet":
    buf = np.ones(COUNT, np.float32)
    pg.all_reduce(buf)
    assert (buf == 4).all(), buf[:8]
    pg.barrier()
    if me == 0:
        print(f"host level met without loopback: hosts {pg.hosts()}", flush=True)
elif mode == "stall":
    if me == 3:
        pg._two_levels = lambda *_: time.sleep(120)  # type: ignore[method-assign]
    pg.all_reduce(np.ones(COUNT, np.float32))
    raise SystemExit(f"rank {me}: the all_reduce should never have returned")
elif mode == "absent":
    raise SystemExit(f"rank {me}: init_process_group should never have returned")
else:
    raise SystemExit(f"unknown mode {mode!r}")
