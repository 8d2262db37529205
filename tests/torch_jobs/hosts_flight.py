"""A torchrun job for tests/test_flight_hosts.py: the calls gloo carries across hosts (2 hosts x 2 ranks)
in the flight recorder. Each rank makes the calls below, then prints its flight record (the entries of
its host's world and the calls gloo carried) as one line ``FLIGHT <rank> <json>``.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from output import say

from axonml_distributed import trace


def main() -> int:
    dist.init_process_group("axonml", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(10))  # below the two-level cut (the test's 64 KiB): one gloo call
    dist.all_reduce(torch.ones(40_000, dtype=torch.float64))  # two levels: shards between hosts
    dist.broadcast(torch.ones(6, dtype=torch.int32), src=1)
    if rank == 0:
        dist.send(torch.ones(3), dst=2, tag=5)
    elif rank == 2:
        dist.recv(torch.empty(3), src=0, tag=5)
    dist.barrier()
    say(f"FLIGHT {rank} {json.dumps(trace.flight_record())}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
