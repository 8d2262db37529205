"""The demo's ``--scaling``: training throughput at 1, 2 and 4 ranks of the in-process world.

Each world trains the same model for the same epochs with the same per-rank batch (so a step of N
ranks takes N batches: weak scaling of the global batch), and samples per second counts every rank's
samples. Ranks are threads of this process: they share its cores, so on a machine with fewer cores than
ranks the extra ranks take turns rather than add throughput.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from axonml_distributed.demo.train import Config, Digits, train
from axonml_distributed.spawn import spawn

RANKS = (1, 2, 4)


def measure(cfg: Config, data: Digits) -> list[dict[str, Any]]:
    """Samples per second of a training run per world size in RANKS."""
    out = []
    for n in RANKS:
        summary = spawn(train, n, replace(cfg, world_size=n, check=False, quiet=True), data)[0]
        assert summary is not None  # rank 0 always returns the summary
        out.append({"ranks": n, "samples_per_sec": summary["samples_per_sec"]})
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Lines of the scaling table: throughput, speed-up over 1 rank and efficiency (speed-up / ranks)."""
    base = rows[0]["samples_per_sec"]
    lines = [f"{'ranks':>5} | {'samples/s':>10} | {'speed-up':>8} | {'efficiency':>10}"]
    for r in rows:
        up = r["samples_per_sec"] / base
        lines.append(
            f"{r['ranks']:>5} | {r['samples_per_sec']:>10,.0f} | {up:>7.2f}x | {up / r['ranks']:>10.0%}"
        )
    return lines
