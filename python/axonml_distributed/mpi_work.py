"""Machinery behind the MPI process group (`mpi.py`): dtype and op tables, waiting with a deadline,
in-order completion of pending work, and the call-signature check.

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

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import ReduceOp
from axonml_distributed.exceptions import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
)

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

# (member, name, MPI op); an op's code in call signatures is its position + 1. ReduceOp members are
# compared with ==, not hashed: the native enum is not hashable. AVERAGE is MPI SUM, then a division.
OPS: tuple[tuple[ReduceOp, str, MPI.Op], ...] = (
    (ReduceOp.SUM, "SUM", MPI.SUM),
    (ReduceOp.PRODUCT, "PRODUCT", MPI.PROD),
    (ReduceOp.MIN, "MIN", MPI.MIN),
    (ReduceOp.MAX, "MAX", MPI.MAX),
    (ReduceOp.AVERAGE, "AVERAGE", MPI.SUM),
)
OP_NAMES = {code: name for code, (_, name, _) in enumerate(OPS, 1)}
# Names accepted in place of a member, as by the native groups (case-insensitive).
OP_CODES = {**{name: code for code, name in OP_NAMES.items()}, "MEAN": 5}
SUM_CODE = OP_CODES["SUM"]
AVERAGE_CODE = OP_CODES["AVERAGE"]

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


# What an operation returns: None for in-place ones, the new array for the *_tensor ones.
Result = np.ndarray | None
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


# Built once: resolving an op is on every reduction's path.
OP_TABLE = tuple(Op(code, mpi_op, code == AVERAGE_CODE) for code, (_, _, mpi_op) in enumerate(OPS, 1))


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
        code = OP_CODES.get(op.upper())
        if code is None:
            raise ValueError(f'{what}: unknown reduce op "{op}"; use a ReduceOp member')
        return code
    for code, (member, _, _) in enumerate(OPS, 1):
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
        raise TypeError(f"{what}: expected a numpy array, got {type(arr).__name__}")
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
        # The signature check's buffer, reused: checks are serialized by `lock`, and each completes
        # before the lock is released.
        self.signature = bytearray(SIGNATURE.size)
        # With MPI 4, the check is a persistent allreduce over that buffer: starting one cost 0.8 us for
        # two ranks on 2 cores with MPICH, issuing an Iallreduce 1.7 us. Its creation is collective, like
        # the communicator's just before it on every member.
        self._check_request: MPI.Prequest | None = None
        if check and MPI.Get_version() >= (4, 0):
            signature_buf = [self.signature, MPI.INT64_T]
            self._check_request = comm.Allreduce_init(MPI.IN_PLACE, signature_buf, MPI.MAX)

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

    def start_check(self) -> MPI.Request:
        """Start the signature check's MAX-allreduce over `signature`."""
        if self._check_request is None:
            return self.comm.Iallreduce(MPI.IN_PLACE, [self.signature, MPI.INT64_T], MPI.MAX)
        self._check_request.Start()
        return self._check_request

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

# valid, kind, dtype, count, root, op, seq. Unused fields are -1; a rank whose own arguments were invalid
# sends valid = 0 and only kind and seq, so that peers fail at once instead of waiting for it.
SIGNATURE_FIELDS = 7
# A signature travels with its negation, packed without numpy (see check_signatures).
SIGNATURE = struct.Struct(f"={2 * SIGNATURE_FIELDS}q")


def signature(valid: int, kind: int, dtype: int, count: int, root: int, op: int, seq: int) -> tuple[int, ...]:
    """The call signature followed by its negation. Spelled out: this is on every checked call's path."""
    return (valid, kind, dtype, count, root, op, seq, -valid, -kind, -dtype, -count, -root, -op, -seq)


def invalid_signature(kind: int, seq: int) -> tuple[int, ...]:
    return signature(0, kind, -1, -1, -1, -1, seq)


def check_signatures(queue: OpQueue, both: tuple[int, ...], ranks: list[int], describe: Describe) -> bool:
    """Agree on the call signature (`both`, from `signature`) before any data moves. Returns whether all
    ranks agree; on disagreement every rank learns every signature and raises CollectiveMismatchError,
    except that a rank whose own arguments were invalid returns False so it can raise its own
    TypeError/ValueError."""
    # One MAX-allreduce of [x, -x] yields max(x) and -min(x): every rank sent x exactly when the vector
    # comes back unchanged.
    packed = queue.signature
    SIGNATURE.pack_into(packed, 0, *both)
    queue.wait_request(queue.start_check(), 0, describe)
    if SIGNATURE.unpack_from(packed) == both:
        return True
    # Failure path only: gather everyone's signature so the error can name who differs.
    mine = both[:SIGNATURE_FIELDS]
    every = np.empty((len(ranks), SIGNATURE_FIELDS), dtype=np.int64)
    sent = np.array(mine, dtype=np.int64)
    queue.wait_request(queue.comm.Iallgather([sent, MPI.INT64_T], [every, MPI.INT64_T]), 0, describe)
    if mine[0] == 0:
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
