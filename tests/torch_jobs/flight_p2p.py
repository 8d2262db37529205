"""A torchrun job for tests/test_flight_p2p.py: torch's point to point over the "axonml" backend (one
host, 2 ranks): batch_isend_irecv around the ring, then isend / irecv, then a barrier; each rank writes
its flight record to OUT/rank<R>.json. Usage: flight_p2p.py OUT."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from axonml_distributed import trace


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("axonml", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    peer, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(5)
    ops = [dist.P2POp(dist.irecv, got, prev), dist.P2POp(dist.isend, torch.ones(5), peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if rank == 0:
        dist.isend(torch.ones(7, dtype=torch.float64), 1, tag=3).wait()
    else:
        dist.irecv(torch.empty(7, dtype=torch.float64), 0, tag=3).wait()
    dist.barrier()
    trace.dump_flight_recorder(out / f"rank{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
