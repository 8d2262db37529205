"""The job behind docs/timeline.png: numpy DDP on 2 ranks (threads), 3 steps of a stand-in model of 1.3M
float32 parameters in 4 buckets, rank 1's backward twice as long as rank 0's, each step and its
forward+backward marked with `trace_span`; its timeline drawn as a Gantt chart.

    python docs/timeline_example.py docs/timeline.png    # also leaves docs/timeline.png's JSON beside it
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import axonml_distributed as ad
from axonml_distributed.trace.gantt import draw

SIZES = (400_000, 400_000, 300_000, 200_000)


class Param:
    def __init__(self, n: int, rank: int) -> None:
        self.data = np.zeros(n, np.float32)
        self.grad = np.full(n, float(rank), np.float32)


class Model:
    def __init__(self, rank: int) -> None:
        self.params = [Param(n, rank) for n in SIZES]

    def parameters(self) -> list[Param]:
        return self.params

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x


def job(pg: ad.ProcessGroup) -> None:
    ddp = ad.DDP(Model(pg.rank()), pg, bucket_cap_mb=1.6)
    for step in range(3):
        with ad.trace_span(f"step {step}"):
            with ad.trace_span("forward+backward"):
                ddp(np.ones(4))
                np.sqrt(np.arange(1_000_000 * (1 + pg.rank())))  # the work of a backward
            ddp.sync_gradients()


if __name__ == "__main__":
    picture = Path(sys.argv[1])
    timeline = picture.with_suffix(".json")
    with ad.timeline(timeline):
        ad.spawn(job, 2)
    import json

    draw(json.loads(timeline.read_text()), picture)
    print(f"{timeline}, {picture}")
