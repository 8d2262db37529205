"""Completing the MPI group's operations: waiting with a deadline, the arrival check before creating a
communicator, aborting the job, and in-order completion of pending work.

MPI collectives cannot be cancelled, so every operation is issued non-blocking (`I*`) and completed by a
`Test` loop with a deadline; a rank that gives up aborts the whole MPI job (see `OpQueue`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from mpi4py import MPI

from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
)
from axonml_distributed.mpi.args import Describe, Finish, Result

if TYPE_CHECKING:
    from axonml_distributed._core import FlightCall, FlightRecorder
    from axonml_distributed.mpi.check import SignatureCheck

# The route of every operation of the MPI group in its flight recorder.
MPI_ROUTE = "mpi"

# --- waiting -----------------------------------------------------------------------------------------

# Three phases, measured on 2 cores with MPICH:
# - Tight: Test back to back for TIGHT_SPIN_S. A small collective whose peers are already in it completes
#   within microseconds: an 8-byte Iallreduce completed by tight Tests took 1.7 us at 2 ranks, the blocking
#   Allreduce 2-8 us, and a spin that yields between Tests 3-7 us (each sched_yield may hand the core
#   away). Longer is worse with more ranks than cores: back-to-back 8-byte all_reduces at 4 ranks took
#   22 us with 5 us of tight spin, 25 us with 10 us, 38 us with 20 us and 120 us with 100 us (at 2 ranks
#   5 us to 20 us were alike), because a rank spinning tightly starves the peer it waits for.
# - Yielding: Test with sched_yield between tests for 2 ms plus 1 ns per byte moved. A transfer
#   progresses only inside MPI calls, so sleeping while the bytes could still be flowing slows large
#   messages.
# - Sleeping: past the spin the peers are late; sleep, doubling up to 1 ms, so an idle rank leaves its core
#   free but notices its peers within a millisecond. Sleeping sooner (after 0.1 ms) made small all_reduces
#   40x slower at 2 and 4 ranks: once one rank sleeps, its peers time out of their spins too.
TIGHT_SPIN_S = 5e-6
SPIN_BASE_S = 2e-3
SPIN_PER_BYTE_S = 1e-9
SPIN_MAX_S = 0.25
SLEEP_FIRST_S = 50e-6
SLEEP_MAX_S = 1e-3


def wait_until(req: MPI.Request, deadline: float, nbytes: int, status: MPI.Status | None = None) -> bool:
    """Test `req` until it completes (True) or `deadline` (time.monotonic) passes (False)."""
    test = req.Test
    now = time.monotonic()
    tight_until = min(deadline, now + TIGHT_SPIN_S)
    while now < tight_until:
        if test(status):
            return True
        now = time.monotonic()
    spin_until = min(deadline, now + min(SPIN_BASE_S + nbytes * SPIN_PER_BYTE_S, SPIN_MAX_S))
    while now < spin_until:
        os.sched_yield()
        if test(status):
            return True
        now = time.monotonic()
    pause = SLEEP_FIRST_S
    while now < deadline:
        time.sleep(min(pause, deadline - now))
        if test(status):
            return True
        pause = min(2 * pause, SLEEP_MAX_S)
        now = time.monotonic()
    return bool(test(status))


def tag_ub() -> int:
    """The largest tag MPI allows (at least 32767, the standard's minimum). It is reserved for
    `await_peers`; send and recv take tags below it."""
    return int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)


def await_peers(
    comm: MPI.Intracomm, peers: dict[int, int], timeout: float, describe: str, group: list[int]
) -> None:
    """Return once every one of `peers` (rank in `comm` -> global rank) has reached this same call, or
    abort the job with a CollectiveTimeoutError naming those that did not within `timeout` seconds.

    For the collectives that have no non-blocking form with a deadline (creating a communicator): once
    every rank is known to be there, they complete at once."""
    missing = missing_peers(comm, peers, timeout, describe)
    if missing:
        raise abort_job(comm, never_arrived(describe, timeout, missing, group))


def complete_or_abort(
    comm: MPI.Intracomm, req: MPI.Request, timeout: float, describe: str, group: list[int]
) -> None:
    """Complete `req` (a collective of `comm`, outside any group's queue: joining the job) within
    `timeout` seconds, or abort the job with a CollectiveTimeoutError."""
    if not wait_until(req, time.monotonic() + timeout, 0):
        me = MPI.COMM_WORLD.Get_rank()
        late = CollectiveTimeoutError(
            f"{describe} did not complete within {timeout:g} s",
            rank=me,
            call=describe,
            group=group,
            waited=timeout,
        )
        raise abort_job(comm, late)


def missing_peers(comm: MPI.Intracomm, peers: dict[int, int], timeout: float, describe: str) -> list[int]:
    """The global ranks of the `peers` (rank in `comm` -> global rank) that did not make this same call
    within `timeout` seconds. Each rank exchanges an empty message with every peer on the reserved tag,
    so every rank learns itself who is missing; when none is, every message was received, so none is
    left behind for the application to match."""
    tag = tag_ub()
    empty = bytearray(0)
    recvs = {peer: comm.Irecv([empty, MPI.BYTE], peer, tag) for peer in peers}
    sends = {peer: comm.Isend([empty, MPI.BYTE], peer, tag) for peer in peers}
    deadline = time.monotonic() + timeout
    pause = SLEEP_FIRST_S
    try:
        while True:
            recvs = {peer: req for peer, req in recvs.items() if not req.Test()}
            sends = {peer: req for peer, req in sends.items() if not req.Test()}
            if not recvs and not sends:
                return []
            now = time.monotonic()
            if now >= deadline:
                break
            time.sleep(min(pause, deadline - now))  # interruptible: Ctrl-C raises KeyboardInterrupt here
            pause = min(2 * pause, SLEEP_MAX_S)
    except MPI.Exception as exc:
        raise mpi_error(describe, exc) from exc
    # A peer that arrived has received this rank's message too, unless its MPI is stuck.
    return sorted(peers[peer] for peer in recvs or sends)


def never_arrived(
    describe: str, timeout: float, missing: list[int], group: list[int]
) -> CollectiveTimeoutError:
    me = MPI.COMM_WORLD.Get_rank()
    return CollectiveTimeoutError(
        f"{describe}: rank {me} waited {timeout:g} s, but rank(s) {missing} of "
        f"group {group} never arrived (they are hung, dead, or never made this call)",
        rank=me,
        ranks=missing,
        call=describe,
        group=group,
        waited=timeout,
    )


class MonitorExpired(Exception):
    """A wait under `OpQueue.monitor_deadline` passed it (`monitored_barrier` then names who is missing)."""


# How long the launcher gets to end the job after MPI_Abort before this rank exits by itself: MPICH's
# launcher has been seen to leave an aborted job running (pmodels/mpich#7716), and a rank that exits
# with status 1 makes every launcher end the job.
ABORT_GRACE = 5.0


def abort_mpi(comm: MPI.Intracomm, message: str) -> None:
    """Print `message` on stderr and abort the MPI job (MPI_Abort); should this process still be alive
    `ABORT_GRACE` seconds later, it exits with status 1."""
    print(message, file=sys.stderr, flush=True)
    watchdog = threading.Timer(ABORT_GRACE, os._exit, args=(1,))
    watchdog.daemon = True
    watchdog.start()
    comm.Abort(1)


def abort_job(comm: MPI.Intracomm, error: DistributedError) -> DistributedError:
    """Report `error` on stderr and abort the MPI job. A pending collective cannot be cancelled, and the
    peers stuck in it would otherwise hang forever, so the whole job dies (`abort_mpi`). Returns `error`
    so callers can `raise abort_job(...)` in case an MPI implementation ever returns from Abort."""
    abort_mpi(
        comm,
        f"axonml_distributed: {type(error).__name__}: {error}\n"
        "axonml_distributed: aborting the MPI job (MPI cannot cancel a collective)",
    )
    return error


# --- pending work, completed in issue order --------------------------------------------------------------


class MpiWork:
    """Handle of an operation issued with `async_op=True`."""

    __slots__ = (
        "_queue",
        "buffers",
        "describe",
        "done",
        "error",
        "finish",
        "flight",
        "nbytes",
        "req",
        "result",
        "status",
    )

    def __init__(
        self,
        queue: OpQueue,
        req: MPI.Request,
        buffers: object,
        finish: Finish,
        result: Result,
        nbytes: int,
        describe: Describe,
        flight: FlightCall | None,
    ) -> None:
        self._queue = queue
        self.req = req
        # Every array MPI reads or writes until the request completes, float32 staging copies included:
        # mpi4py does not keep them alive, and a buffer freed under a pending request is overwritten.
        self.buffers = buffers
        self.status = MPI.Status()
        self.finish = finish
        self.result = result
        self.nbytes = nbytes
        self.describe = describe
        # The operation's record in the group's flight recorder, ended when it completes (None: a handle
        # made complete, whose call was recorded as it ran).
        self.flight = flight
        self.done = False
        self.error: BaseException | None = None

    def wait(self) -> Result:
        """Block until this and every earlier operation of the group completed; return the op's result
        (None for in-place ops, the array for *_tensor ops) or re-raise its error."""
        self._queue.complete(self, block=True)
        return self.outcome()

    def is_completed(self) -> bool:
        self._queue.complete(self, block=False)
        return self.done

    def outcome(self) -> Result:
        if self.error is not None:
            raise self.error
        return self.result

    def source_rank(self) -> int:
        """The sender's global rank of a completed `recv_any` (its result); ValueError otherwise."""
        if not self.done or self.error is not None or type(self.result) is not int:
            raise ValueError("source_rank(): not a completed receive from any source (wait() for it first)")
        return self.result


class OpQueue:
    """One group's pending operations. Each is finished (post-processing such as AVERAGE's division or
    float16's rounding) in issue order, so work on one group completes in issue order."""

    def __init__(
        self, comm: MPI.Intracomm, timeout: float, check: SignatureCheck | None, flight: FlightRecorder
    ) -> None:
        self.comm = comm
        # This member's flight recorder of the group: its calls, recorded as the native groups'
        # (`pg.stats()`, `dump_flight_recorder`, the timeline, `trace analyze`), route "mpi".
        self.flight = flight
        self.timeout = timeout
        # Issuing takes the signature check, a sequence number and an MPI call in a fixed order on every
        # rank; two Python threads of one rank must not interleave those, so they are serialized.
        self.lock = threading.Lock()
        self.seq = 0
        self._pending: deque[MpiWork] = deque()
        # The signature check's buffers and MPI request (see `check_signatures`); None without the check.
        self.check = check
        # While set (time.monotonic), waits end there and raise MonitorExpired instead of aborting the job.
        self.monitor_deadline: float | None = None
        # Why the group cannot be used any more: an operation MPI cannot cancel was left pending.
        self.poisoned: str | None = None

    def run(
        self,
        req: MPI.Request,
        buffers: object,
        finish: Finish,
        result: Result,
        nbytes: int,
        describe: Describe,
        async_op: bool,
        flight: FlightCall,
    ) -> MpiWork | Result:
        """Take over a request just issued, with `lock` held: with `async_op` its handle, else its result
        once it and every earlier operation completed. `flight`: its record, ended when it completes
        (successfully or not)."""
        if async_op or self._pending:
            work = MpiWork(self, req, buffers, finish, result, nbytes, describe, flight)
            self._pending.append(work)
            if async_op:
                return work
            self._complete(work, block=True)
            return work.outcome()
        # Blocking with nothing queued ahead, the usual case: completed here, without a handle (the
        # caller holds the buffers until this returns).
        status = MPI.Status()
        try:
            self.wait_request(req, nbytes, describe, status)
            got = None if finish is None else finish(status)
        except BaseException:
            flight.end(False, MPI_ROUTE)
            raise
        flight.end(True, MPI_ROUTE, _sender(got))
        return result if got is None else got

    def drain(self) -> None:
        """Complete every pending operation, in issue order (call with `lock` held)."""
        if self._pending:
            self._complete(self._pending[-1], block=True)

    def idle(self) -> bool:
        """Whether no operation issued with async_op awaits completion (call with `lock` held)."""
        return not self._pending

    def wait_request(
        self, req: MPI.Request, nbytes: int, describe: Describe, status: MPI.Status | None = None
    ) -> None:
        """Complete a request that nothing is queued ahead of (a blocking call on an idle queue, or the
        signature check), or abort the job at the deadline."""
        try:
            # One Test before reading the clock: small operations are often complete already.
            done = req.Test(status) or wait_until(req, self._deadline(), nbytes, status)
        except MPI.Exception as exc:
            raise mpi_error(describe(), exc) from exc
        if not done:
            raise self._expired(describe())

    def complete(self, work: MpiWork, block: bool) -> None:
        with self.lock:
            self._complete(work, block)

    def _complete(self, work: MpiWork, block: bool) -> None:
        deadline = self._deadline()
        while not work.done:
            front = self._pending[0]
            try:
                if block:
                    finished = wait_until(front.req, deadline, front.nbytes, front.status)
                else:
                    finished = front.req.Test(front.status)
                if finished and front.finish is not None:
                    got = front.finish(front.status)
                    front.result = front.result if got is None else got
            except MPI.Exception as exc:
                finished, front.error = True, mpi_error(front.describe(), exc)
            except DistributedError as exc:
                finished, front.error = True, exc
            if not finished:
                if not block:
                    return
                if front.flight is not None:
                    front.flight.end(False, MPI_ROUTE)
                raise self._expired(front.describe())
            self._pending.popleft()
            front.done, front.buffers = True, None
            if front.flight is not None:
                front.flight.end(front.error is None, MPI_ROUTE, _sender(front.result))

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout if self.monitor_deadline is None else self.monitor_deadline

    def _expired(self, describe: str) -> Exception:
        """What a wait that passed its deadline raises: MonitorExpired under a monitored barrier, else the
        timeout error, once the job is aborted."""
        if self.monitor_deadline is not None:
            return MonitorExpired()
        return abort_job(self.comm, self._timeout_error(describe))

    def _timeout_error(self, describe: str) -> CollectiveTimeoutError:
        me = MPI.COMM_WORLD.Get_rank()
        return CollectiveTimeoutError(
            f"{describe} did not complete within {self.timeout:g} s on MPI rank "
            f"{me}: a peer never reached it, or is stuck or dead",
            rank=me,
            call=describe,
            waited=self.timeout,
        )


def _sender(got: object) -> int | None:
    """The sender's rank a receive from any source returned (its only int result), for its record."""
    return got if type(got) is int else None


def mpi_error(describe: str, exc: MPI.Exception) -> DistributedError:
    # With mpi4py's default ERRORS_RETURN handler, MPI reports errors as exceptions instead of aborting.
    # A truncated receive means sender and receiver disagreed on the message size.
    message = f"{describe} failed in MPI: {exc.Get_error_string()}"
    kind = CollectiveMismatchError if exc.Get_error_class() == MPI.ERR_TRUNCATE else DistributedError
    return kind(message, rank=MPI.COMM_WORLD.Get_rank(), call=describe)
