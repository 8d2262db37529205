"""The flight record of the calls that gloo carries for a group across hosts (`torch.hosts.
HostsProcessGroup`): its forwarded calls and flat all_reduces, in the group's recorder, and the
all-reduces of the shards between hosts, in the recorder of this rank's peers on the other hosts (every
member of that group reduces the same shard sizes); route "gloo". They sit in the engine's flight
recorder (`_core.FlightRecorder`, world "hosts"), so `dump_flight_recorder`, the timeline and `trace
analyze` show where each rank was across hosts, beside the calls inside each host (the host's world).

A call ends when gloo's work completes (its future's callback). gloo's sends and receives have no future,
and complete only in their `wait()` (gloo's own `is_completed()` stays false until then): each is handed
back wrapped (`P2pWork`), and ends in its `wait()`, with the sender of a receive from any source; one
never waited for stays scheduled, as a send or receive stuck on a dead host does."""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed._core import FlightCall, FlightRecorder, ReduceOp
from axonml_distributed.torch.group import _op

ROUTE = "gloo"

# gloo's methods (as `HostsProcessGroup` forwards them) -> our collectives.
_KINDS = {
    "broadcast": "broadcast",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather",
    "all_gather_single": "all_gather",
    "_allgather_base": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce": "reduce",
    "gather": "gather",
    "gather_single": "gather",
    "gather_into_tensor": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
}

# The recording of the last group made over every rank of the job: the job's, whose naming the other
# groups share. Held weakly, so its records go with its group (`destroy_process_group`), as a native
# group's do, and a later job's groups are never named after it.
_world: weakref.ref[GlooCalls] | None = None


def _ours(op: Any) -> tuple[ReduceOp | None, float]:
    """Our op for torch's reduce op `op` (a ReduceOp or its RedOpType; None: none of ours) and the
    factor each input is scaled by first (PREMUL_SUM's), as the backend translates it."""
    try:
        return _op(op)
    except ValueError:
        return None, 1.0


class GlooCalls:
    """The recording of one group's gloo calls on this rank (see the module docs)."""

    def __init__(
        self, rank: int, world_size: int, ranks: list[int], cross_ranks: Sequence[int] | None
    ) -> None:
        global _world
        world = _world() if _world is not None else None
        if len(ranks) == world_size or world is None:
            self._flight = FlightRecorder("hosts", rank, world_size, ranks)
            _world = weakref.ref(self)
        else:
            self._flight = world._flight.new_group(ranks)
        self._cross = None if cross_ranks is None else self._flight.new_group(sorted(cross_ranks))
        self._ranks = ranks
        self._seq = self._cross_seq = 0

    def collective(
        self,
        kind: str,
        tensors: Sequence[torch.Tensor],
        count: int,
        root: int | None = None,
        op: Any = None,
    ) -> FlightCall:
        """Record collective `kind` of the group on `tensors` (its part `count` elements, `root` a group
        rank, `op` torch's reduce op), started (gloo has every member's data from here on)."""
        self._seq += 1
        dtype = str(tensors[0].dtype) if tensors else None
        root = None if root is None or root < 0 else self._ranks[root]
        ours, prescale = _ours(op) if op is not None else (None, 1.0)
        flight = self._flight.collective(
            kind, self._seq, dtype, max(count, 0), root=root, op=ours, prescale=prescale
        )
        flight.started()
        return flight

    def forwarded(
        self, theirs: str, given: list[Any], tensors: list[torch.Tensor], row: list[int] | None
    ) -> Any:
        """Record gloo's method `theirs` called with `given` (its tensors `tensors`; `row` its signature
        row, None for point to point): the call, for `done`, or None for a method not recorded."""
        if theirs in ("send", "recv", "recv_anysource"):
            peer = None if theirs == "recv_anysource" else self._ranks[int(given[1])]
            dtype = str(tensors[0].dtype)
            count = sum(t.numel() for t in tensors)
            tag = int(given[-1]) if theirs == "recv_anysource" else int(given[2])
            return self._flight.p2p(theirs == "send", peer, tag, dtype, count)
        kind = _KINDS.get(theirs)
        if kind is None:
            return None
        opts: Any = next((a for a in given if type(a).__name__.endswith("Options")), None)
        count = row[2] if row is not None else 0
        root = int(opts.rootRank) if hasattr(opts, "rootRank") else None
        op = opts.reduceOp if hasattr(opts, "reduceOp") else None
        return self.collective(kind, tensors if kind != "barrier" else [], count, root, op)

    def cross_shard(self, shard: torch.Tensor, op: Any) -> FlightCall:
        """Record one shard's all-reduce between hosts, in the group of this rank's peers there."""
        assert self._cross is not None
        self._cross_seq += 1
        flight = self._cross.collective(
            "all_reduce", self._cross_seq, str(shard.dtype), shard.numel(), op=_ours(op)[0]
        )
        flight.started()
        return flight

    def stats(self) -> dict[str, dict[str, Any]]:
        """Totals per kind of the calls recorded here, as the native groups' ``stats()``: the group's own
        and the shards' all-reduces between hosts (each one call), summed."""
        totals = self._flight.stats()
        for kind, theirs in (self._cross.stats() if self._cross is not None else {}).items():
            mine = totals.setdefault(
                kind, {"calls": 0, "failed": 0, "bytes": 0, "wait_s": 0.0, "move_s": 0.0}
            )
            for field in ("calls", "failed", "bytes", "wait_s", "move_s"):
                mine[field] += theirs[field]
            routes = mine.setdefault("routes", {})
            for route, n in theirs["routes"].items():
                routes[route] = routes.get(route, 0) + n
        return totals

    def run(self, flight: FlightCall | None, call: Callable[[], Any]) -> Any:
        """gloo's work of `call()`, the call of `flight` (None: not recorded), whose record ends when the
        work completes, or at once when `call` raises."""
        try:
            work = call()
        except BaseException:
            if flight is not None:
                flight.end(False, ROUTE)
            raise
        if flight is None:
            return work
        if work is None:  # a blocking call, done when it returns (monitored_barrier)
            flight.end(True, ROUTE)
            return None
        try:
            future = work.get_future()
        except RuntimeError:  # a send or receive: no future
            return P2pWork(work, flight, self._ranks)

        def end(f: Any) -> None:
            try:
                f.value()
            except Exception:  # noqa: BLE001 - the caller's wait raises it; the record says failed
                flight.end(False, ROUTE)
            else:
                flight.end(True, ROUTE)

        future.add_done_callback(end)
        return work


class P2pWork(dist.Work):
    """gloo's work of a send or receive, whose `wait()` ends its record (see the module docs); the rest
    is gloo's."""

    def __init__(self, work: Any, flight: FlightCall, ranks: list[int]) -> None:
        dist.Work.__init__(self)
        self._work, self._flight, self._ranks = work, flight, ranks

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            done = self._work.wait() if timeout is None else self._work.wait(timeout)
        except BaseException:
            self._flight.end(False, ROUTE)
            raise
        # False: aborted. A receive's sender, as a global rank (gloo gives the group's), names the sender
        # of a receive from any source; a send has none.
        source = None
        if done:
            try:
                source = self._ranks[self._work._source_rank()]
            except RuntimeError:
                pass
        self._flight.end(bool(done), ROUTE, source)
        return bool(done)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return int(self._work._source_rank())

    _source_rank = source_rank

    def abort(self) -> None:
        self._work.abort()

    def get_future(self) -> Any:
        return self._work.get_future()
