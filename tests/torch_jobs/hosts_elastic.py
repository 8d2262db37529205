"""A torchrun job for tests/test_hosts_torch.py: an elastic restart over "axonml". Rank 2 (on h1) fails
once, leaving a marker in its host's private /tmp; torchrun restarts the workers, the job re-forms and
every rank prints ``rank R of W: all_reduce right after N restart(s)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = Path("/tmp/axonml-hosts-elastic-failed-once")

dist.init_process_group("axonml")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((100_003,), float(rank))
dist.all_reduce(t)
right = torch.equal(t, torch.full((100_003,), float(sum(range(world)))))
if rank == 2 and not MARKER.exists():
    MARKER.touch()
    raise RuntimeError("rank 2 fails once")
dist.barrier()
restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
print(f"rank {rank} of {world}: all_reduce {'right' if right else 'WRONG'} after {restarts} restart(s)", flush=True)
dist.destroy_process_group()
sys.exit(0 if right else 1)
