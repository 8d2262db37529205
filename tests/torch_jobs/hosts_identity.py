"""A torchrun job for tests/test_hosts_torch.py: which hosts "axonml" found, and what each rank's host
holds in /dev/shm and maps from it. Prints ``rank R facts <json>`` (the layout, this host's /dev/shm
device and listing, the /dev/shm objects this process maps) and ``rank R all_reduce right|WRONG`` for
one all_reduce above the two-level cut and one below. Run with AXONML_HOST_ID set alike on every host,
the proof must still split them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from output import say  # the jobs' directory is on sys.path: they run as scripts

import axonml_distributed.torch as axonml_torch


def threads() -> list[str]:
    """The names of this process's threads."""
    tasks = Path("/proc/self/task")
    return sorted((t / "comm").read_text().strip() for t in tasks.iterdir())


before = threads()
dist.init_process_group("axonml")
rank, world = dist.get_rank(), dist.get_world_size()
layout = axonml_torch._hosts
assert layout is not None
# Mappings of /dev/shm objects (the segment is unlinked once every rank of the host has it open, so
# they read "(deleted)"): each as "device inode", the device being its host's /dev/shm file system.
with open("/proc/self/maps") as maps:
    fields = (line.split() for line in maps)
    mapped = sorted({f"{f[3]} {f[4]}" for f in fields if len(f) > 5 and f[5].startswith("/dev/shm/")})
shm = os.stat("/dev/shm").st_dev
facts = {
    "hosts": layout.hosts,
    "shm_device": f"{os.major(shm):02x}:{os.minor(shm):02x}",
    "listing": sorted(os.listdir("/dev/shm")),
    "maps": mapped,
}
say(f"rank {rank} facts {json.dumps(facts)}")
right = True
for n in (1_000, 300_003):
    t = torch.arange(n, dtype=torch.float32) % 17 * (rank + 1)
    dist.all_reduce(t)
    right &= torch.equal(t, torch.arange(n, dtype=torch.float32) % 17 * sum(range(1, world + 1)))
say(f"rank {rank} all_reduce {'right' if right else 'WRONG'}")
dist.barrier()  # nobody leaves (and removes the segment) before every rank has looked
during = threads()
dist.destroy_process_group()
say(f"rank {rank} threads {json.dumps({'before': before, 'during': during, 'after': threads()})}")
sys.exit(0 if right else 1)
