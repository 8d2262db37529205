"""Meeting the shared-memory world through the Store torch hands the backend (see the package docs)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket

import torch.distributed as dist

from axonml_distributed import settings
from axonml_distributed._core import Backend, DistributedError, ShmSegment


def _host_identity() -> str:
    """This host: its name and its boot id (containers share the kernel's boot id, not the name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()} (boot {boot})"


def _mac(secret: bytes | None, token: str) -> str:
    """The token's HMAC under the job secret (the decoded bytes, as the shm world's rendezvous keys it);
    empty without one."""
    return hmac.new(secret, token.encode(), hashlib.sha256).hexdigest() if secret else ""


def _get(store: dist.Store, key: str, timeout: datetime.timedelta) -> str:
    store.wait([key], timeout)
    return store.get(key).decode()


def join_world(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Backend:
    """The shared-memory world of `size` ranks, met through `store`."""
    # Settings first: a rank with an unusable one touches nothing. (Rank 0's arena counts.)
    secret, arena = settings.job_secret(), settings.shm_arena_bytes()
    store.set(f"axonml/host/{rank}", _host_identity())
    if rank == 0:
        hosts = [_get(store, f"axonml/host/{r}", timeout) for r in range(size)]
        if len(set(hosts)) > 1:
            where = ", ".join(f"rank {r} on {h}" for r, h in enumerate(hosts))
            problem = (
                f"the axonml backend runs the ranks of one host only ({where}); jobs over several hosts "
                "come with the hierarchical (multi-host) issue: use gloo for them until then"
            )
            store.set("axonml/token", "error: " + problem)
            raise DistributedError(problem)
        segment = ShmSegment(size, arena)
        try:
            store.set("axonml/token", f"{segment.token}\n{_mac(secret, segment.token)}")
            world = ShmSegment.join(segment.token, 0, size, timeout.total_seconds())
        finally:
            segment.close()
        # Every rank has joined, so none reads these again: a later init over the same store (torchrun
        # keeps one per agent) must not find this job's token.
        for key in ["axonml/token", *(f"axonml/host/{r}" for r in range(size))]:
            store.delete_key(key)
        return world
    token, _, mac = _get(store, "axonml/token", timeout).partition("\n")
    if token.startswith("error: "):
        raise DistributedError(token.removeprefix("error: "))
    if not hmac.compare_digest(mac, _mac(secret, token)):
        raise DistributedError(
            f"the shared-memory token in the store does not carry this job's {settings.JOB_SECRET}: the "
            "store is shared with another job, or its ranks were started with different secrets"
        )
    return ShmSegment.join(token, rank, size, timeout.total_seconds())
