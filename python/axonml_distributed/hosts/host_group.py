"""A native group of this host's world, in a job over several hosts, that names ranks as the job does.

The host's world numbers its ranks 0..n-1 on each host, and so do the core's errors from it (rank,
ranks, group, the members' calls); every other error across hosts names a rank as the job knows it.
`HostGroup` gives the core's errors the job's ranks (`in_job_ranks`): a subgroup of ranks on one host
that is not host 0 (``new_group([2, 3])`` on 2 hosts x 2 ranks) and the host level of a two-level
all_reduce, under torch and MPI alike; the MPI backend maps its host world's rendezvous errors, raised
before there is a group, through the same `in_job_ranks`. The flight recorder's dumps and the timeline
map their records themselves (`trace.record.to_job_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from axonml_distributed._core import ProcessGroup
from axonml_distributed._core import Work as NativeWork
from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    PeerFailureError,
)


class HostGroup:
    """A native group of this host's world in a job over several hosts, whose errors name the job's
    ranks: the host's world numbers its ranks 0..n-1 on each host, and so do the core's errors, but
    every other error across hosts names a rank as the job knows it. Any other call, and what it
    returns, is the native group's (roots, peers and `ranks()` stay the host's: the core takes those)."""

    def __init__(self, native: ProcessGroup, host_ranks: Sequence[int]) -> None:
        self._native = native
        self._host = JobRanks(host_ranks, native.rank(), native.ranks())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._native, name)
        if not callable(attr) or name in _HOST_FACTS:
            return attr
        host = self._host

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = attr(*args, **kwargs)
            except DistributedError as e:
                raise in_job_ranks(e, host) from e
            return _HostWork(result, host) if isinstance(result, NativeWork) else result

        self.__dict__[name] = call  # found here from now on, without this lookup
        return call

    def in_job_ranks(self, e: DistributedError) -> DistributedError:
        """`e`, an error that names ranks as this group's native group does (one its torch group makes
        itself, from the native's `rank()` and `ranks()`), in the job's ranks."""
        return in_job_ranks(e, self._host)


# What a native group tells without a call into the engine: nothing to translate.
_HOST_FACTS = {"backend", "rank", "ranks", "size", "world_size", "group_rank", "contains", "timeout"}


class JobRanks:
    """The job's rank of each rank of the host's world (`host[i]`), of this rank (`me`, its index in the
    host's world) and of the group's members (`members`, theirs)."""

    def __init__(self, host: Sequence[int], me: int, members: Sequence[int]) -> None:
        self.host = host
        self.me = host[me]
        self.group = [host[r] for r in members]


class _HostWork:
    """A native work of a `HostGroup`: its errors in the job's ranks."""

    __slots__ = ("_work", "_host")

    def __init__(self, work: NativeWork, host: JobRanks) -> None:
        self._work, self._host = work, host

    def wait(self) -> Any:
        try:
            return self._work.wait()
        except DistributedError as e:
            raise in_job_ranks(e, self._host) from e

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def source_rank(self) -> int:
        try:
            return self._work.source_rank()
        except DistributedError as e:
            raise in_job_ranks(e, self._host) from e


def in_job_ranks(e: DistributedError, ranks: JobRanks) -> DistributedError:
    """The core's error `e` from a group of this host's world, in the job's ranks: its facts mapped
    (this rank and the group's members where the core left them out: an aborted world's error), its
    text kept after the table of the host's ranks (its own words, the progress among them, number the
    ranks as the host does)."""
    host = ranks.host

    def job(ranks: Any) -> list[int]:
        return [host[r] for r in ranks if 0 <= r < len(host)]

    rank = ranks.me
    table = ", ".join(f"{i} = {r}" for i, r in enumerate(host))
    facts: dict[str, Any] = {
        "rank": rank,
        "ranks": job(e.ranks),
        "call": e.call,
        "seq": e.seq,
        "group": ranks.group if e.group is None else job(e.group),
        "progress": e.progress,
    }
    if isinstance(e, CollectiveMismatchError):
        facts["calls"] = {host[r]: c for r, c in e.calls.items() if 0 <= r < len(host)}
    elif isinstance(e, CollectiveTimeoutError):
        facts["waited"] = e.waited
    elif isinstance(e, PeerFailureError):
        facts.update(pid=e.pid, exit_code=e.exit_code, signal=e.signal)
    kind = (
        type(e)
        if type(e) in (CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError)
        else DistributedError
    )
    named = f"rank(s) {facts['ranks']}; " if facts["ranks"] else ""
    call = e.call or "a call"
    return kind(
        f"rank {rank}: {call} failed inside this host ({named}host ranks to global ranks: {table}): {e}",
        **facts,
    )
