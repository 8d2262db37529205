"""The multi-process world on one host, through a shared-memory segment (backend "shm").

Processes find each other through rank 0, which listens on MASTER_ADDR:MASTER_PORT while the job starts
(so jobs with different ports never mix); after that everything goes through one /dev/shm segment that
is already unlinked, so nothing is left behind even if every rank is killed.
"""

from __future__ import annotations

import os

from axonml_distributed._core import ProcessGroup, ShmBackend


def init_shm_process_group(rank: int, world_size: int, timeout: float | None = None) -> ProcessGroup:
    """Join the shared-memory world as ``rank`` of ``world_size`` and return the group of every rank.

    Reads MASTER_ADDR (default 127.0.0.1), MASTER_PORT (required), AXONML_JOB_ID (set by axonml-run:
    names the segment so the launcher can remove it after a crash) and AXONML_SHM_ARENA_MB (room per
    rank for ``ProcessGroup.empty`` arrays, default 64; arrays that do not fit fall back to private
    memory). Rank 0 also reads AXONML_SHM_CHUNK_KIB, the pipeline round size for large messages on
    private arrays (default 1024), a tuning knob. ``timeout`` bounds the rendezvous and every later
    wait (seconds, default 300).
    """
    port = os.environ.get("MASTER_PORT")
    if not port:
        raise ValueError("MASTER_PORT is not set: start the job with axonml-run, or set it (and MASTER_ADDR)")
    arena = os.environ.get("AXONML_SHM_ARENA_MB")
    backend = ShmBackend.connect(
        rank,
        world_size,
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(port),
        timeout=timeout,
        job_id=os.environ.get("AXONML_JOB_ID") or None,
        arena_bytes=int(float(arena) * (1 << 20)) if arena else None,
    )
    return ProcessGroup(backend)
