"""A torchrun job for tests/test_simhosts.py: gloo's all_reduce across simulated hosts, the baseline the
"axonml" backend is to match there. Each rank checks the sum against one computed here from every rank's
input (integers in float32, exact in any order) and prints ``rank R of W on HOST: <verdict>``; exit 0 =
the sum was right.
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist


def inputs(rank: int) -> torch.Tensor:
    return torch.arange(100_003, dtype=torch.float32) % 251 * (rank + 1) - rank


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = inputs(rank)
    dist.all_reduce(tensor)
    expected = sum(inputs(r) for r in range(world))
    verdict = "sum right" if torch.equal(tensor, expected) else "sum WRONG"
    print(f"rank {rank} of {world} on {socket.gethostname()}: {verdict}", flush=True)
    dist.destroy_process_group()
    return 0 if verdict == "sum right" else 1


if __name__ == "__main__":
    sys.exit(main())
