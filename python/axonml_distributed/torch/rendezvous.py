"""Meeting the shared-memory world through the Store torch hands the backend: the core's rendezvous
(`ShmBackend.join`), the protocol and job-secret check axonml-run's own store uses too."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from axonml_distributed import settings
from axonml_distributed._core import Backend, ShmBackend


def join_world(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Backend:
    """The shared-memory world of `size` ranks, met through `store`."""
    # Settings first: a rank with an unusable one touches nothing. (Rank 0's arena counts.)
    secret, arena = settings.job_secret(), settings.shm_arena_bytes()
    return ShmBackend.join(store, rank, size, timeout.total_seconds(), arena_bytes=arena, secret=secret)
