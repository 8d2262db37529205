"""Run a function on every rank of a fresh in-process world, one thread per rank."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from axonml_distributed._core import ProcessGroup, ThreadBackend
from axonml_distributed.exceptions import DistributedError, SpawnError
from axonml_distributed.init import _set_default_group

T = TypeVar("T")


def spawn(fn: Callable[..., T], world_size: int, *args: Any, timeout: float | None = None) -> list[T]:
    """Call ``fn(process_group, *args)`` on one thread per rank and return the results in rank order.

    Collectives release the GIL while they wait, so the rank threads really run together. If any rank
    raises, the world is aborted (the other ranks' collectives fail at once instead of hanging) and
    `SpawnError` names the first rank that raised, with its exception chained. A rank whose function
    returns while peers still wait for it in a collective makes them raise `PeerFailureError` naming
    it; what it queued with ``async_op=True`` and never waited for gets up to 2 s to run first (so an
    unwaited send still reaches its peer). ``timeout`` bounds every wait inside the world (seconds,
    default 300). Inside ``fn`` the rank's group is also the default group, so comm functions and DDP
    called without a group use it.
    """
    backends = ThreadBackend.create_world(world_size, timeout=timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def run(rank: int) -> None:
        pg = ProcessGroup(backends[rank])
        _set_default_group(pg)
        try:
            results[rank] = fn(pg, *args)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
            with lock:
                errors.append((rank, e))
            backends[rank].abort(f"{type(e).__name__} in rank {rank}: {e}")
        finally:
            # A rank that returned makes no more calls: peers still waiting for it fail at once.
            backends[rank].leave()

    threads = [
        threading.Thread(target=run, args=(r,), name=f"axonml-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            # Join in slices so Ctrl-C reaches this thread, which then aborts the world.
            while t.is_alive():
                t.join(0.1)
    except KeyboardInterrupt:
        backends[0].abort("interrupted (KeyboardInterrupt in the spawning thread)")
        raise
    if errors:
        # Report the rank that failed first on its own; the others usually fail because of the abort.
        rank, err = next(((r, e) for r, e in errors if not isinstance(e, DistributedError)), errors[0])
        raise SpawnError(rank, f"rank {rank} raised {type(err).__name__}: {err}") from err
    return results
