"""An mpiexec job for tests/test_simhosts.py: the MPI process group's all_reduce across simulated hosts,
against the numpy reference, the result bitwise identical on every rank. Rank 0 prints a line
``rank R of W on HOST: all_reduce right`` for each rank (mpiexec would interleave the ranks' own lines);
exit 0 = pass.
"""

from __future__ import annotations

import socket

import numpy as np
from jobutil import identical_on_all_ranks
from mpi4py import MPI

import axonml_distributed as ad
from reference import all_inputs, expect_same, reduce_ref

pg = ad.init_process_group("mpi")
rank, world = pg.rank(), pg.size()
for dtype in (np.float32, np.int64):
    inputs = all_inputs(world, "across-hosts", (100_003,), dtype)
    buf = inputs[rank].copy()
    pg.all_reduce(buf)
    expect_same(buf, reduce_ref(inputs, "SUM"), f"all_reduce {np.dtype(dtype).name} across hosts")
    identical_on_all_ranks(buf, f"all_reduce {np.dtype(dtype).name} across hosts")
hosts = MPI.COMM_WORLD.gather(socket.gethostname())
if rank == 0:
    print(
        "".join(f"rank {r} of {world} on {host}: all_reduce right\n" for r, host in enumerate(hosts)),
        flush=True,
    )
ad.destroy_process_group()
