"""Many arrays in few flat buffers: the bucket layout of gradients, and broadcasting many arrays at once.
Shared by both DDPs and the Horovod-style API."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from axonml_distributed._types import ProcessGroupLike

_MIB = 1024 * 1024
# Parameters and buffers travel in broadcasts of at most this many bytes (torch uses 250 MiB).
_BROADCAST_CAP = 256 * _MIB


def assign_buckets(nbytes: Sequence[int], dtypes: Sequence[Hashable], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, in the order the buckets are reduced.

    Parameters are taken in reverse order (backward produces gradients roughly last layer first), one open
    bucket per dtype (any hashable key: numpy or torch dtypes); a bucket is closed before it would pass
    ``cap_bytes``, so only a single parameter larger than the cap makes a bucket exceed it. Unlike torch
    there is no smaller first bucket, nor a rebuild in the order the first backward produced gradients.
    """
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(nbytes))):
        members, size = open_buckets.get(dtypes[i], ([], 0))
        if members and size + nbytes[i] > cap_bytes:
            closed.append(members)
            members, size = [], 0
        members.append(i)
        open_buckets[dtypes[i]] = (members, size + nbytes[i])
    closed.extend(members for members, _ in open_buckets.values())
    # Reduce first the bucket whose first parameter comes latest, i.e. whose gradients are ready first.
    closed.sort(key=lambda members: -members[0])
    return closed


def bucket_bytes(bucket_cap_mb: float) -> int:
    """The bucket cap in bytes, checked."""
    if not (bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    return int(bucket_cap_mb * _MIB)


def broadcast_arrays(pg: ProcessGroupLike, arrays: Sequence[np.ndarray], root: int | None = None) -> None:
    """Overwrite every array in place with global rank `root`'s (None: the group's first rank), moving raw
    bytes (so any dtype: bool masks, int16 counters...) in as few broadcasts as fit `_BROADCAST_CAP` each."""
    root = pg.ranks()[0] if root is None else root
    is_root = pg.rank() == root
    i = 0
    while i < len(arrays):
        batch = [arrays[i]]
        total = arrays[i].nbytes
        i += 1
        while i < len(arrays) and total + arrays[i].nbytes <= _BROADCAST_CAP:
            total += arrays[i].nbytes
            batch.append(arrays[i])
            i += 1
        staging = pg.empty((total,), np.uint8)
        offset = 0
        for array in batch:
            if is_root:
                staging[offset : offset + array.nbytes] = raw_bytes(array)
            offset += array.nbytes
        pg.broadcast(staging, root)
        if not is_root:
            offset = 0
            for array in batch:
                chunk = staging[offset : offset + array.nbytes]
                np.copyto(array, chunk.view(array.dtype).reshape(array.shape))
                offset += array.nbytes


def raw_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes, flat (a copy only when it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
