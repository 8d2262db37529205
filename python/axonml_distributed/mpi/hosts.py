"""The MPI backend over several hosts: our shared memory inside each host, MPI between them.

Hosts are found honestly: MPI_Comm_split_type(COMM_TYPE_SHARED) says which ranks MPI believes share a
node, and `hosts.layout.find_hosts` (identity and a /dev/shm proof, exchanged as fixed-size bytes by
MPI_Allgather of uint8) which ones really do; ranks share a host when both agree, so a job that turned
MPI's shared memory off (MPIR_CVAR_NOLOCAL) stays flat.

`MpiHostsProcessGroup` is the group of every rank when the job spans hosts with the same number (more
than one) of ranks on each. It is an `MpiProcessGroup` on the job's communicator, every method MPI's,
but for `all_reduce` (and `all_reduce_tensor`) of at least `flat_below` bytes of a float32/float64 or
integer buffer with SUM, AVERAGE (prescale/postscale factors too), MIN, MAX or PRODUCT: those run
`hosts.two_level.TwoLevelAllReduce`, reduce-scatter inside the host through the host's shared-memory
world, then each shard across hosts with the same local rank of every other host over an MPI
communicator of those ranks (one per local rank index, so every host's ranks all drive traffic), then
all-gather inside the host.

- Bitwise identical results on every rank: between hosts a shard is reduced by MPI_Reduce_scatter and
  copied back by MPI_Allgather, so each element is reduced on one rank and every member receives its
  bytes. MPI_Allreduce promises no such thing (the standard only advises that every rank get the same
  result; an implementation may reduce in a different order on different ranks).
- Mismatches across hosts are caught before any buffer changes: a two-level call first takes part in
  the group's signature check over every rank (the same check, and the same MPI call, a flat call
  makes), and the path is chosen only from what that check agreed (dtype, count, op), so every rank
  takes the same one (rank 0's `flat_below` and pipeline segment are broadcast at start-up).
- Failures: a failure inside a two-level call (a peer of the host that died, a wait past the timeout)
  aborts the MPI job, as every failure the MPI group cannot undo does (MPI cannot cancel the collective
  the other hosts wait in); `python -m mpi4py` turns an exception on any rank into MPI_Abort.
- The host's shared-memory world meets through a TCP store local rank 0 hosts on 127.0.0.1 (a free port
  and a random job secret it broadcasts to the host's ranks over MPI); its segment is unlinked once
  every rank attached it, so none is left behind however the job ends.
- A two-level call runs to completion when called, with `async_op` too (its handle is complete); it first
  completes the group's pending operations, so work on the group still completes in issue order. Its
  pipeline segments overlap only as far as MPI progresses a started reduce-scatter while the host works
  (without an asynchronous progress thread, MPICH moves it only inside MPI calls).
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed import settings
from axonml_distributed._core import (
    DTYPE_CODES,
    KIND_CODES,
    OP_CODES,
    Backend,
    ProcessGroup,
    ReduceOp,
    ShmBackend,
)
from axonml_distributed._types import Buf, OpArg
from axonml_distributed.exceptions import DistributedError
from axonml_distributed.hosts.layout import ITEM_BYTES, HostLayout, find_hosts
from axonml_distributed.hosts.two_level import (
    DEFAULT_FLAT_BELOW,
    DEFAULT_SEGMENT_BYTES,
    TwoLevelAllReduce,
    split,
)
from axonml_distributed.mpi.args import checkable, finish_result, prescale
from axonml_distributed.mpi.check import check_signatures, signature
from axonml_distributed.mpi.group import MpiProcessGroup
from axonml_distributed.mpi.queue import MpiWork, abort_job, complete_or_abort
from axonml_distributed.tensors import like, numpy_view

INTEGERS = [(kind, bits) for kind in ("int", "uint") for bits in (8, 16, 32, 64)]
# The dtypes that go through both levels: MPI reduces them as they are (float16 and bfloat16 would widen
# to float32 on one level and not the other), and MIN/MAX/PRODUCT are elementwise (not on complex).
TWO_LEVEL_DTYPES = frozenset(
    DTYPE_CODES[f"{kind}{bits}"] for kind, bits in [("float", 32), ("float", 64)] + INTEGERS
)
# The core's op code -> the op of both levels (AVERAGE: SUM, then one division of the reduced shard).
LEVEL_OPS = {
    OP_CODES[name]: getattr(ReduceOp, "SUM" if name == "AVERAGE" else name)
    for name in ("SUM", "AVERAGE", "MIN", "MAX", "PRODUCT")
}
ALL_REDUCE_CODE = KIND_CODES["all_reduce"]


def find_layout(comm: MPI.Intracomm, timeout: float) -> HostLayout:
    """The job's hosts (collective over `comm`, whose ranks are the job's): ranks share a host when MPI
    puts them on one shared-memory node and `find_hosts` proves they share memory."""
    me, size = comm.Get_rank(), comm.Get_size()
    group = list(range(size))

    def all_gather(item: bytes) -> list[bytes]:
        every = np.empty((size, ITEM_BYTES), np.uint8)
        request = comm.Iallgather([np.frombuffer(item, np.uint8), MPI.UINT8_T], [every, MPI.UINT8_T])
        complete_or_abort(comm, request, timeout, "init_mpi_process_group (finding hosts)", group)
        return [row.tobytes() for row in every]

    # MPI_Comm_split_type has no non-blocking form; every rank has just joined the job's communicator.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = min(node.Get_group().Translate_ranks(list(range(node.Get_size())), comm.Get_group()))
    finally:
        node.Free()
    nodes = [int.from_bytes(b, "little") for b in all_gather(leader.to_bytes(ITEM_BYTES, "little"))]
    proven = find_hosts(me, size, all_gather)
    hosts: list[tuple[int, ...]] = []
    for ranks in proven.hosts:
        for node_leader in sorted({nodes[r] for r in ranks}):
            hosts.append(tuple(r for r in ranks if nodes[r] == node_leader))
    return HostLayout(tuple(sorted(hosts, key=min)), me)


def two_level(layout: HostLayout) -> bool:
    """Whether the two-level all_reduce applies: several hosts, as many ranks on each, more than one."""
    return len(layout.hosts) > 1 and layout.uniform and len(layout.local_ranks) > 1


def join_host(local: MpiProcessGroup, layout: HostLayout, timeout: float) -> Backend:
    """This host's shared-memory world (collective over `local`, the host's ranks): local rank 0 hosts
    the rendezvous store on a free port of 127.0.0.1 and tells the others the port and a job secret."""
    offer = np.zeros(2 + 32, np.uint8)
    if layout.local_rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        offer[:2] = np.frombuffer(port.to_bytes(2, "little"), np.uint8)
        offer[2:] = np.frombuffer(secrets.token_bytes(32), np.uint8)
    local.broadcast(offer, layout.local_ranks[0])
    return ShmBackend.connect(
        layout.local_rank,
        len(layout.local_ranks),
        "127.0.0.1",
        int.from_bytes(offer[:2].tobytes(), "little"),
        timeout=timeout,
        arena_bytes=settings.shm_arena_bytes(),
        secret=offer[2:].tobytes(),
    )


class MpiHostsProcessGroup(MpiProcessGroup):
    """The group of every rank of a job over several hosts (see the module docs); `layout`: its hosts."""

    def __init__(
        self,
        comm: MPI.Intracomm,
        ranks: list[int],
        rank: int,
        timeout: float,
        check: bool,
        layout: HostLayout,
    ) -> None:
        super().__init__(comm, ranks, rank, timeout, check)
        self._layout = layout
        self._local = ProcessGroup(
            join_host(self.new_group(layout.local_ranks), layout, timeout), None, timeout
        )
        # Without the signature check: the group's check over every rank agreed on each call first, and
        # every rank splits alike, so the calls between hosts match (the check would double their
        # latency).
        self._cross = self._subgroup(sorted(layout.peers()), timeout, False)
        below, segment = settings.hosts_flat_below(), settings.hosts_segment_bytes()
        tuning = np.array(
            [DEFAULT_FLAT_BELOW if below is None else below, segment or DEFAULT_SEGMENT_BYTES], np.int64
        )
        self.broadcast(tuning, 0)  # rank 0's: every rank must choose paths and segments alike
        self._flat_below = int(tuning[0])
        self._two_level = TwoLevelAllReduce(self._local, int(tuning[1]))

    def __repr__(self) -> str:
        return f"MpiHostsProcessGroup(rank={self.rank()}, hosts={list(map(list, self._layout.hosts))})"

    def hosts(self) -> list[list[int]]:
        """The job's hosts: each one's global ranks, ascending; hosts in the order of their lowest rank."""
        return [list(ranks) for ranks in self._layout.hosts]

    def all_reduce(
        self,
        buf: Buf,
        op: OpArg = None,
        *,
        out: Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> MpiWork | None:
        arr = numpy_view(buf)
        call = None if out is not None else self._over_hosts(arr, op, prescale_factor, postscale_factor)
        if call is None:
            return super().all_reduce(
                buf,
                op,
                out=out,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                async_op=async_op,
            )
        self._reduce_over_hosts(arr, *call, prescale_factor, postscale_factor)
        return self._completed(None) if async_op else None

    def all_reduce_tensor(
        self,
        t: Buf,
        op: OpArg = None,
        *,
        out: Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> Any:
        pre, post = prescale_factor, postscale_factor
        arr = numpy_view(t)
        if out is not None or self._over_hosts(arr, op, pre, post) is None:
            return super().all_reduce_tensor(
                t, op, out=out, prescale_factor=pre, postscale_factor=post, async_op=async_op
            )
        new = np.array(arr, order="C")
        self.all_reduce(new, op, prescale_factor=pre, postscale_factor=post)
        result = like(t)(new)
        return self._completed(result) if async_op else result

    def _completed(self, result: Any) -> MpiWork:
        """The handle of a two-level call made with async_op: complete (see the module docs)."""
        work = MpiWork(
            self._member_queue("all_reduce"), MPI.REQUEST_NULL, None, None, result, 0, lambda: "", None
        )
        work.done = True
        return work

    def _over_hosts(self, arr: Any, op: OpArg, pre: float, post: float) -> tuple[int, int, int] | None:
        """(dtype code, count, op code) of a valid all_reduce that takes the two levels, else None. Decided
        from what the signature check compares, so ranks whose calls agree decide alike; a rank that
        decides otherwise fails that check with them (its flat call makes the same check)."""
        if not isinstance(arr, np.ndarray):
            return None
        try:
            code, count, _, op_code, _ = self._calls.all_reduce(
                checkable(arr), op, prescale_factor=pre, postscale_factor=post
            )
        except (TypeError, ValueError):
            return None  # the flat call reports it, after taking part in the check
        if code not in TWO_LEVEL_DTYPES or op_code not in LEVEL_OPS or arr.nbytes < self._flat_below:
            return None
        return code, count, op_code

    def _reduce_over_hosts(
        self, arr: np.ndarray, code: int, count: int, op_code: int, pre: float, post: float
    ) -> None:
        queue = self._member_queue("all_reduce")
        with queue.lock:
            queue.seq += 1
            # Recorded as this group's call, ended with no route: its levels are recorded, each with its
            # route, as the host's calls and the cross group's.
            flight = queue.flight.collective(
                "all_reduce", queue.seq, code, count, op=op_code, prescale=pre, postscale=post
            )
            try:
                if self._check:
                    mine = signature(1, ALL_REDUCE_CODE, code, count, -1, op_code, pre, post)
                    check_signatures(queue, mine, queue.seq, self._ranks, self._describe_current_all_reduce)
                queue.drain()
            except BaseException:
                flight.end(False)
                raise
        flight.started()
        try:
            self._two_levels(arr, op_code, pre, post)
        except BaseException:
            flight.end(False)
            raise
        flight.end(True)

    def _two_levels(self, arr: np.ndarray, op_code: int, pre: float, post: float) -> None:
        """The two levels of `_reduce_over_hosts`, once every member came."""
        # MPI takes buffers not aligned for their dtype, the shared-memory world does not: reduce an
        # aligned copy of those. (The core accepts only contiguous ones.)
        direct = arr.flags.aligned and arr.flags.c_contiguous
        flat = arr.reshape(-1) if direct else np.array(arr, order="C").reshape(-1)
        if pre != 1.0:
            prescale(flat, flat, pre)
        average = self.size() if op_code == OP_CODES["AVERAGE"] else 0
        finish = None if not average and post == 1.0 else _finisher(average, post)
        level_op = LEVEL_OPS[op_code]
        cross = self._cross

        def cross_shard(shard: np.ndarray) -> _CrossShard:
            return _CrossShard(cross, shard, level_op)

        try:
            self._two_level(flat, level_op, cross_shard, finish)
        except DistributedError as e:
            raise abort_job(MPI.COMM_WORLD, e) from e
        if not direct:
            np.copyto(arr, flat.reshape(arr.shape))


class _CrossShard:
    """One shard's all-reduce between hosts: MPI_Reduce_scatter, started here, then MPI_Allgather in
    `wait`, so each element is reduced on one rank and every member gets the same bytes."""

    def __init__(self, cross: MpiProcessGroup, shard: np.ndarray, op: ReduceOp) -> None:
        self._cross, self._shard = cross, shard
        self._counts = split(len(shard), cross.size())
        self._piece = np.empty(self._counts[cross.group_rank(cross.rank())], shard.dtype)
        self._started = cross.reduce_scatter_v(shard, self._piece, self._counts, op, async_op=True)

    def wait(self) -> None:
        assert self._started is not None
        self._started.wait()
        self._cross.all_gather_v(self._piece, self._shard, self._counts)


def _finisher(average: int, post: float) -> Callable[[np.ndarray], object]:
    """AVERAGE's division and the postscale factor on a reduced shard, as the flat call does them."""
    return lambda shard: finish_result(shard, average, post)
