"""The two-level all_reduce, written once for every engine between hosts (torch's gloo, MPI).

Per pipeline segment of the buffer: reduce-scatter inside the host through our shared memory (local
rank i gets shard i of the host's partial sum), all-reduce of shard i with local rank i of every other
host through the engine (every local rank drives its own link traffic, so all of them are busy), then
all-gather inside the host. Segment k's exchange between hosts runs while segment k+1 is reduced in the
host and segment k-1 gathered, so the levels overlap.

Bitwise identical results on every rank: inside the host each element's sum is formed by one rank in
local-rank order (the core's owner-computes); between hosts the engine must hand every member the same
bytes (gloo's ring all-reduce and the MPI group's reduce-scatter + all-gather reduce each element at one
rank and copy it to the rest); the in-host all-gather copies. Which element goes where depends only on
the count, the segment size and the number of ranks per host, so runs repeat bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from axonml_distributed._core import ProcessGroup, ReduceOp
from axonml_distributed.hosts.host_group import HostGroup

# Measured with `python -m axonml_distributed.bench --hosts 2` (2 simulated hosts x 2 ranks on 2 cores,
# 10 Gbit/s links, README "Several hosts"): each engine call between hosts costs milliseconds there, so
# pipeline segments pay only when large (64 MiB: 1.07-1.20x flat gloo with 32-64 MiB segments, 0.95-0.99x
# with 8-16 MiB), and below 32 MiB one flat call over every rank was as fast or faster. Where the links,
# not the cores, are the bottleneck, smaller values of both pay: AXONML_HOSTS_SEGMENT_KIB and
# AXONML_HOSTS_FLAT_BELOW set them.
DEFAULT_SEGMENT_BYTES = 32 << 20
DEFAULT_FLAT_BELOW = 32 << 20


class Waitable(Protocol):
    def wait(self) -> Any: ...


# An engine's all-reduce of one shard with the same local rank of every other host: started, not
# finished (the caller waits), in place.
CrossAllReduce = Callable[[Any], Waitable | None]


def split(count: int, parts: int) -> list[int]:
    """`count` elements in `parts` near-equal consecutive pieces, the larger first."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


class TwoLevelAllReduce:
    """All-reduces a flat contiguous buffer (numpy array or CPU tensor) over `local` (this host's group,
    native) and an engine between hosts. One per group; calls run in program order."""

    def __init__(self, local: ProcessGroup | HostGroup, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self._local = local
        self._parts = local.size()
        self._me = local.group_rank(local.rank())
        self._segment_bytes = segment_bytes
        self._scratch: dict[Any, Any] = {}

    def __call__(
        self,
        flat: Any,
        local_op: ReduceOp,
        cross: CrossAllReduce,
        post: Callable[[Any], object] | None = None,
    ) -> None:
        """`flat` reduced in place: `local_op` inside the host, `cross` between hosts, then `post` on
        this rank's reduced shard (AVERAGE's division) before the shards are gathered."""
        count = len(flat)
        seg = max(self._parts, self._segment_bytes // flat.itemsize)
        plan = []
        offset = 0
        for start in range(0, count, seg):
            counts = split(min(seg, count - start), self._parts)
            plan.append((start, start + sum(counts), counts, offset))
            offset += counts[self._me]
        scratch = self._scratch_for(flat, offset)
        pending: tuple[Any, Any, list[int], Waitable | None] | None = None
        for start, stop, counts, at in plan:
            segment, shard = flat[start:stop], scratch[at : at + counts[self._me]]
            self._local.reduce_scatter_v(segment, shard, counts, local_op)
            started = cross(shard) if counts[self._me] else None
            if pending is not None:
                self._finish(*pending, post)
            pending = (segment, shard, counts, started)
        if pending is not None:
            self._finish(*pending, post)

    def _finish(
        self,
        segment: Any,
        shard: Any,
        counts: list[int],
        started: Waitable | None,
        post: Callable[[Any], object] | None,
    ) -> None:
        if started is not None:
            started.wait()
        if post is not None and counts[self._me]:
            post(shard)
        self._local.all_gather_v(shard, segment, counts)

    def _scratch_for(self, flat: Any, count: int) -> Any:
        """A reused buffer of at least `count` elements of `flat`'s type and dtype."""
        key = (type(flat), flat.dtype)
        held = self._scratch.get(key)
        if held is None or len(held) < count:
            held = flat.new_empty(count) if hasattr(flat, "new_empty") else np.empty(count, flat.dtype)
            self._scratch[key] = held
        return held
