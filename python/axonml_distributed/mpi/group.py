"""The MPI process group: the package's ProcessGroup methods, carried by MPI (see the package docstring)."""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from axonml_distributed._core import (
    KIND_CODES,
    FlightCall,
    FlightRecorder,
    ProcessGroup,
    checked_timeout,
    validate_ranks,
)
from axonml_distributed._types import Buf, OpArg
from axonml_distributed.exceptions import CollectiveMismatchError, CollectiveTimeoutError
from axonml_distributed.mpi import plans
from axonml_distributed.mpi.args import (
    CARRIED,
    WIDENED_CODES,
    Op,
    Result,
    carrier,
    checkable,
    finish_result,
    is_int,
    mpi_op,
)
from axonml_distributed.mpi.check import (
    FUSABLE_DTYPES,
    FUSE_SLOTS,
    ONE,
    SignatureCheck,
    check_layouts,
    check_signatures,
    invalid_signature,
    signature,
)
from axonml_distributed.mpi.plans import Call
from axonml_distributed.mpi.queue import (
    MPI_ROUTE,
    MonitorExpired,
    MpiWork,
    OpQueue,
    abort_mpi,
    await_peers,
    missing_peers,
    never_arrived,
    tag_ub,
)
from axonml_distributed.tensors import like, numpy_view

ALL_REDUCE_CODE = KIND_CODES["all_reduce"]


class MpiProcessGroup:
    """A list of global ranks with its own MPI communicator. A non-member of a subgroup holds one without a
    communicator: its accessors work, its operations raise ValueError."""

    def __init__(
        self,
        comm: MPI.Intracomm | None,
        ranks: list[int],
        rank: int,
        timeout: float,
        check: bool,
        world: MpiProcessGroup | None = None,
    ) -> None:
        self._world = self if world is None else world  # the group of every rank, on the job's duplicate
        self._ranks = ranks
        self._index = {r: i for i, r in enumerate(ranks)}
        self._rank = rank
        self._timeout = timeout
        self._check = check
        # The core's checks of this rank's calls: the native groups' own, with their messages. Its methods
        # return the checked (dtype, count, root, op, layout), not a Work: typed Any.
        self._calls: Any = ProcessGroup.call_check(ranks, rank, self.world_size())
        self._queue = None
        if comm is not None:
            if world is None:
                flight = FlightRecorder("mpi", rank, self.world_size(), ranks)
            else:
                flight = world._member_recorder().new_group(ranks)
            self._queue = OpQueue(comm, timeout, SignatureCheck(comm) if check else None, flight)

    def __repr__(self) -> str:
        return f"MpiProcessGroup(rank={self._rank}, ranks={self._ranks})"

    # --- accessors (rank() and world_size() are global, as everywhere in the package) ------------------

    def backend(self) -> MpiProcessGroup:
        return self

    def name(self) -> str:
        return "mpi"

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return MPI.COMM_WORLD.Get_size()

    def size(self) -> int:
        return len(self._ranks)

    def ranks(self) -> list[int]:
        return list(self._ranks)

    def contains(self, rank: int) -> bool:
        return rank in self._index

    def timeout(self) -> float:
        """How long an operation on this group waits, in seconds, before it aborts the job."""
        return self._timeout

    def stats(self) -> dict[str, Any]:
        """Totals per kind of this rank's calls on the group, as the native groups' ``stats()`` (a
        non-member's: none); every completed call's route is "mpi", but a two-level all_reduce across
        hosts (`mpi.hosts`), whose levels are recorded as the host's calls and the cross group's. A call
        counts as waiting for its peers until the signature check saw every member (without the check,
        until it was issued to MPI)."""
        return {} if self._queue is None else self._queue.flight.stats()

    def group_rank(self, global_rank: int) -> int:
        index = self._index.get(global_rank)  # the common case, without a call into the core
        return self._calls.group_rank(global_rank) if index is None else index

    def empty(self, shape: int | Sequence[int], dtype: npt.DTypeLike) -> np.ndarray:
        out = np.empty(shape, dtype)
        if out.dtype not in CARRIED:
            raise TypeError(f"the MPI backend cannot carry {out.dtype} buffers")
        return out

    def new_group(self, ranks: Sequence[int], timeout: float | timedelta | None = None) -> MpiProcessGroup:
        """A group over `ranks` (global ranks of the job, kept sorted like the native groups: chunk i of a
        reduce_scatter goes to the i-th smallest), as the native groups' ``new_group``: called on any
        group, a member or not, it makes the same group. Collective over the members only
        (MPI_Comm_create_group on the job's communicator); a non-member gets a group it can query but
        not use. A member that does not arrive within the group's timeout makes the others abort the job
        naming it. The new group's operations wait `timeout` (seconds or a timedelta, checked as every
        timeout; None: the job's). A bad list of ranks is refused with the native groups' error (the
        core's check)."""
        members = validate_ranks(ranks, self.world_size())
        seconds = self._world._timeout if timeout is None else checked_timeout(timeout)
        return self._subgroup(members, seconds, self._check)

    def _subgroup(self, members: list[int], seconds: float, check: bool) -> MpiProcessGroup:
        """`new_group` of valid sorted `members`, with the signature check on or off."""
        world = self._world
        indices = [world.group_rank(r) for r in members]
        comm = None
        if self._rank in members:
            queue = world._member_queue("new_group")
            peers = {i: r for i, r in zip(indices, members, strict=True) if r != self._rank}
            describe = f"new_group({members}) in MPI group {world._ranks}"
            with queue.lock:
                # MPI_Comm_create_group has no non-blocking form: it is called once every member is
                # known to be there, and then completes at once.
                await_peers(queue.comm, peers, self._timeout, describe, members)
                comm = queue.comm.Create_group(queue.comm.Get_group().Incl(indices))
        return MpiProcessGroup(comm, members, self._rank, seconds, check, world)

    def abort(self, reason: str) -> None:
        """End the whole MPI job: MPI cannot abort only some ranks' pending operations."""
        abort_mpi(MPI.COMM_WORLD, f"axonml_distributed: aborting the MPI job: {reason}")

    # --- collectives -------------------------------------------------------------------------------

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
        buf = numpy_view(buf)
        queue = self._member_queue("all_reduce")
        plain = out is None and prescale_factor == 1.0 and postscale_factor == 1.0
        with queue.lock:
            if not async_op and plain and queue.idle():
                direct = self._direct_all_reduce(buf, op)
                if direct is not None:
                    self._all_reduce_now(queue, buf, *direct)
                    return None
            into = numpy_view(out)

            def plan(comm: MPI.Intracomm) -> Call:
                return plans.all_reduce(self, comm, buf, op, None, into, prescale_factor, postscale_factor)

            return _inplace(self._issue(queue, "all_reduce", plan, async_op))

    def broadcast(self, buf: Buf, src: int | None = None, *, async_op: bool = False) -> MpiWork | None:
        buf = numpy_view(buf)
        return _inplace(
            self._collective("broadcast", lambda comm: plans.broadcast(self, comm, buf, src, None), async_op)
        )

    def all_gather(self, send: Buf, recv: Buf, *, async_op: bool = False) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.all_gather(self, comm, send, recv, None)

        return _inplace(self._collective("all_gather", plan, async_op))

    def reduce_scatter(
        self, send: Buf, recv: Buf, op: OpArg = None, *, async_op: bool = False
    ) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.reduce_scatter(self, comm, send, recv, op, None)

        return _inplace(self._collective("reduce_scatter", plan, async_op))

    def gather(self, send: Buf, recv: Buf | None, dst: int, *, async_op: bool = False) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)
        return _inplace(
            self._collective("gather", lambda comm: plans.gather(self, comm, send, recv, dst), async_op)
        )

    def scatter(self, send: Buf | None, recv: Buf, src: int, *, async_op: bool = False) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)
        return _inplace(
            self._collective("scatter", lambda comm: plans.scatter(self, comm, send, recv, src), async_op)
        )

    def reduce(
        self,
        buf: Buf,
        dst: int,
        op: OpArg = None,
        *,
        out: Buf | None = None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        async_op: bool = False,
    ) -> MpiWork | None:
        buf, into = numpy_view(buf), numpy_view(out)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.reduce(self, comm, buf, dst, op, into, prescale_factor, postscale_factor)

        return _inplace(self._collective("reduce", plan, async_op))

    def barrier(self, *, async_op: bool = False) -> MpiWork | None:
        return _inplace(self._collective("barrier", plans.barrier, async_op))

    def monitored_barrier(
        self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that waits at most `timeout` (seconds or a timedelta; None: the group's timeout),
        as the native groups': it is the group's barrier (it meets a plain `barrier` of another member,
        and, with the signature check on, a member calling anything else makes every member raise
        CollectiveMismatchError), and a member that does not arrive in time is named, with every
        other missing one (whatever `wait_all_ranks`), by the members that did: they raise
        CollectiveTimeoutError to their caller, within twice `timeout`.

        MPI cannot cancel the barrier that the missing ranks would still match, so the group is then
        unusable: its next use, or the end of the interpreter if it is never used again, aborts the
        job (MPI_Abort) saying why. To name the missing, the members that arrived exchange an empty
        message with every other on the reserved tag once the deadline passed, and wait for each other
        for up to `timeout` more."""
        seconds = self._timeout if timeout is None else checked_timeout(timeout)
        queue = self._member_queue("monitored_barrier")
        with queue.lock:
            queue.monitor_deadline = time.monotonic() + seconds
            try:
                self._issue(queue, "barrier", plans.barrier, False)
                return
            except MonitorExpired:
                pass
            finally:
                queue.monitor_deadline = None
            describe = f"monitored_barrier in MPI group {self._ranks}"
            peers = {i: r for i, r in enumerate(self._ranks) if r != self._rank}
            missing = missing_peers(queue.comm, peers, seconds, describe)
            if missing:
                error = never_arrived(describe, seconds, missing, self._ranks)
            else:  # every member came, too late for this one's deadline
                error = CollectiveTimeoutError(
                    f"{describe} did not complete within {seconds:g} s",
                    rank=self._rank,
                    call=describe,
                    group=self._ranks,
                    waited=seconds,
                )
            self._poison(queue, f"{type(error).__name__}: {error}")
        raise error

    def _poison(self, queue: OpQueue, why: str) -> None:
        """Leave the group unusable after an operation left pending (`why`): its next use aborts the job,
        and so does the end of the interpreter."""
        queue.poisoned = why
        atexit.register(
            abort_mpi,
            MPI.COMM_WORLD,
            f"axonml_distributed: exiting with MPI group {self._ranks} unusable ({why}); aborting the MPI "
            "job, as MPI cannot cancel the operation the other ranks may still be waiting in",
        )

    def all_to_all(self, send: Buf, recv: Buf, *, async_op: bool = False) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)
        return _inplace(
            self._collective("all_to_all", lambda comm: plans.all_to_all(self, comm, send, recv), async_op)
        )

    def all_to_all_single(
        self,
        send: Buf,
        recv: Buf,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> MpiWork | None:
        send, recv = numpy_view(send), numpy_view(recv)
        outs = None if output_split_sizes is None else list(output_split_sizes)
        ins = None if input_split_sizes is None else list(input_split_sizes)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.all_to_all_single(self, comm, send, recv, outs, ins)

        return _inplace(self._collective("all_to_all_single", plan, async_op))

    def all_gather_v(
        self, send: Buf, recv: Buf, counts: Sequence[int], *, async_op: bool = False
    ) -> MpiWork | None:
        send, recv, counts = numpy_view(send), numpy_view(recv), list(counts)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.all_gather_v(self, comm, send, recv, counts)

        return _inplace(self._collective("all_gather_v", plan, async_op))

    def gather_v(
        self, send: Buf, recv: Buf | None, counts: Sequence[int], dst: int, *, async_op: bool = False
    ) -> MpiWork | None:
        send, recv, counts = numpy_view(send), numpy_view(recv), list(counts)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.gather_v(self, comm, send, recv, counts, dst)

        return _inplace(self._collective("gather_v", plan, async_op))

    def scatter_v(
        self, send: Buf | None, recv: Buf, counts: Sequence[int], src: int, *, async_op: bool = False
    ) -> MpiWork | None:
        send, recv, counts = numpy_view(send), numpy_view(recv), list(counts)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.scatter_v(self, comm, send, recv, counts, src)

        return _inplace(self._collective("scatter_v", plan, async_op))

    def reduce_scatter_v(
        self, send: Buf, recv: Buf, counts: Sequence[int], op: OpArg = None, *, async_op: bool = False
    ) -> MpiWork | None:
        send, recv, counts = numpy_view(send), numpy_view(recv), list(counts)

        def plan(comm: MPI.Intracomm) -> Call:
            return plans.reduce_scatter_v(self, comm, send, recv, counts, op)

        return _inplace(self._collective("reduce_scatter_v", plan, async_op))

    def send(self, buf: Buf, dst: int, tag: int = 0, *, async_op: bool = False) -> MpiWork | None:
        buf = numpy_view(buf)
        queue = self._member_queue("send")
        code, _, _, _, _ = self._calls.send(checkable(buf), dst)
        dt, peer = carrier(code), self._peer(dst, tag, "send")

        def describe() -> str:
            return f"send(dst={dst}, tag={tag}, {buf.dtype}, count={buf.size}) in MPI group {self._ranks}"

        with queue.lock:
            flight = queue.flight.p2p(True, dst, tag, code, buf.size)
            req = _issued(flight, lambda: queue.comm.Isend([buf, dt], peer, tag))
            return _inplace(queue.run(req, buf, None, None, buf.nbytes, describe, async_op, flight))

    def recv(self, buf: Buf, src: int, tag: int = 0, *, async_op: bool = False) -> MpiWork | None:
        return _inplace(self._recv(numpy_view(buf), src, tag, None, async_op))

    def recv_any(self, buf: Buf, tag: int = 0, *, async_op: bool = False) -> int | MpiWork:
        """Receive into `buf` the first message with `tag` from any other member (MPI.ANY_SOURCE):
        the sender's global rank, or with `async_op` a handle whose `wait()` and `source_rank()` give it.
        Which of several ready senders goes first is MPI's choice."""
        return self._recv(numpy_view(buf), None, tag, None, async_op)

    # --- returning variants (the output is allocated inside the plan, so a bad input still takes part
    # in the signature check and peers fail at once) ---------------------------------------------------

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
        factors = (prescale_factor, postscale_factor)

        def plan(comm: MPI.Intracomm) -> Call:
            if out is not None:
                return plans.all_reduce(self, comm, numpy_view(t), op, out, numpy_view(out), *factors)
            new = np.array(numpy_view(t), order="C")
            return plans.all_reduce(self, comm, new, op, like(t)(new), None, *factors)

        return self._collective("all_reduce", plan, async_op)

    def broadcast_tensor(self, t: Buf, src: int | None = None, *, async_op: bool = False) -> Any:
        def plan(comm: MPI.Intracomm) -> Call:
            arr = np.asarray(numpy_view(t))
            is_src = self._rank == (self._ranks[0] if src is None else src)
            # Off the source only shape and dtype matter: skip copying contents about to be overwritten.
            out = np.array(arr, order="C") if is_src else np.empty(arr.shape, arr.dtype)
            return plans.broadcast(self, comm, out, src, like(t)(out))

        return self._collective("broadcast", plan, async_op)

    def all_gather_tensor(self, t: Buf, *, out: Buf | None = None, async_op: bool = False) -> Any:
        def plan(comm: MPI.Intracomm) -> Call:
            if out is not None:
                return plans.all_gather(self, comm, numpy_view(t), numpy_view(out), out)
            send = np.ascontiguousarray(numpy_view(t))
            new = np.empty((self.size(), *send.shape), send.dtype)
            return plans.all_gather(self, comm, send, new, like(t)(new))

        return self._collective("all_gather", plan, async_op)

    def reduce_scatter_tensor(
        self, t: Buf, op: OpArg = None, *, out: Buf | None = None, async_op: bool = False
    ) -> Any:
        def plan(comm: MPI.Intracomm) -> Call:
            if out is not None:
                return plans.reduce_scatter(self, comm, numpy_view(t), numpy_view(out), op, out)
            send = np.ascontiguousarray(numpy_view(t))
            if send.ndim == 0 or send.shape[0] % self.size():
                raise ValueError(
                    f"reduce_scatter_tensor: dim 0 of shape {send.shape} does not divide by the group size "
                    f"{self.size()}"
                )
            new = np.empty((send.shape[0] // self.size(), *send.shape[1:]), send.dtype)
            return plans.reduce_scatter(self, comm, send, new, op, like(t)(new))

        return self._collective("reduce_scatter", plan, async_op)

    def send_tensor(self, t: Buf, dst: int, tag: int = 0, *, async_op: bool = False) -> MpiWork | None:
        return self.send(np.ascontiguousarray(numpy_view(t)), dst, tag, async_op=async_op)

    def recv_tensor(
        self,
        shape: int | Sequence[int],
        dtype: npt.DTypeLike,
        src: int,
        tag: int = 0,
        *,
        async_op: bool = False,
    ) -> Any:
        out = np.empty(shape, dtype)
        return self._recv(out, src, tag, out, async_op)

    def _recv(
        self, buf: np.ndarray, src: int | None, tag: int, result: Result, async_op: bool
    ) -> MpiWork | Result:
        """A receive from global rank `src`, or from any source when None (then its result is the
        sender's global rank)."""
        queue = self._member_queue("recv")
        if src is None:
            code, _, _, _, _ = self._calls.recv_any(checkable(buf))
            dt, peer = carrier(code), MPI.ANY_SOURCE
            self._check_tag(tag, "recv")
        else:
            code, _, _, _, _ = self._calls.recv(checkable(buf), src)
            dt, peer = carrier(code), self._peer(src, tag, "recv")
        source = "any source" if src is None else src

        def describe() -> str:
            return f"recv(src={source}, tag={tag}, {buf.dtype}, count={buf.size}) in MPI group {self._ranks}"

        def finish(status: MPI.Status) -> int | None:
            got = status.Get_count(dt)
            if got != buf.size:
                # MPI accepts a shorter message silently; the package treats it as a size mismatch.
                sender = self._ranks[status.Get_source()]
                message = f"{describe()}: the sender sent {got} elements"
                raise CollectiveMismatchError(message, rank=self._rank, ranks=[sender], call=describe())
            return self._ranks[status.Get_source()] if src is None else None

        with queue.lock:
            flight = queue.flight.p2p(False, src, tag, code, buf.size)
            req = _issued(flight, lambda: queue.comm.Irecv([buf, dt], peer, tag))
            return queue.run(req, buf, finish, result, buf.nbytes, describe, async_op, flight)

    def _collective(
        self, kind: str, plan: Callable[[MPI.Intracomm], Call], async_op: bool
    ) -> MpiWork | Result:
        """Validate and issue a collective, after the signature check when it is on: its handle with
        `async_op`, else its result once complete."""
        queue = self._member_queue(kind)
        with queue.lock:
            return self._issue(queue, kind, plan, async_op)

    def _issue(
        self, queue: OpQueue, kind: str, plan: Callable[[MPI.Intracomm], Call], async_op: bool
    ) -> MpiWork | Result:
        """`_collective` with the queue's lock held."""
        code = KIND_CODES[kind]
        queue.seq += 1
        seq = queue.seq
        describe = partial(self._describe, kind, seq)
        try:
            call = plan(queue.comm)
        except (TypeError, ValueError):
            if self._check:
                check_signatures(queue, invalid_signature(code), seq, self._ranks, describe)
            raise
        root = -1 if call.root < 0 else self._ranks[call.root]  # the core signs with global ranks
        flight = queue.flight.collective(
            kind,
            seq,
            None if call.dtype < 0 else call.dtype,
            call.count,
            root=None if root < 0 else root,
            op=call.op,
            prescale=call.pre,
            postscale=call.post,
        )
        try:
            if self._check:
                mine = signature(1, code, call.dtype, call.count, root, call.op, call.pre, call.post)
                check_signatures(queue, mine, seq, self._ranks, describe)
                if call.layout is not None:
                    agreed = (seq, code, call.dtype, call.count, root, call.op, call.pre, call.post)
                    check_layouts(queue, agreed, call.layout, self._ranks, describe)
            flight.started()
            req = call.start()
        except BaseException:
            flight.end(False, MPI_ROUTE)
            raise
        return queue.run(req, call.start, call.finish, call.result, call.nbytes, describe, async_op, flight)

    def _all_reduce_now(self, queue: OpQueue, buf: np.ndarray, code: int, dt: MPI.Datatype, rop: Op) -> None:
        """A blocking all_reduce on an idle queue, of valid arguments that MPI reduces as they are (not
        float16): `_issue` and `queue.run` for this one case, without the plan, handle and closures that
        cost more than the MPI call itself for small messages."""
        queue.seq += 1
        flight = queue.flight.collective("all_reduce", queue.seq, code, buf.size, op=rop.code)
        try:
            self._all_reduce_recorded(queue, buf, code, dt, rop, flight)
        except BaseException:
            flight.end(False, MPI_ROUTE)
            raise
        flight.end(True, MPI_ROUTE)

    def _all_reduce_recorded(
        self, queue: OpQueue, buf: np.ndarray, code: int, dt: MPI.Datatype, rop: Op, flight: FlightCall
    ) -> None:
        """`_all_reduce_now`'s call, recorded in `flight` (marked started once every member came)."""
        # Errors here are raised before the lock is released, while queue.seq is still this call's: the
        # bound method describes it without building a partial per call.
        describe = self._describe_current_all_reduce
        if self._check:
            count = buf.size
            mine = (1, ALL_REDUCE_CODE, code, count, -1, rop.code, ONE, ONE)  # signature(...), spelled out
            if rop.sums and count <= FUSE_SLOTS and code in FUSABLE_DTYPES:
                # Small enough to ride along with the check: one MPI call instead of two, when every
                # rank's data rode along (see FUSE_SLOTS in mpi.check).
                flat = buf if buf.ndim == 1 else buf.reshape(-1)
                if check_signatures(queue, mine, queue.seq, self._ranks, describe, flat):
                    flight.started()
                    if rop.average:
                        finish_result(buf, len(self._ranks), 1.0)
                    return
            else:
                check_signatures(queue, mine, queue.seq, self._ranks, describe)
        flight.started()
        req = queue.comm.Iallreduce(MPI.IN_PLACE, [buf, dt], rop.mpi_op)
        queue.wait_request(req, buf.nbytes, describe)
        if rop.average:
            finish_result(buf, len(self._ranks), 1.0)

    def _describe(self, kind: str, seq: int) -> str:
        return f"{kind} (seq {seq}) in MPI group {self._ranks}"

    def _describe_current_all_reduce(self) -> str:
        return self._describe("all_reduce", self._member_queue("all_reduce").seq)

    def _member_recorder(self) -> FlightRecorder:
        """This member's flight recorder; ValueError on a non-member."""
        if self._queue is None:
            raise ValueError(f"rank {self._rank} is not a member of MPI group {self._ranks}")
        return self._queue.flight

    def _member_queue(self, what: str) -> OpQueue:
        queue = self._queue
        if queue is None:
            raise ValueError(f"{what}: rank {self._rank} is not a member of MPI group {self._ranks}")
        if queue.poisoned is not None:
            abort_mpi(
                MPI.COMM_WORLD,
                f"axonml_distributed: {what} called on MPI group {self._ranks}, unusable since "
                f"{queue.poisoned}; aborting the MPI job, as MPI cannot cancel the operation the other "
                "ranks may still be waiting in",
            )
        return queue

    def _peer(self, rank: int, tag: int, what: str) -> int:
        """The group index of `rank`, a peer the core accepted, once `tag` is one MPI can carry."""
        self._check_tag(tag, what)
        return self._index[rank]

    def _check_tag(self, tag: int, what: str) -> None:
        largest = tag_ub() - 1  # the largest of all is reserved (see await_peers)
        if not is_int(tag) or not 0 <= tag <= largest:
            raise ValueError(f"{what}: tag must be an integer in [0, {largest}], got {tag!r}")

    def _direct_all_reduce(self, buf: np.ndarray, op: OpArg) -> tuple[int, MPI.Datatype, Op] | None:
        """dtype code, MPI datatype and op of an all_reduce that MPI performs on `buf` itself, or None:
        for float16 and bfloat16 (reduced in a float32 copy) and for invalid arguments, which the
        general path reports after taking part in the signature check."""
        try:
            code, _, _, op_code, _ = self._calls.all_reduce(checkable(buf), op)
            return None if code in WIDENED_CODES else (code, carrier(code), mpi_op(op_code, code))
        except (TypeError, ValueError):
            return None


def _issued(flight: FlightCall, issue: Callable[[], MPI.Request]) -> MPI.Request:
    """The request `issue()` made, or its error, after which the record `flight` ends failed."""
    try:
        return issue()
    except BaseException:
        flight.end(False, MPI_ROUTE)
        raise


def _inplace(outcome: MpiWork | Result) -> MpiWork | None:
    """In-place operations return their handle with async_op, else None once complete (the *_tensor
    ones return the handle or the new array, typed Any like the native groups)."""
    return outcome if isinstance(outcome, MpiWork) else None
