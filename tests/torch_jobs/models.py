"""Models the torch jobs share: the PyTorch DDP tutorial's ToyModel."""

from __future__ import annotations

import torch
from torch import nn


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))  # type: ignore[no-any-return]
