"""One rank of a small DDP training job, written as a PyTorch user would; ``torch`` or ``axonml`` in argv[1]
picks whose DDP and process group it imports, and nothing else differs. Run under
``python -m axonml_distributed.run --nproc-per-node 2`` (torchrun's environment, which both read).
Each rank saves its final state_dicts to ``argv[2]/<impl>.<rank>.pt``.

Models: the PyTorch DDP tutorial's ToyModel (MSE, SGD lr 0.001) and a small CNN with batch norm (cross
entropy, SGD with momentum). Every rank starts from its own random weights (the constructor must
broadcast rank 0's) and trains on its own data.
"""

from __future__ import annotations

import os
import sys

import torch
from models import ToyModel  # the jobs' directory is on sys.path: they run as scripts
from torch import nn

IMPL, OUT = sys.argv[1], sys.argv[2]
STEPS = 4

if IMPL == "torch":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
else:
    import axonml_distributed as dist  # type: ignore[no-redef]
    from axonml_distributed import DistributedDataParallel as DDP  # type: ignore[assignment]

    dist.init_process_group("shm", timeout=60)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))  # type: ignore[no-any-return]


def train(model: nn.Module, make_batch: object, loss_fn: nn.Module, opt_args: dict[str, float]) -> dict:
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), **opt_args)
    for step in range(STEPS):
        x, y = make_batch(step)  # type: ignore[operator]
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    return ddp.state_dict()


def main() -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    torch.manual_seed(100 + rank)  # different weights on every rank
    toy, cnn = ToyModel(), SmallCNN()
    data = torch.Generator().manual_seed(7 + rank)  # different data on every rank

    def toy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(20, 10, generator=data), torch.randn(20, 5, generator=data)

    def cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(6, 1, 8, 8, generator=data), torch.randint(0, 3, (6,), generator=data)

    result = {
        "toy": train(toy, toy_batch, nn.MSELoss(), {"lr": 0.001}),
        "cnn": train(cnn, cnn_batch, nn.CrossEntropyLoss(), {"lr": 0.1, "momentum": 0.9}),
    }
    torch.save(result, os.path.join(OUT, f"{IMPL}.{rank}.pt"))
    dist.destroy_process_group()


main()
