"""The call-signature check of the MPI group: before any data moves, the ranks agree on what each called
with one small MPI call, the same on every rank; small all_reduces ride along with it."""

from __future__ import annotations

import struct

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import DTYPE_CODES, layout_mismatch_error, mismatch_error
from axonml_distributed.exceptions import CollectiveMismatchError
from axonml_distributed.mpi.args import Describe
from axonml_distributed.mpi.queue import OpQueue, mpi_error

# A call signature: valid, kind, dtype, count, root, op, prescale, postscale, seq, with the core's codes
# (`root` is a global rank, `count` the elements of each member's part; the factors as the bits of their
# float64) so that the core describes a mismatch. Unset fields are -1 (count 0, factors 1.0); a rank
# whose own arguments were invalid sends valid = 0 and only kind and seq, so that peers fail at once
# instead of waiting for it.
SIGNATURE_FIELDS = 9
# A signature without its sequence number: (valid, kind, dtype, count, root, op, prescale, postscale).
Static = tuple[int, int, int, int, int, int, int, int]
_F64 = struct.Struct("=d")
_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")


def factor_bits(factor: float) -> int:
    """A scaling factor as the bits of its float64 (what signatures compare)."""
    return int(_U64.unpack(_F64.pack(factor))[0])


ONE = factor_bits(1.0)

# The check is one SUM-allreduce of a fixed number of float64 values, the same MPI call on every rank
# whatever its signature (ranks that disagree must not make different MPI calls). Each signature field
# is split into 16-bit components f (after adding 1, so that -1 becomes 0), and every component travels
# with its square: all ranks sent the same f exactly when sum(f) == n*f and sum(f^2) == n*f^2 (the
# variance is zero). Both sums are exact integers in float64 while n*f^2 < 2^53, i.e. up to 2^21 ranks;
# and every rank draws the same conclusion (if any two components differ, no rank's test passes).
# Components per field of `Static` (count and root may be large; the others are small codes):
STATIC_CHUNKS = (1, 1, 1, 4, 2, 1, 5, 5)
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
FUSABLE_DTYPES = (DTYPE_CODES["float32"], DTYPE_CODES["float64"])
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


def signature(
    valid: int, kind: int, dtype: int, count: int, root: int, op: int, pre: float = 1.0, post: float = 1.0
) -> Static:
    """A call signature without its sequence number."""
    scaled = pre != 1.0 or post != 1.0
    return (
        valid,
        kind,
        dtype,
        count,
        root,
        op,
        *((factor_bits(pre), factor_bits(post)) if scaled else (ONE, ONE)),
    )


def invalid_signature(kind: int) -> Static:
    return (0, kind, -1, 0, -1, -1, ONE, ONE)


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
    # The factors' bits as int64 (the same 64 bits), to travel in one int64 array.
    mine = (*static[:6], *(_I64.unpack(_U64.pack(b))[0] for b in static[6:]), seq)
    every = np.empty((len(ranks), SIGNATURE_FIELDS), dtype=np.int64)
    own = np.array(mine, dtype=np.int64)
    queue.wait_request(queue.comm.Iallgather([own, MPI.INT64_T], [every, MPI.INT64_T]), 0, describe)
    if static[0] == 0:
        return False
    raise mismatch(every, ranks)


def mismatch(every: np.ndarray, ranks: list[int]) -> CollectiveMismatchError:
    """The core's CollectiveMismatchError for the members' calls (`every`: one gathered signature per
    member), worded and with the facts the native worlds give theirs; members whose own arguments were
    invalid, which the core's worlds never publish, are named after it."""
    signatures = every.tolist()

    def factor(bits: int) -> float:
        return float(_F64.unpack(_I64.pack(bits))[0])

    calls = [
        (seq, kind, dtype, count, root, op, factor(pre), factor(post))
        for _, kind, dtype, count, root, op, pre, post, seq in signatures
    ]
    error = mismatch_error(calls, ranks)
    assert error is not None  # the check failed, so two signatures differ
    invalid = [rank for rank, sig in zip(ranks, signatures, strict=True) if not sig[0]]
    if invalid:
        error.args = (f"{error}; rank(s) {invalid} passed invalid arguments and raised their own error",)
    return error


def check_layouts(
    queue: OpQueue,
    sig: tuple[int, int, int, int, int, int, float, float],
    layout: list[int],
    ranks: list[int],
    describe: Describe,
) -> None:
    """After the signatures agree, the layouts of a collective with per-member sizes (counts or split
    sizes, the core's words; `sig` the agreed signature, (seq, kind, dtype, count, root, op, prescale,
    postscale)): every rank gathers every member's and raises the core's CollectiveMismatchError when
    they do not make one plan, as the native worlds do."""
    mine = np.array(layout, dtype=np.int64)
    every = np.empty((len(ranks), mine.size), dtype=np.int64)
    queue.wait_request(queue.comm.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]), 0, describe)
    error = layout_mismatch_error(sig, every.tolist(), ranks)
    if error is not None:
        raise error
