"""The "axonml" backend over several hosts: our shared memory inside each host, torch's gloo between them.

`HostsProcessGroup` is the group of a job (or subgroup) whose ranks sit on more than one host. Its
`allreduce` of a dense tensor of at least `flat_below` bytes is two-level (`hosts.two_level`): reduce-
scatter in the host through the host's shared-memory world, all-reduce of each shard with the same local
rank of every other host through a gloo group of those ranks (one per local rank index, so every link is
busy), all-gather in the host. Every other collective, point to point, and the small all_reduces go to
one gloo group over all the group's ranks, as they would under gloo, with gloo's semantics. The groups
are made from the Store torch hands the backend, under keys of their own.

Mismatches: every collective (not point to point) first all-gathers a small signature over that flat
group (which call, dtype, the element counts that must agree, root, op: `hosts_signature`), so ranks on
different hosts whose calls differ all raise CollectiveMismatchError before any buffer changes (gloo
itself would move mismatched bytes, fail on one side, or wait for the timeout). It costs one small gloo
call per collective (two for all_to_all_single, whose split sizes pair up across ranks). A strided
tensor given to all_to_all_single on any rank is refused the same way, on every rank, with one host's
ValueError("Tensors must be contiguous...").

Two-level calls run in program order on one thread of the group (a blocking call waits for it), so the
host's group and the gloo groups each see their calls in the same order on every rank; a torch DDP bucket
(an asynchronous all_reduce) overlaps with the rest of the backward pass. A failure in either level
aborts the host's world, so its other ranks stop at once, and raises our PeerFailureError or
CollectiveTimeoutError (gloo's error chained) naming the ranks involved by their global ranks and the
ranks of the other hosts. gloo reports a dead peer as a closed socket, naming no rank, so a rank whose
process ends on an exception (Ctrl-C too) notes it in the Store (`FailureNote`) and the others' errors
quote it and name its rank; a process that ends without a word (SIGKILL, a host gone) is named by its
address, which the error names as that host's ranks (every rank lists its host's addresses at init:
`exchange_addresses`). Failures of forwarded calls after the signature are gloo's own RuntimeErrors.
A subgroup whose ranks share one host is a native group of that host's world (`local_group`), its
errors in the job's ranks too (`hosts.host_group`; `HostSubgroup` for the errors torch's group makes
itself). `stats()` counts the calls gloo carries.
"""

# mypy: disable-error-code="override"

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed import settings
from axonml_distributed._core import Backend, ProcessGroup, ReduceOp, ThreadBackend
from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    PeerFailureError,
)
from axonml_distributed.hosts.addresses import AddressBook, local_addresses
from axonml_distributed.hosts.host_group import HostGroup
from axonml_distributed.hosts.layout import ITEM_BYTES, AllGather, HostLayout
from axonml_distributed.hosts.two_level import DEFAULT_FLAT_BELOW, DEFAULT_SEGMENT_BYTES, TwoLevelAllReduce
from axonml_distributed.torch.gloo_calls import GlooCalls
from axonml_distributed.torch.group import AxonmlProcessGroup, OrderedProcessGroup
from axonml_distributed.torch.hosts_signature import Signature, all_reduce_row, forwarded, tensors_in
from axonml_distributed.torch.named import NamedGroup
from axonml_distributed.torch.rank_order import RankOrder
from axonml_distributed.torch.rendezvous import join_world
from axonml_distributed.torch.work import Completer, Work

# Ops both levels carry (AVG as SUM and one division, PREMUL_SUM as a scaling and SUM); gloo has no
# AVG or PREMUL_SUM of its own, so a flat call does the same around gloo's SUM.
_TWO_LEVEL = {
    dist.ReduceOp.SUM: (ReduceOp.SUM, dist.ReduceOp.SUM),
    dist.ReduceOp.AVG: (ReduceOp.SUM, dist.ReduceOp.SUM),
    dist.ReduceOp.PREMUL_SUM: (ReduceOp.SUM, dist.ReduceOp.SUM),
    dist.ReduceOp.PRODUCT: (ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT),
    dist.ReduceOp.MIN: (ReduceOp.MIN, dist.ReduceOp.MIN),
    dist.ReduceOp.MAX: (ReduceOp.MAX, dist.ReduceOp.MAX),
}
_CORE_ERRORS = (CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError)
# torch's ProcessGroup methods a Python group overrides, and gloo's method that does the same.
_FORWARDED = {
    "broadcast": "broadcast",
    "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "all_gather_single",
    "_allgather_base": "_allgather_base",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "all_gather_single_coalesced": "all_gather_single_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_single",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_single_coalesced",
    "reduce": "reduce",
    "gather": "gather",
    "gather_single": "gather_single",
    "gather_into_tensor": "gather_into_tensor",
    "scatter": "scatter",
    "barrier": "barrier",
    "alltoall": "alltoall",
    "alltoall_base": "alltoall_base",
    "all_to_all_single": "all_to_all_single",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
    "monitored_barrier": "monitored_barrier",
}
# Point to point pairs two ranks, not the group; monitored_barrier reports the ranks that never came.
_UNSIGNED = {"send", "recv", "recv_anysource", "monitored_barrier"}


def init_prefix(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> str:
    """A key prefix of this init's own (collective: every rank of the job calls it once per init). A job
    may destroy its group and init again over the same store, and torchrun's rounds share one store,
    whose keys stay: read again, an earlier init's proofs and gloo addresses would be stale. Rank 0
    numbers the inits; every other rank asks it for this one's number under a fresh token of its own.
    (A count of every rank's calls would let a rank that never reached an earlier init, or reached it
    alone, or a round of another size, shift the next init's ranks onto different numbers.)"""
    if rank == 0:
        number = store.add("axonml/inits", 1)
        _hand_out(store, number, size, timeout)
        return f"axonml/init/{number}/"
    token = secrets.token_hex(16)
    store.set(f"axonml/init/ask/{rank}", token)
    store.wait([f"axonml/init/answer/{token}"], timeout)
    number = int(store.get(f"axonml/init/answer/{token}"))
    store.add(f"axonml/init/{number}/took", 1)
    return f"axonml/init/{number}/"


def _hand_out(store: dist.Store, number: int, size: int, timeout: datetime.timedelta) -> None:
    """Rank 0: answer every other rank's token with init `number` until all took it. A token read may be
    an earlier init's (its rank not here yet): answered too, for nobody, and read again until it is
    this init's."""
    asks = [f"axonml/init/ask/{r}" for r in range(1, size)]
    store.wait(asks, timeout)
    answered: set[bytes] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while store.add(f"axonml/init/{number}/took", 0) < size - 1:
        for token in set(store.multi_get(asks)) - answered:
            store.set(f"axonml/init/answer/{token.decode()}", str(number))
            answered.add(token)
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank 0: init_process_group timed out after {timeout.total_seconds()}s: not every rank "
                "of the job called it",
                rank=0,
                call="init_process_group",
                waited=timeout.total_seconds(),
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def store_all_gather(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> AllGather:
    """`find_hosts`'s exchange over torch's Store: each round under keys of its own."""
    rounds = iter(range(1 << 30))

    def gather(item: bytes) -> list[bytes]:
        assert len(item) == ITEM_BYTES
        prefix = f"axonml/hosts/{next(rounds)}/"
        store.set(f"{prefix}{rank}", item.hex())
        keys = [f"{prefix}{r}" for r in range(size)]
        store.wait(keys, timeout)
        return [bytes.fromhex(store.get(k).decode()) for k in keys]

    return gather


def exchange_addresses(
    store: dist.Store, layout: HostLayout, size: int, timeout: datetime.timedelta
) -> AddressBook:
    """Every rank's host addresses, through torch's Store (collective: every rank of the job calls it
    once per init, `store` under the init's prefix), read now: when a host dies, the store may go
    with it."""
    store.set(f"axonml/addresses/{layout.rank}", ",".join(local_addresses()))
    keys = [f"axonml/addresses/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return AddressBook(layout, [v.decode().split(",") if v else [] for v in store.multi_get(keys)])


def gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def join_host(store: dist.Store, layout: HostLayout, timeout: datetime.timedelta) -> Backend:
    """This host's shared-memory world (a world of its own for a rank alone on its host)."""
    if len(layout.local_ranks) == 1:
        return ThreadBackend.single(timeout.total_seconds())
    host = dist.PrefixStore(f"axonml/host/{layout.local_ranks[0]}/", store)
    return join_world(host, layout.local_rank, len(layout.local_ranks), timeout)


def local_group(
    host_world: Backend, world: HostLayout, group: HostLayout, timeout: datetime.timedelta
) -> ProcessGroup | HostGroup:
    """The group's ranks on this host as a group of the host's world (whose ranks are local indices),
    its errors in the job's ranks when the job spans several hosts (a `HostGroup`)."""
    host = world.local_ranks
    if host_world.world_size() == len(group.local_ranks):
        native = ProcessGroup(host_world, None, timeout)
    elif len(group.local_ranks) == 1:  # a world of its own, whose rank 0 is this rank
        native, host = ProcessGroup(ThreadBackend.single(timeout.total_seconds())), group.local_ranks
    else:
        native = ProcessGroup(host_world, [host.index(r) for r in group.local_ranks], timeout)
    return native if len(world.hosts) == 1 else HostGroup(native, host)


class HostSubgroup(AxonmlProcessGroup):
    """torch's group of ranks on one host of a job over several (its native group a `HostGroup`): the
    errors it makes itself from its native group's ranks (a zero-timeout `monitored_barrier`'s, which
    never reaches the native group) name the job's ranks too, as the native group's own errors do."""

    _native: HostGroup

    def _timed_out_at_once(self) -> CollectiveTimeoutError:
        e = self._native.in_job_ranks(super()._timed_out_at_once())
        assert isinstance(e, CollectiveTimeoutError)  # in_job_ranks keeps the type
        return e


class OrderedHostSubgroup(HostSubgroup, OrderedProcessGroup):
    """A `HostSubgroup` whose members torch orders otherwise than the core (`OrderedProcessGroup`)."""


def host_subgroup(native: HostGroup, rank: int, size: int, order: RankOrder | None) -> AxonmlProcessGroup:
    """torch's group over `native`, a group of ranks on one host of a job over several."""
    if order is None:
        return HostSubgroup(native, rank, size)
    return OrderedHostSubgroup(native, rank, size, order)


class HostsProcessGroup(NamedGroup):
    """torch's ProcessGroup over several hosts (see the module docs). `ranks`: the group's global
    ranks; `layout`: them sorted into hosts, as this rank sees them."""

    def __init__(
        self,
        store: dist.Store,
        layout: HostLayout,
        ranks: list[int],
        host_world: Backend,
        world: HostLayout,
        timeout: datetime.timedelta,
        note: FailureNote,
        book: AddressBook,
    ) -> None:
        rank, size = ranks.index(layout.rank), len(ranks)
        self._note, self._book = note, book
        super().__init__(rank, ranks)
        self._layout = layout
        self._flat = gloo(store, "axonml/flat/", rank, size, timeout)
        # Rank 0's cut and segment for every member: ranks that chose different paths (or shards) would
        # meet in different engines and wait for the timeout.
        below, segment = settings.hosts_flat_below(), settings.hosts_segment_bytes()
        if rank == 0:
            mine = [DEFAULT_FLAT_BELOW if below is None else below, segment or DEFAULT_SEGMENT_BYTES]
            store.set("axonml/tuning", ",".join(map(str, mine)))
        self._flat_below, segment = (int(v) for v in store.get("axonml/tuning").decode().split(","))
        self._two_level: TwoLevelAllReduce | None = None
        self._cross: Any = None
        if layout.uniform and len(layout.local_ranks) > 1:
            local = local_group(host_world, world, layout, timeout)
            self._cross = gloo(
                store, f"axonml/cross/{layout.local_rank}/", layout.host, len(layout.hosts), timeout
            )
            self._cross_ranks = layout.peers()
            self._two_level = TwoLevelAllReduce(local, segment)
            self._local = local
        world_size = sum(len(host) for host in world.hosts)
        cross_ranks = layout.peers() if self._cross is not None else None
        self._gloo_calls = GlooCalls(layout.rank, world_size, ranks, cross_ranks)
        self._lane = _Lane()
        self._timeout = timeout
        _LIVE.add(self)
        self._two_level_calls = 0
        self._completer: Completer | None = None
        self._lock = threading.Lock()

    def _get_sequence_number_for_group(self) -> int:
        return self._flat._get_sequence_number_for_group() + self._two_level_calls

    def stats(self) -> dict[str, dict[str, Any]]:
        """Totals per kind of this rank's calls on the group that gloo carries, as the native groups'
        ``stats()`` (calls, failed, bytes, wait_s, move_s, routes; route "gloo"): every call forwarded
        to gloo and each small all_reduce, one call each; a two-level all_reduce counts as its shards'
        all-reduces between hosts (its part inside the host is in the host's world)."""
        return self._gloo_calls.stats()

    def shutdown(self, wait: float | None = None) -> None:
        """torch's `destroy_process_group` (and the interpreter's exit, for a group never destroyed):
        end the group's lane and let go of its gloo groups while the interpreter is whole. A gloo group
        left to the interpreter's teardown may still hold a finished call's tensors on one of its
        threads, whose release then takes the GIL of an interpreter going away, and the process aborts
        ("terminate called without an active exception"). Let go of here, torch destroys it with the
        GIL released, joining its threads. Calls after this raise.

        It waits for the group's two-level calls still queued, `wait` seconds at most (the group's
        timeout by default); one still running then (stuck on a vanished host) keeps the gloo groups."""
        if isinstance(self._flat, _ShutDown):
            return
        if not self._lane.close(self._timeout.total_seconds() if wait is None else wait):
            return
        self._two_level = None
        self._flat = self._cross = _ShutDown(repr(self))

    def __repr__(self) -> str:
        return f"HostsProcessGroup(rank={self.rank()}, hosts={list(map(list, self._layout.hosts))})"

    # -- all_reduce -----------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.AllreduceOptions()
        op = opts.reduceOp
        kind = op.op if hasattr(op, "op") else op
        # Started here, on the calling thread, so it takes its place among the flat group's calls in
        # program order; nothing touches a buffer before it is checked.
        signature = Signature(all_reduce_row(kind, tensors), self._flat, self.size())
        if (
            self._two_level is None
            or any(t.dtype in _NOT_GLOO for t in tensors)
            or kind not in _TWO_LEVEL
            or any(t.is_sparse or not t.is_contiguous() for t in tensors)
            or sum(t.nbytes for t in tensors) < self._flat_below
        ):
            self._check(signature, "all_reduce")
            _refuse_not_gloo(tensors, "all_reduce")
            self._lane.drain()
            return self._flat_allreduce(tensors, opts, kind)
        local_op, cross_op = _TWO_LEVEL[kind]
        factor = float(op.factor) if kind == dist.ReduceOp.PREMUL_SUM else None
        post = _divide_by(self.size()) if kind == dist.ReduceOp.AVG else None
        self._two_level_calls += 1
        started = self._lane.submit(self._run_two_level, signature, tensors, local_op, cross_op, factor, post)
        work = Work([_Done(started)], tensors, None, self._get_completer)
        if getattr(opts, "asyncOp", True) is False:
            work.wait()
            return None
        return work

    allreduce_coalesced = allreduce

    def _flat_allreduce(self, tensors: list[torch.Tensor], opts: Any, kind: Any) -> Any:
        """One gloo call over every rank; AVG and PREMUL_SUM around gloo's SUM."""
        numel = sum(t.numel() for t in tensors)
        flight = self._gloo_calls.collective("all_reduce", tensors, numel, op=opts.reduceOp)
        if kind not in (dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
            return self._gloo_calls.run(flight, lambda: self._flat.allreduce(tensors, opts))
        if kind == dist.ReduceOp.PREMUL_SUM:
            for t in tensors:
                t.mul_(float(opts.reduceOp.factor))
        summed = dist.AllreduceOptions()
        summed.reduceOp = dist.ReduceOp.SUM
        summed.timeout = opts.timeout
        work = self._gloo_calls.run(flight, lambda: self._flat.allreduce(tensors, summed))
        if kind != dist.ReduceOp.AVG:
            return work
        work.wait()
        for t in tensors:
            t.div_(self.size())
        return Work.done(tensors, None, self._get_completer)

    def _run_two_level(
        self,
        signature: Signature,
        tensors: list[torch.Tensor],
        local_op: ReduceOp,
        cross_op: Any,
        factor: float | None,
        post: Callable[[torch.Tensor], object] | None,
    ) -> None:
        assert self._two_level is not None
        self._check(signature, "all_reduce")
        opts = dist.AllreduceOptions()
        opts.reduceOp = cross_op

        def cross(shard: torch.Tensor) -> Any:
            flight = self._gloo_calls.cross_shard(shard, cross_op)
            return self._gloo_calls.run(flight, lambda: self._cross.allreduce([shard], opts))

        for t in tensors:
            flat = t.view(-1)
            if factor is not None:
                flat.mul_(factor)
            try:
                self._two_level(flat, local_op, cross, post)
            except Exception as e:
                peers = [r for r in self._cross_ranks if r != self._layout.rank]
                raise self._failed(e, peers, "this rank's peers on the other hosts") from e

    def _check(self, signature: Signature, call: str) -> None:
        """Every rank of the group made the same call, or this raises before any buffer changes."""
        try:
            signature.check(self._ranks)
        except (CollectiveMismatchError, ValueError):
            raise  # every rank saw the same signatures and raises alike: nothing to abort
        except Exception as e:
            # Any rank of the group may be the one gone: gloo names a socket, not a rank.
            others = [r for r in self._ranks if r != self._layout.rank]
            raise self._failed(e, others, "the group", call) from e

    def _failed(self, e: Exception, peers: list[int], who: str, call: str = "all_reduce") -> DistributedError:
        """A call failed: stop this host's ranks at once (two-level groups) and say which ranks failed,
        by their global ranks (the host's level says them so already: `HostGroup`). A failure of the
        engine (gloo) names `peers`, the ranks it was exchanging with, `who` saying what they are. Both
        name instead the ranks noted as the job's first failure (a closed socket may be a rank that
        failed after them, on any host), else, where gloo's error (or a host peer's abort quoting one)
        names another host's address, that host's ranks, noted then for the ranks that learn of it later
        (from a host peer of this one that left). Both say which ranks the other hosts hold (a host peer
        that never came may be waiting on them) and quote the job's first failure where one was noted."""
        me = self._layout.rank
        if self._two_level is not None:  # the host's ranks first: reading the note may take a moment
            self._local.backend().abort(f"rank {me}: {call} failed: {e}")
        hosts = [list(ranks) for ranks in self._layout.hosts if me not in ranks]
        noted = self._note.read()
        context = f"the other hosts hold ranks {hosts}"
        if noted is not None:
            context += f"; the job's first failure: {noted[1]}"
        text = str(e)
        culprits = [r for r in noted[0] if r in self._ranks and r != me] if noted is not None else []
        addresses, at = self._book.named_in(text, me)
        named = [r for r in at if r in self._ranks]
        if culprits:
            named, who = culprits, "noted as the job's first failure"
        elif named:
            where = ", ".join(addresses)
            who = f"the ranks of the host at {where}, whose connection failed"
            self._note.write(
                named, f"ranks {named} (the host at {where}) left without a word, as rank {me} saw"
            )
        if isinstance(e, DistributedError):  # only the two levels' own calls raise ours (`in_job_ranks`)
            kind = type(e) if type(e) in _CORE_ERRORS else PeerFailureError
            began = f"the failure began with rank(s) {named} ({who}); " if named else ""
            return kind(
                f"rank {me}: {call} failed inside this host ({began}{context}): {e}",
                rank=me,
                ranks=named or list(e.ranks),
                call=call,
                group=self._ranks,
            )
        kind = CollectiveTimeoutError if "timed out" in text.lower() else PeerFailureError
        return kind(
            f"rank {me}: {call} across hosts failed with rank(s) {named or peers} ({who}; {context}): {text}",
            rank=me,
            ranks=named or peers,
            call=call,
            group=self._ranks,
        )

    def _get_completer(self) -> Completer:
        with self._lock:
            if self._completer is None:
                self._completer = Completer()
            return self._completer


def _forward(theirs: str) -> Callable[..., Any]:
    # torch calls some by keyword (`group.barrier(opts=opts)`).
    def method(self: HostsProcessGroup, *args: Any, **kwargs: Any) -> Any:
        given = [*args, *kwargs.values()]
        row = None
        if theirs not in _UNSIGNED:
            row, splits = forwarded(theirs, given, self.size(), self.rank())
            self._check(Signature(row, self._flat, self.size(), splits), theirs)
        _refuse_not_gloo(tensors_in(given), theirs)
        # gloo runs a group's calls in order: so do we, after the two-level all_reduces before it.
        self._lane.drain()
        flight = self._gloo_calls.forwarded(theirs, given, tensors_in(given), row)
        return self._gloo_calls.run(flight, lambda: getattr(self._flat, theirs)(*args, **kwargs))

    method.__name__ = theirs
    return method


# Methods of the class (torch's C++ finds overrides on the type, not on the instance).
for _ours, _theirs in _FORWARDED.items():
    setattr(HostsProcessGroup, _ours, _forward(_theirs))


class FailureNote:
    """The job's first failure, noted in torch's Store (the default group's): ranks on other hosts learn
    of a failure from their engine (gloo) as a closed socket or a timeout, which names no rank; they read
    the note to name it. Store calls are bounded (`NOTE_SECONDS`): across a cut link they would hang."""

    KEY = "axonml/hosts/first-failure"

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def write(self, ranks: list[int], text: str) -> None:
        """Keeps the first note written (`ranks`: the global ranks that failed): a later failure is
        usually a consequence of it."""
        _bounded(lambda: self._store.compare_set(self.KEY, "", f"{','.join(map(str, ranks))} {text}"))

    def read(self) -> tuple[list[int], str] | None:
        """The ranks that failed first and what was said of them, if noted."""

        def get() -> tuple[list[int], str] | None:
            if not self._store.check([self.KEY]):
                return None
            ranks, text = self._store.get(self.KEY).decode().split(" ", 1)
            return [int(r) for r in ranks.split(",")], text

        return _bounded(get)


# How long a failing rank waits on the Store for a note, at most.
NOTE_SECONDS = 2.0


def _bounded(call: Callable[[], Any]) -> Any:
    """`call()` on a daemon thread, waited for `NOTE_SECONDS` at most (None then, or if it raised)."""
    result: list[Any] = [None]

    def run() -> None:
        try:
            result[0] = call()
        except Exception:  # noqa: BLE001 (a note is best effort: the failure it explains is raised anyway)
            pass

    thread = threading.Thread(target=run, daemon=True, name="axonml-hosts-note")
    thread.start()
    thread.join(NOTE_SECONDS)
    return result[0]


class HostRank:
    """This host's world as the excepthook sees it (`install_excepthook`): under this process's global
    rank, so the abort it sends names the rank that failed as every host knows it; the abort also
    leaves the job's failure note for the ranks of other hosts."""

    def __init__(self, world: Backend, rank: int, note: FailureNote) -> None:
        self._world, self._rank, self._note = world, rank, note

    def rank(self) -> int:
        return self._rank

    def backend(self) -> HostRank:
        return self

    def abort(self, reason: str) -> None:
        # The note first: the host peers this abort ends close their sockets, and ranks of other hosts
        # that see those first must find this rank named.
        self._note.write([self._rank], reason)
        self._world.abort(reason)


class _Lane:
    """Runs a group's two-level calls in program order on one daemon thread (a thread pool's would be
    joined at exit: a call still waiting on a vanished host would hold the interpreter until its
    timeout)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[None], Callable[[], None]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="axonml-hosts", daemon=True)
        self._thread.start()
        self._last: concurrent.futures.Future[None] | None = None

    def submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put((future, partial(fn, *args)))
        self._last = future
        return future

    def drain(self) -> None:
        """Wait until every call submitted so far has ended (its own Work reports how)."""
        last = self._last
        if last is not None and not last.done():
            concurrent.futures.wait([last])

    def close(self, timeout: float) -> bool:
        """End the thread once the calls submitted so far have run, waiting `timeout` at most (a call
        stuck on a vanished host keeps its thread, a daemon). Whether it ended."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    call()
                except BaseException as e:  # the caller's wait() raises it
                    future.set_exception(e)
                else:
                    future.set_result(None)
            del item, future, call  # an idle thread holds no call's group or tensors


class _ShutDown:
    """Stands for a shut-down group's gloo groups: any use says so."""

    def __init__(self, group: str) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"{self._group} was shut down (destroy_process_group): no call can use it")


EXIT_WAIT_SECONDS = 5.0
# Groups not yet shut down, shut down at exit if the job never destroyed them (see `shutdown`).
_LIVE: weakref.WeakSet[HostsProcessGroup] = weakref.WeakSet()


@atexit.register
def _shut_down_live_groups() -> None:
    # Briefly: a process leaving on an error may have left its lane inside a call to a vanished host.
    for group in list(_LIVE):
        group.shutdown(wait=EXIT_WAIT_SECONDS)


class _Done:
    """A two-level call's handle for `Work`: its future."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


# What gloo cannot carry (torch 2.15: "Invalid scalar type"); the core can, on one host.
_NOT_GLOO = (torch.int16, torch.uint16, torch.uint32, torch.uint64)


def _refuse_not_gloo(tensors: list[torch.Tensor], call: str) -> None:
    """Refuse, alike on every rank (after the signature check agreed on the dtype), a dtype that gloo
    cannot carry between hosts."""
    odd = sorted({str(t.dtype) for t in tensors if t.dtype in _NOT_GLOO})
    if odd:
        raise TypeError(
            f"{call} across hosts: gloo carries no {', '.join(odd)} between hosts (one host takes them); "
            "use int32, int64 or a floating dtype"
        )


def _divide_by(n: int) -> Callable[[torch.Tensor], object]:
    return lambda shard: shard.div_(n)
