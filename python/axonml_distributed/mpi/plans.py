"""Plans of the MPI group's collectives: each validates its arguments and describes the MPI call to issue,
its post-processing and its signature, without issuing it (the group runs the signature check first).

A plan's arguments are checked inside it, so a rank whose input is invalid still takes part in the
signature check and its peers fail at once instead of timing out.
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
    Finish,
    Result,
    companion,
    readable,
    reduction_buffer,
    resolve_op,
    writable,
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


def all_reduce(g: MpiProcessGroup, comm: MPI.Intracomm, buf: np.ndarray, op: OpArg, result: Result) -> Call:
    code, dt = writable(buf, "all_reduce")
    rop = resolve_op(op, code)
    data, dt, finish = reduction_buffer(buf, dt, rop, g.size(), copy_in=True, write_back=True)
    start = partial(comm.Iallreduce, MPI.IN_PLACE, [data, dt], rop.mpi_op)
    return Call(start, buf.nbytes, finish, result, code, buf.size, -1, rop.code)


def broadcast(
    g: MpiProcessGroup, comm: MPI.Intracomm, buf: np.ndarray, src: int | None, result: Result
) -> Call:
    code, dt = writable(buf, "broadcast")
    root = 0 if src is None else g._member_index(src, "broadcast", "src")
    start = partial(comm.Ibcast, [buf, dt], root)
    return Call(start, buf.nbytes, None, result, code, buf.size, root)


def all_gather(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray, result: Result
) -> Call:
    code, dt = readable(send, "all_gather send")
    companion(send, recv, g.size() * send.size, "all_gather recv", write=True)
    start = partial(comm.Iallgather, [send, dt], [recv, dt])
    return Call(start, recv.nbytes, None, result, code, send.size)


def reduce_scatter(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray, op: OpArg, result: Result
) -> Call:
    code, dt = writable(recv, "reduce_scatter recv")
    companion(recv, send, g.size() * recv.size, "reduce_scatter send", write=False)
    rop = resolve_op(op, code)
    data, dt, finish = reduction_buffer(recv, dt, rop, g.size(), copy_in=False, write_back=True)
    source = send.astype(np.float32) if data is not recv else send
    start = partial(comm.Ireduce_scatter_block, [source, dt], [data, dt], rop.mpi_op)
    return Call(start, send.nbytes, finish, result, code, recv.size, -1, rop.code)


def gather(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray | None, dst: int
) -> Call:
    code, dt = readable(send, "gather send")
    root = g._member_index(dst, "gather", "dst")
    recv_spec = None
    if g.rank() == dst:
        companion(send, recv, g.size() * send.size, "gather recv", write=True)
        recv_spec = [recv, dt]
    start = partial(comm.Igather, [send, dt], recv_spec, root)
    return Call(start, send.nbytes * g.size(), dtype=code, count=send.size, root=root)


def scatter(
    g: MpiProcessGroup, comm: MPI.Intracomm, send: np.ndarray | None, recv: np.ndarray, src: int
) -> Call:
    code, dt = writable(recv, "scatter recv")
    root = g._member_index(src, "scatter", "src")
    send_spec = None
    if g.rank() == src:
        companion(recv, send, g.size() * recv.size, "scatter send", write=False)
        send_spec = [send, dt]
    start = partial(comm.Iscatter, send_spec, [recv, dt], root)
    return Call(start, recv.nbytes * g.size(), dtype=code, count=recv.size, root=root)


def reduce(g: MpiProcessGroup, comm: MPI.Intracomm, buf: np.ndarray, dst: int, op: OpArg) -> Call:
    code, dt = writable(buf, "reduce")
    root = g._member_index(dst, "reduce", "dst")
    rop = resolve_op(op, code)
    # MPI leaves non-root buffers untouched, and so do we.
    is_root = g.rank() == dst
    data, dt, finish = reduction_buffer(buf, dt, rop, g.size(), copy_in=True, write_back=is_root)
    send_spec, recv_spec = (MPI.IN_PLACE, [data, dt]) if is_root else ([data, dt], None)
    start = partial(comm.Ireduce, send_spec, recv_spec, rop.mpi_op, root)
    return Call(start, buf.nbytes, finish, None, code, buf.size, root, rop.code)


def barrier(comm: MPI.Intracomm) -> Call:
    return Call(comm.Ibarrier, 0)
