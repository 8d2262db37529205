"""A torchrun job for tests/test_hosts_torch.py: an elastic restart over the backend argv[1] ("axonml",
or "gloo" to compare). Rank 2 (on h1) fails once, leaving a marker in its host's private /tmp; torchrun
restarts the workers, the job re-forms and every rank prints ``rank R of W: all_reduce right``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from output import say  # the jobs' directory is on sys.path: they run as scripts

BACKEND = sys.argv[1]
MARKER = Path(f"/tmp/axonml-hosts-elastic-{BACKEND}-failed-once")

dist.init_process_group(BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((100_003,), float(rank))
dist.all_reduce(t)
right = torch.equal(t, torch.full((100_003,), float(sum(range(world)))))
if rank == 2 and not MARKER.exists():
    MARKER.touch()
    raise RuntimeError("rank 2 fails once")
dist.barrier()
say(f"rank {rank} of {world}: all_reduce {'right' if right else 'WRONG'}")
dist.destroy_process_group()
sys.exit(0 if right else 1)
