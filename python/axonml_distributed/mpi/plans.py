"""Plans of the MPI group's collectives: each validates its arguments and describes the MPI call to issue,
its post-processing and its signature, without issuing it (the group runs the signature check first).

A plan's arguments are checked inside it, by the core (the group's `ProcessGroup.call_check`: the native
groups' own checks), so
a rank whose input is invalid still takes part in the signature check and its peers fail at once
instead of timing out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from axonml_distributed._types import OpArg
from axonml_distributed.mpi.args import (
    WIDENED,
    Finish,
    Result,
    carrier,
    checkable,
    mpi_op,
    reduction_buffer,
)

if TYPE_CHECKING:
    from axonml_distributed.mpi.group import MpiProcessGroup


@dataclass(slots=True)
class Call:
    """A validated collective, ready to issue: the MPI call (its partial holds every buffer of the
    operation), its post-processing and result, and its signature: `root` is a group index (-1: none),
    `count` the elements of each member's part, as in the core's signatures. Not frozen: this is built
    on every call, and a frozen dataclass's __init__ costs a microsecond."""

    start: Callable[[], MPI.Request]
    nbytes: int
    finish: Finish = None
    result: Result = None
    dtype: int = -1
    count: int = 0
    root: int = -1
    op: int = -1
    pre: float = 1.0
    post: float = 1.0
    # The collectives with per-member sizes: this member's layout words (the core's, see call_check),
    # compared across members after the signature check.
    layout: list[int] | None = None


def _after(prepare: Callable[[], None] | None, start: Callable[[], MPI.Request]) -> Callable[[], MPI.Request]:
    """`start`, preceded by `prepare` when there is one (it runs once the signatures agree)."""
    if prepare is None:
        return start

    def started() -> MPI.Request:
        prepare()
        return start()

    return started


def all_reduce(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    buf: np.ndarray,
    op: OpArg,
    result: Result,
    out: np.ndarray | None = None,
    pre: float = 1.0,
    post: float = 1.0,
) -> Call:
    into = None if out is None else checkable(out)
    code, count, _, op_code, _ = g._calls.all_reduce(
        checkable(buf), op, out=into, prescale_factor=pre, postscale_factor=post
    )
    rop = mpi_op(op_code, code)
    # out=: MPI reads buf and writes out (Allreduce(send, recv)), unless the input is prepared first.
    target, send = (buf, None) if out is None or out is buf else (out, buf)
    data, dt, prepare, finish = reduction_buffer(
        target, carrier(code), rop, g.size(), True, True, send, pre, post
    )
    source = MPI.IN_PLACE if prepare is not None or send is None else [send, dt]
    start = _after(prepare, partial(comm.Iallreduce, source, [data, dt], rop.mpi_op))
    return Call(start, target.nbytes, finish, result, code, count, -1, op_code, pre, post)


def broadcast(
    g: MpiProcessGroup, comm: MPI.Intracomm, buf: np.ndarray, src: int | None, result: Result
) -> Call:
    code, count, root, _, _ = g._calls.broadcast(checkable(buf), src)
    start = partial(comm.Ibcast, [buf, carrier(code)], root)
    return Call(start, buf.nbytes, None, result, code, count, root)


def all_gather(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray, result: Result
) -> Call:
    code, count, _, _, _ = g._calls.all_gather(checkable(send), checkable(recv))
    dt = carrier(code)
    start = partial(comm.Iallgather, [send, dt], [recv, dt])
    return Call(start, recv.nbytes, None, result, code, count)


def reduce_scatter(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray, op: OpArg, result: Result
) -> Call:
    code, count, _, op_code, _ = g._calls.reduce_scatter(checkable(send), checkable(recv), op)
    rop = mpi_op(op_code, code)
    data, dt, _, finish = reduction_buffer(recv, carrier(code), rop, g.size(), copy_in=False, write_back=True)
    source = send.astype(np.float32) if data is not recv else send
    start = partial(comm.Ireduce_scatter_block, [source, dt], [data, dt], rop.mpi_op)
    return Call(start, send.nbytes, finish, result, code, count, -1, op_code)


def gather(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray | None, dst: int
) -> Call:
    code, count, root, _, _ = g._calls.gather(checkable(send), checkable(recv), dst)
    dt = carrier(code)
    recv_spec = [recv, dt] if g.rank() == dst else None
    start = partial(comm.Igather, [send, dt], recv_spec, root)
    return Call(start, send.nbytes * g.size(), dtype=code, count=count, root=root)


def scatter(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray | None, recv: np.ndarray, src: int
) -> Call:
    code, count, root, _, _ = g._calls.scatter(checkable(send), checkable(recv), src)
    dt = carrier(code)
    send_spec = [send, dt] if g.rank() == src else None
    start = partial(comm.Iscatter, send_spec, [recv, dt], root)
    return Call(start, recv.nbytes * g.size(), dtype=code, count=count, root=root)


def reduce(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    buf: np.ndarray,
    dst: int,
    op: OpArg,
    out: np.ndarray | None = None,
    pre: float = 1.0,
    post: float = 1.0,
) -> Call:
    into = None if out is None else checkable(out)
    code, count, root, op_code, _ = g._calls.reduce(
        checkable(buf), dst, op, out=into, prescale_factor=pre, postscale_factor=post
    )
    rop = mpi_op(op_code, code)
    is_root = g.rank() == dst
    target, send = (buf, None) if out is None or out is buf else (out, buf)
    if not is_root:
        # MPI leaves non-root buffers untouched, and so do we: the input is only read (prescaled, if at
        # all, into a scratch copy), and out is not written.
        scratch = pre != 1.0 and buf.dtype not in WIDENED
        target, send = (np.empty_like(buf) if scratch else buf), buf
    data, dt, prepare, finish = reduction_buffer(
        target, carrier(code), rop, g.size(), True, is_root, send, pre, post
    )
    source = [data, dt] if prepare is not None or send is None else [send, dt]
    if is_root:
        send_spec, recv_spec = (MPI.IN_PLACE if source[0] is data else source), [data, dt]
    else:
        send_spec, recv_spec = source, None
    start = _after(prepare, partial(comm.Ireduce, send_spec, recv_spec, rop.mpi_op, root))
    return Call(start, buf.nbytes, finish, None, code, count, root, op_code, pre, post)


def barrier(comm: MPI.Intracomm) -> Call:
    return Call(comm.Ibarrier, 0)


# --- all_to_all and the collectives with per-member sizes (counts in elements, as the core's layouts) --


def _displacements(counts: list[int]) -> list[int]:
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist() if counts else []


def all_to_all(g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray) -> Call:
    code, count, _, _, _ = g._calls.all_to_all(checkable(send), checkable(recv))
    dt = carrier(code)
    start = partial(comm.Ialltoall, [send, dt], [recv, dt])
    return Call(start, send.nbytes, dtype=code, count=count)


def all_to_all_single(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    send: np.ndarray,
    recv: np.ndarray,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
) -> Call:
    code, count, _, _, words = g._calls.all_to_all_single(
        checkable(send), checkable(recv), output_split_sizes, input_split_sizes
    )
    dt, n = carrier(code), g.size()
    ins, outs = words[:n], words[n:]
    send_spec = [send, (ins, _displacements(ins)), dt]
    start = partial(comm.Ialltoallv, send_spec, [recv, (outs, _displacements(outs)), dt])
    return Call(start, send.nbytes, dtype=code, count=count, layout=words)


def all_gather_v(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray, counts: list[int]
) -> Call:
    code, count, _, _, words = g._calls.all_gather_v(checkable(send), checkable(recv), counts)
    dt = carrier(code)
    start = partial(comm.Iallgatherv, [send, dt], [recv, (words, _displacements(words)), dt])
    return Call(start, recv.nbytes, dtype=code, count=count, layout=words)


def gather_v(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    send: np.ndarray,
    recv: np.ndarray | None,
    counts: list[int],
    dst: int,
) -> Call:
    code, count, root, _, words = g._calls.gather_v(checkable(send), checkable(recv), counts, dst)
    dt = carrier(code)
    recv_spec = [recv, (words, _displacements(words)), dt] if g.rank() == dst else None
    start = partial(comm.Igatherv, [send, dt], recv_spec, root)
    return Call(start, send.nbytes * g.size(), dtype=code, count=count, root=root, layout=words)


def scatter_v(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    send: np.ndarray | None,
    recv: np.ndarray,
    counts: list[int],
    src: int,
) -> Call:
    code, count, root, _, words = g._calls.scatter_v(checkable(send), checkable(recv), counts, src)
    dt = carrier(code)
    send_spec = [send, (words, _displacements(words)), dt] if g.rank() == src else None
    start = partial(comm.Iscatterv, send_spec, [recv, dt], root)
    return Call(start, recv.nbytes * g.size(), dtype=code, count=count, root=root, layout=words)


def reduce_scatter_v(
    g: MpiProcessGroup,
    comm: MPI.Intracomm,
    send: np.ndarray,
    recv: np.ndarray,
    counts: list[int],
    op: OpArg,
) -> Call:
    code, count, _, op_code, words = g._calls.reduce_scatter_v(checkable(send), checkable(recv), counts, op)
    rop = mpi_op(op_code, code)
    data, dt, _, finish = reduction_buffer(recv, carrier(code), rop, g.size(), copy_in=False, write_back=True)
    source = send.astype(np.float32) if data is not recv else send
    start = partial(comm.Ireduce_scatter, [source, dt], [data, dt], words, rop.mpi_op)
    return Call(start, send.nbytes, finish, None, code, count, -1, op_code, layout=words)
