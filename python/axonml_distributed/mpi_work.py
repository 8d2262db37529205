"""Machinery behind the MPI process group (`mpi.py`): dtype and op tables, waiting with a deadline,
the arrival check before creating a communicator, in-order completion of pending work, and the
call-signature check.

MPI collectives cannot be cancelled, so every operation is issued non-blocking (`I*`) and completed by a
`Test` loop with a deadline; a rank that gives up aborts the whole MPI job (see `OpQueue`).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import ReduceOp
from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
)
from axonml_distributed.tensors import is_tensor

# numpy dtype -> (code used in call signatures, MPI datatype that carries it).
# MPI has no portable float16 type: float16 travels as its 16-bit pattern (UINT16_T), which is exact
# for everything that only moves bytes; reductions widen it to float32 instead (see `reduction_buffer`).
DTYPES: dict[np.dtype, tuple[int, MPI.Datatype]] = {
    np.dtype(np.float16): (1, MPI.UINT16_T),
    np.dtype(np.float32): (2, MPI.FLOAT),
    np.dtype(np.float64): (3, MPI.DOUBLE),
    np.dtype(np.int8): (4, MPI.INT8_T),
    np.dtype(np.uint8): (5, MPI.UINT8_T),
    np.dtype(np.int32): (6, MPI.INT32_T),
    np.dtype(np.int64): (7, MPI.INT64_T),
}
DTYPE_NAMES = {code: dt.name for dt, (code, _) in DTYPES.items()}
# Compared with a dtype rather than with np.float16, which numpy would convert on every comparison.
FLOAT16 = np.dtype(np.float16)
FLOAT16_CODE = DTYPES[FLOAT16][0]

# (member, MPI op); an op's code in call signatures is its position + 1. ReduceOp members are compared
# with ==, not hashed: the native enum is not hashable. AVERAGE is MPI SUM, then a division.
OPS: tuple[tuple[ReduceOp, MPI.Op], ...] = (
    (ReduceOp.SUM, MPI.SUM),
    (ReduceOp.PRODUCT, MPI.PROD),
    (ReduceOp.MIN, MPI.MIN),
    (ReduceOp.MAX, MPI.MAX),
    (ReduceOp.AVERAGE, MPI.SUM),
)
# Names as the native enum spells its members ("ReduceOp.SUM" -> "SUM"), for messages.
OP_NAMES = {code: repr(member).rpartition(".")[2] for code, (member, _) in enumerate(OPS, 1)}
SUM_CODE = 1
AVERAGE_CODE = len(OPS)
# Names accepted in place of a member, case-insensitive, as by the native groups: the enum's own
# attributes (AVG is torch's name for AVERAGE), and "MEAN", which only the native parser knows.
OP_BY_NAME = {
    **{name: getattr(ReduceOp, name) for name in dir(ReduceOp) if name.isupper()},
    "MEAN": ReduceOp.AVERAGE,
}

KIND_NAMES = {
    1: "all_reduce",
    2: "broadcast",
    3: "all_gather",
    4: "reduce_scatter",
    5: "gather",
    6: "scatter",
    7: "reduce",
    8: "barrier",
}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}


def transport_dtype(arr: np.ndarray, what: str) -> tuple[int, MPI.Datatype]:
    """The signature code of `arr`'s dtype and the MPI datatype that carries its elements; TypeError for
    dtypes the native backends do not support."""
    entry = DTYPES.get(arr.dtype)
    if entry is None:
        supported = ", ".join(dt.name for dt in DTYPES)
        raise TypeError(f"{what}: unsupported dtype {arr.dtype}; supported: {supported}")
    return entry


# What an operation returns: None for in-place ones, for the *_tensor ones the new array (a torch tensor
# over it when the caller passed a tensor).
Result = Any
# Post-processing once the MPI request completed, given its status (AVERAGE's division, float16's
# rounding, a receive's size check); None when there is nothing to do, the common case.
Finish = Callable[[MPI.Status], None] | None
# Builds an operation's description for error messages; called only when one is raised, so the
# common path never formats strings.
Describe = Callable[[], str]
# A reduce op as the native groups accept it: a ReduceOp, None (SUM), or a name such as "sum" or "mean".
OpArg = ReduceOp | str | None


@dataclass(frozen=True)
class Op:
    code: int
    mpi_op: MPI.Op
    average: bool
    # SUM or AVERAGE (an MPI SUM): a small all_reduce with this op can ride along with the check.
    sums: bool


# Built once: resolving an op is on every reduction's path.
OP_TABLE = tuple(
    Op(code, mpi_op, code == AVERAGE_CODE, mpi_op is MPI.SUM) for code, (_, mpi_op) in enumerate(OPS, 1)
)


def resolve_op(op: OpArg, dtype: np.dtype, what: str) -> Op:
    code = _op_code(op, what)
    if code == AVERAGE_CODE and dtype.kind != "f":
        # An integer mean would have to truncate; the native backends refuse it too.
        raise TypeError(f"{what}: AVERAGE needs a floating dtype, got {dtype}; use SUM and divide")
    return OP_TABLE[code - 1]


def _op_code(op: OpArg, what: str) -> int:
    if op is None:
        return SUM_CODE
    if isinstance(op, str):
        member = OP_BY_NAME.get(op.upper())
        if member is None:
            raise ValueError(f'{what}: unknown reduce op "{op}"; use a ReduceOp member')
        op = member
    for code, (member, _) in enumerate(OPS, 1):
        # The class attributes are singletons: `is` settles the usual case without a native __eq__.
        if op is member or op == member:
            return code
    raise TypeError(f"{what}: op must be a ReduceOp, got {type(op).__name__}")


# --- arguments ---------------------------------------------------------------------------------------


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def readable(arr: object, what: str, write: bool = False) -> tuple[int, MPI.Datatype]:
    """Validate an array MPI reads (and writes, with `write`); returns its `transport_dtype`."""
    if not isinstance(arr, np.ndarray):
        got = f"a tensor on {arr.device}" if is_tensor(arr) else type(arr).__name__  # type: ignore[attr-defined]
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, got {got}")
    entry = DTYPES.get(arr.dtype) or transport_dtype(arr, what)  # the call raises the error
    flags = arr.flags  # a new object on every access
    if not flags.c_contiguous:
        raise ValueError(f"{what}: the array must be C-contiguous (pass np.ascontiguousarray(a))")
    if write and not flags.writeable:
        raise ValueError(f"{what}: the array is read-only")
    return entry


def writable(arr: object, what: str) -> tuple[int, MPI.Datatype]:
    """Validate an array MPI writes; returns its `transport_dtype`."""
    return readable(arr, what, write=True)


def companion(ref: np.ndarray, other: object, size: int, what: str, write: bool) -> None:
    """The second buffer of a collective: valid itself, with `ref`'s dtype and `size` elements."""
    (writable if write else readable)(other, what)
    assert isinstance(other, np.ndarray)
    if other.dtype != ref.dtype:
        raise ValueError(f"{what}: dtype {other.dtype} differs from {ref.dtype}")
    if other.size != size:
        raise ValueError(f"{what}: {other.size} elements, expected {size} (group size x chunk size)")


def reduction_buffer(
    buf: np.ndarray, dt: MPI.Datatype, rop: Op, size: int, copy_in: bool, write_back: bool
) -> tuple[np.ndarray, MPI.Datatype, Finish]:
    """The array MPI reduces into (float16 is widened to a float32 copy) and the step that divides for
    AVERAGE and writes the result back to `buf` (None when MPI's result needs nothing more). `dt` is
    `buf`'s transport datatype."""
    # MPI has no float16 arithmetic: widen to float32, reduce, and round to float16 once at the end.
    if buf.dtype == FLOAT16:
        wide = buf.astype(np.float32) if copy_in else np.empty(buf.shape, np.float32)

        def narrow(_status: MPI.Status) -> None:
            if write_back:
                if rop.average:
                    np.divide(wide, size, out=wide)
                np.copyto(buf, wide)  # the only rounding to float16

        return wide, MPI.FLOAT, narrow
    if not (write_back and rop.average):
        return buf, dt, None

    def scale(_status: MPI.Status) -> None:
        np.divide(buf, size, out=buf)

    return buf, dt, scale


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
    every rank is known to be there, they complete at once. Each rank exchanges an empty message with
    every peer on the reserved tag, so every rank learns itself who is missing; every message is
    received before this returns, so none is left behind for the application to match."""
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
                return
            now = time.monotonic()
            if now >= deadline:
                break
            time.sleep(min(pause, deadline - now))  # interruptible: Ctrl-C raises KeyboardInterrupt here
            pause = min(2 * pause, SLEEP_MAX_S)
    except MPI.Exception as exc:
        raise mpi_error(describe, exc) from exc
    # A peer that arrived has received this rank's message too, unless its MPI is stuck.
    missing = sorted(peers[peer] for peer in recvs or sends)
    error = CollectiveTimeoutError(
        f"{describe}: rank {MPI.COMM_WORLD.Get_rank()} waited {timeout:g} s, but rank(s) {missing} of "
        f"group {group} never arrived (they are hung, dead, or never made this call)"
    )
    raise abort_job(comm, error)


def abort_job(comm: MPI.Intracomm, error: DistributedError) -> DistributedError:
    """Report `error` on stderr and abort the MPI job. A pending collective cannot be cancelled, and the
    peers stuck in it would otherwise hang forever, so the whole job dies (MPI_Abort). Returns `error`
    so callers can `raise abort_job(...)` in case an MPI implementation ever returns from Abort."""
    print(
        f"axonml_distributed: {type(error).__name__}: {error}\n"
        "axonml_distributed: aborting the MPI job (MPI cannot cancel a collective)",
        file=sys.stderr,
        flush=True,
    )
    comm.Abort(1)
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


class OpQueue:
    """One group's pending operations. Each is finished (post-processing such as AVERAGE's division or
    float16's rounding) in issue order, so work on one group completes in issue order."""

    def __init__(self, comm: MPI.Intracomm, timeout: float, check: bool) -> None:
        self.comm = comm
        self.timeout = timeout
        # Issuing takes the signature check, a sequence number and an MPI call in a fixed order on every
        # rank; two Python threads of one rank must not interleave those, so they are serialized.
        self.lock = threading.Lock()
        self.seq = 0
        self._pending: deque[MpiWork] = deque()
        # The signature check's buffers and MPI request (see `check_signatures`); None without the check.
        self.check = SignatureCheck(comm) if check else None

    def run(
        self,
        req: MPI.Request,
        buffers: object,
        finish: Finish,
        result: Result,
        nbytes: int,
        describe: Describe,
        async_op: bool,
    ) -> MpiWork | Result:
        """Take over a request just issued, with `lock` held: with `async_op` its handle, else its result
        once it and every earlier operation completed."""
        if async_op or self._pending:
            work = MpiWork(self, req, buffers, finish, result, nbytes, describe)
            self._pending.append(work)
            if async_op:
                return work
            self._complete(work, block=True)
            return work.outcome()
        # Blocking with nothing queued ahead, the usual case: completed here, without a handle (the
        # caller holds the buffers until this returns).
        status = MPI.Status()
        self.wait_request(req, nbytes, describe, status)
        if finish is not None:
            finish(status)
        return result

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
            done = req.Test(status) or wait_until(req, time.monotonic() + self.timeout, nbytes, status)
        except MPI.Exception as exc:
            raise mpi_error(describe(), exc) from exc
        if not done:
            raise abort_job(self.comm, self._timeout_error(describe()))

    def complete(self, work: MpiWork, block: bool) -> None:
        with self.lock:
            self._complete(work, block)

    def _complete(self, work: MpiWork, block: bool) -> None:
        deadline = time.monotonic() + self.timeout
        while not work.done:
            front = self._pending[0]
            try:
                if block:
                    finished = wait_until(front.req, deadline, front.nbytes, front.status)
                else:
                    finished = front.req.Test(front.status)
                if finished and front.finish is not None:
                    front.finish(front.status)
            except MPI.Exception as exc:
                finished, front.error = True, mpi_error(front.describe(), exc)
            except DistributedError as exc:
                finished, front.error = True, exc
            if not finished:
                if not block:
                    return
                raise abort_job(self.comm, self._timeout_error(front.describe()))
            self._pending.popleft()
            front.done, front.buffers = True, None

    def _timeout_error(self, describe: str) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"{describe} did not complete within {self.timeout:g} s on MPI rank "
            f"{MPI.COMM_WORLD.Get_rank()}: a peer never reached it, or is stuck or dead"
        )


def mpi_error(describe: str, exc: MPI.Exception) -> DistributedError:
    # With mpi4py's default ERRORS_RETURN handler, MPI reports errors as exceptions instead of aborting.
    # A truncated receive means sender and receiver disagreed on the message size.
    message = f"{describe} failed in MPI: {exc.Get_error_string()}"
    if exc.Get_error_class() == MPI.ERR_TRUNCATE:
        return CollectiveMismatchError(message)
    return DistributedError(message)


# --- call signatures ---------------------------------------------------------------------------------

# A call signature: valid, kind, dtype, count, root, op, seq. Unused fields are -1; a rank whose own
# arguments were invalid sends valid = 0 and only kind and seq, so that peers fail at once instead of
# waiting for it.
SIGNATURE_FIELDS = 7
# A signature without its sequence number: (valid, kind, dtype, count, root, op).
Static = tuple[int, int, int, int, int, int]

# The check is one SUM-allreduce of a fixed number of float64 values, the same MPI call on every rank
# whatever its signature (ranks that disagree must not make different MPI calls). Each signature field
# is split into 16-bit components f (after adding 1, so that -1 becomes 0), and every component travels
# with its square: all ranks sent the same f exactly when sum(f) == n*f and sum(f^2) == n*f^2 (the
# variance is zero). Both sums are exact integers in float64 while n*f^2 < 2^53, i.e. up to 2^21 ranks;
# and every rank draws the same conclusion (if any two components differ, no rank's test passes).
# Components per field of `Static` (count and root may be large; the others are small codes):
STATIC_CHUNKS = (1, 1, 1, 4, 2, 1)
STATIC_COMPONENTS = sum(STATIC_CHUNKS)
# Small all_reduces ride along with the check: a blocking SUM or AVERAGE all_reduce of at most FUSE_SLOTS
# float32 or float64 elements, with nothing pending, puts its data in the payload slots (as float64) and
# sets its "fused" flag. When the signatures agree and the flags sum to n, every rank did so with the same
# dtype, count and op, so the payload sums are the result and no second MPI call is needed; otherwise
# the payload is ignored (it may hold stale values) and the data call follows as usual.
FUSE_SLOTS = 8
# The check vector: [the static components, their squares, seq mod 2^16, its square, fused flag,
# FUSE_SLOTS payload slots] (a rank exactly a multiple of 2^16 calls ahead would go unnoticed). The static
# part changes only with the call's signature, so the send buffer keeps it between calls and each call
# writes the rest, the tail.
STATIC = struct.Struct(f"={2 * STATIC_COMPONENTS}d")
TAIL_AT = STATIC.size  # in bytes
TAIL = struct.Struct("=3d")
TAILS = tuple(struct.Struct(f"={3 + k}d") for k in range(FUSE_SLOTS + 1))
PAYLOAD_AT = TAIL_AT + TAIL.size
CHECK_LENGTH = 2 * STATIC_COMPONENTS + 3 + FUSE_SLOTS
# dtype codes whose all_reduce can ride along: float64 holds their values, and their sums rounded once.
FUSABLE_DTYPES = (DTYPES[np.dtype(np.float32)][0], DTYPES[np.dtype(np.float64)][0])
# Bounds the memo of static parts (one entry per distinct signature a program uses).
STATIC_MEMO_MAX = 1024


class SignatureCheck:
    """A group's check buffers and, with MPI 4, its persistent SUM-allreduce over them. Used with the
    queue's lock held: each check completes before the lock is released. The buffers are bytearrays,
    which struct packs, unpacks and compares faster than numpy arrays: the check is on every call's
    path."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.size = comm.Get_size()
        self.send = bytearray(CHECK_LENGTH * 8)
        self.recv = bytearray(CHECK_LENGTH * 8)
        # recv's payload slots, one float64 view per count, for copying a fused result out.
        self.payloads = tuple(
            np.frombuffer(self.recv, np.float64, k, PAYLOAD_AT) for k in range(FUSE_SLOTS + 1)
        )
        # Static part -> (its packed components and squares, the packed sums when every rank sent them).
        self.memo: dict[Static, tuple[bytes, bytes]] = {}
        self.sent = b""  # the static part now in `send`
        self.comm = comm
        # Starting a persistent allreduce cost 0.8 us for two ranks on 2 cores with MPICH, issuing an
        # Iallreduce 1.7 us. Its creation is collective, like the communicator's just before it.
        self.request: MPI.Prequest | None = None
        if MPI.Get_version() >= (4, 0):
            self.request = comm.Allreduce_init([self.send, MPI.DOUBLE], [self.recv, MPI.DOUBLE], MPI.SUM)

    def start(self) -> MPI.Request:
        request = self.request
        if request is None:
            return self.comm.Iallreduce([self.send, MPI.DOUBLE], [self.recv, MPI.DOUBLE], MPI.SUM)
        request.Start()
        return request

    def remember(self, static: Static) -> tuple[bytes, bytes]:
        """The packed static part of a signature and of the sums expected when every rank sent it."""
        components: list[int] = []
        for value, chunks in zip(static, STATIC_CHUNKS, strict=True):
            shifted = value + 1
            if not 0 <= shifted < 1 << (16 * chunks):
                raise AssertionError(f"signature field {value} out of range")  # the codes are internal
            components.extend((shifted >> (16 * i)) & 0xFFFF for i in range(chunks))
        sent = [*components, *(f * f for f in components)]
        entry = (STATIC.pack(*sent), STATIC.pack(*(self.size * f for f in sent)))
        if len(self.memo) >= STATIC_MEMO_MAX:
            self.memo.clear()
        self.memo[static] = entry
        return entry


def signature(valid: int, kind: int, dtype: int, count: int, root: int, op: int) -> Static:
    """A call signature without its sequence number."""
    return (valid, kind, dtype, count, root, op)


def invalid_signature(kind: int) -> Static:
    return (0, kind, -1, -1, -1, -1)


def check_signatures(
    queue: OpQueue,
    static: Static,
    seq: int,
    ranks: list[int],
    describe: Describe,
    flat: np.ndarray | None = None,
) -> bool:
    """Agree on the call signature (`static`, from `signature`, and `seq`) before any data moves. On
    disagreement every rank learns every signature and raises CollectiveMismatchError, except that a rank
    whose own arguments were invalid returns False so it can raise its own TypeError/ValueError.

    `flat`: the (1-D view of the) buffer of a small all_reduce that may ride along (see FUSE_SLOTS).
    Returns True when every rank's did: `flat` then holds the sums (AVERAGE's division is the caller's),
    and the caller must not issue the data call. False otherwise, with `flat` untouched."""
    check = queue.check
    assert check is not None
    sent, expected = check.memo.get(static) or check.remember(static)
    send = check.send
    if sent is not check.sent:
        send[:TAIL_AT] = sent
        check.sent = sent
    s = seq & 0xFFFF
    if flat is None:
        TAIL.pack_into(send, TAIL_AT, s, s * s, 0.0)
    else:
        count = flat.size
        TAILS[count].pack_into(send, TAIL_AT, s, s * s, 1.0, *flat.tolist())
    persistent = check.request
    if persistent is None:
        queue.wait_request(check.start(), 0, describe)
    else:
        persistent.Start()
        # One Test first, as wait_request's, without its call: the check is often complete at once.
        try:
            done = persistent.Test()
        except MPI.Exception as exc:
            raise mpi_error(describe(), exc) from exc
        if not done:
            queue.wait_request(persistent, 0, describe)
    recv = check.recv
    got_seq, got_square, fused = TAIL.unpack_from(recv, TAIL_AT)
    n = check.size
    if got_seq == n * s and got_square == n * s * s and recv.startswith(expected):
        if fused != n:
            return False
        assert flat is not None  # every rank's data rode along, this rank's too
        flat[...] = check.payloads[count]  # float32: the only rounding
        return True
    # Failure path only: gather everyone's signature so the error can name who differs.
    mine = (*static, seq)
    every = np.empty((len(ranks), SIGNATURE_FIELDS), dtype=np.int64)
    own = np.array(mine, dtype=np.int64)
    queue.wait_request(queue.comm.Iallgather([own, MPI.INT64_T], [every, MPI.INT64_T]), 0, describe)
    if static[0] == 0:
        return False
    raise CollectiveMismatchError(mismatch_message(every, ranks, describe()))


def mismatch_message(every: np.ndarray, ranks: list[int], what: str) -> str:
    by_call: dict[str, list[int]] = {}
    for rank, sig in zip(ranks, every, strict=True):
        by_call.setdefault(describe_signature(sig.tolist()), []).append(rank)
    # The largest camp (on a tie, the one holding the lowest rank) is the reference the others differ from.
    camps = sorted(by_call.items(), key=lambda item: -len(item[1]))
    calls = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {call}" for call, rs in camps)
    odd = sorted(r for _, rs in camps[1:] for r in rs)
    return (
        f"{what}: the ranks made different calls, so no data was moved: {calls} "
        f"(ranks {odd} differ from ranks {camps[0][1]})"
    )


def describe_signature(sig: list[int]) -> str:
    valid, kind, dtype, count, root, op, seq = sig
    name = KIND_NAMES.get(kind, f"kind {kind}")
    if not valid:
        return f"{name} with invalid arguments (seq {seq})"
    parts = [f"dtype={DTYPE_NAMES.get(dtype, dtype)}"] if dtype >= 0 else []
    if count >= 0:
        parts.append(f"count={count}")
    if root >= 0:
        parts.append(f"root={root}")
    if op >= 0:
        parts.append(f"op={OP_NAMES.get(op, op)}")
    parts.append(f"seq={seq}")
    return f"{name}({', '.join(parts)})"
