"""Many arrays in few flat buffers: the bucket cap argument of gradient buckets (the native engine,
`GradientSynchronizer.for_parameters`, lays them out), and broadcasting many arrays at once. Shared by both
DDPs and the Horovod-style API."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axonml_distributed._types import ProcessGroupLike

_MIB = 1024 * 1024
# Parameters and buffers travel in broadcasts of at most this many bytes (torch uses 250 MiB).
_BROADCAST_CAP = 256 * _MIB


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
