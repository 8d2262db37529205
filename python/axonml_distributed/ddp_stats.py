"""What ``ddp.stats()`` returns: where a DistributedDataParallel's steps spent their time.

A step is one gradient reduction. Every figure comes from one monotonic clock, the one the gradient
synchronizer stamps its buckets with (ready, launched, returned: the stamps the timeline draws), read by
the native engine on this rank:

- the step **starts** at its first training forward since the previous reduction ended (for torch modules:
  the first forward with gradients enabled, inside ``no_sync()`` too), or, if no forward went through the
  wrapper, when its first gradient was handed to the engine;
- its **compute** runs from the start until the engine's ``finish`` is called: forward, backward (and
  the micro-batches accumulated under ``no_sync()``), at the end of backward for torch modules, inside
  ``sync_gradients()`` for numpy models;
- its **visible sync** runs from that call until it returns: the time the caller waited for the
  reduction after its compute (the buckets not yet done, the agreement on which gradients exist, the last
  bucket);
- its **communication** is the time at least one of its buckets' all-reduces was in flight, from its
  launch until it returned (a bucket queued behind an earlier one on the group's worker counts as in
  flight); its **overlapped sync** is the part of that before ``finish`` was called, hidden under compute.

So ``overlapped_sync_s <= compute_s``, ``overlapped_sync_s <= comm_s``, and ``comm_s - overlapped_sync_s
<= visible_sync_s``. What happens between steps (the optimizer step, loading the next batch) counts in
neither. A numpy model's buckets all start inside ``sync_gradients()`` (no autograd hooks to start them
earlier), so its overlapped sync is zero. A reduction that raised is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepStats:
    """One step's figures (or, in `DDPStats.totals`, the sums over every step): seconds on the engine's
    monotonic clock, bytes and buckets of this rank."""

    step: int
    """The step's position (0 for the first); in totals, the number of steps."""
    start_ns: int
    """When the step started, wall-clock nanoseconds since the Unix epoch (the timeline's clock); in
    totals, the first step's start."""
    compute_s: float
    """From the step's start until the reduction was called."""
    visible_sync_s: float
    """From the call of the reduction until it returned."""
    overlapped_sync_s: float
    """Communication before the reduction was called (hidden under compute)."""
    comm_s: float
    """Time at least one of the step's bucket all-reduces was in flight."""
    bytes: int
    """Bytes of the buckets reduced (this rank's buffers: elements times element size)."""
    buckets: int
    """Buckets reduced."""

    @classmethod
    def from_native(cls, d: dict[str, Any]) -> StepStats:
        return cls(**d)


@dataclass(frozen=True)
class DDPStats:
    """Every step since the wrapper was made (or rebuilt its buckets, after ``to()``): the totals, and
    the last steps one by one (at most 100, oldest first). See the module for what each figure means."""

    totals: StepStats
    last: tuple[StepStats, ...]

    @property
    def steps(self) -> int:
        """Steps reduced so far."""
        return self.totals.step

    @classmethod
    def from_native(cls, d: dict[str, Any]) -> DDPStats:
        return cls(StepStats.from_native(d["totals"]), tuple(StepStats.from_native(s) for s in d["last"]))
