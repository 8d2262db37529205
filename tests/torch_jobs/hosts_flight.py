"""A torchrun job for tests/test_flight_hosts.py: the calls gloo carries across hosts (2 hosts x 2 ranks)
in the flight recorder, beside calls inside each host and on a group of one rank. Each rank makes the
calls below, then prints its flight record (the entries of its host's world, of its group of one and
the calls gloo carried) as one line ``FLIGHT <rank> <json>``.
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
    # Inside each host, on a group of its two ranks: a broadcast from the second and a message from the
    # second to the first (the host's world numbers them 0 and 1; the records carry the job's).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    first = rank - rank % 2
    t = torch.ones(3)
    dist.broadcast(t, src=first + 1, group=pairs[rank // 2])
    if rank == first:
        dist.recv(t, src=first + 1, tag=7, group=pairs[rank // 2])
    else:
        dist.send(t, dst=first, tag=7, group=pairs[rank // 2])
    # A group of this rank alone (a world of one rank): its record is this rank's.
    alone, _ = dist.new_subgroups(group_size=1)
    dist.all_reduce(torch.ones(2), group=alone)
    # Across hosts with no call after it on the group: each ends in its own wait; rank 3 receives from any
    # source and names its sender.
    if rank == 1:
        dist.send(torch.ones(2), dst=3, tag=9)
    elif rank == 3:
        assert dist.recv(torch.empty(2), tag=9) == 1
    say(f"FLIGHT {rank} {json.dumps(trace.flight_record())}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
