"""Object collectives over any process group (threads, shm, MPI), through the restricted codec
(`codec`): nothing is ever pickled or unpickled.

Each collective first all-gathers a small header from every member (its payload's length, or that its
object could not be encoded, its ``max_bytes`` and the root it was called with), then moves the bytes
with the group's ordinary collectives (padded to the longest payload). So every member decides alike:
an object one rank cannot encode, members that disagree on the root, or a payload over the smallest
``max_bytes`` of the group make every member raise before any payload moves (the failing rank its own
error, the others the same exception type naming it), and the group stays usable. Every member gets
the object(s) decoded from the bytes that travelled, its own included, so results are equal on every
rank. Ranks are global, as everywhere in the package.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axonml_distributed._types import ProcessGroupLike
from axonml_distributed.codec import DEFAULT_MAX_BYTES, decode, encode
from axonml_distributed.comm import _group
from axonml_distributed.exceptions import CollectiveMismatchError

# Header statuses below zero: why the rank has no payload (0 and above: its length).
_TYPE_ERROR, _VALUE_ERROR = -1, -2
_ERRORS: dict[int, type[Exception]] = {_TYPE_ERROR: TypeError, _VALUE_ERROR: ValueError}
_NO_ROOT = -1
_LEN = struct.Struct("<Q")  # the length in front of each scatter slot


class _Local:
    """This rank's part of a call: its payloads, or the error that stopped it from making them."""

    def __init__(self, max_bytes: object, make: Callable[[int], list[bytes]] | None) -> None:
        self.payloads: list[bytes] = []
        self.error: Exception | None = None
        self.max_bytes = 0
        try:
            if type(max_bytes) is not int:
                raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__}")
            if max_bytes <= 0:
                raise ValueError(f"max_bytes must be positive, got {max_bytes}")
            self.max_bytes = min(max_bytes, 2**62)  # travels as an int64
            if make is not None:
                self.payloads = make(self.max_bytes)
        except (TypeError, ValueError) as exc:
            self.error = exc

    def status(self) -> int:
        if isinstance(self.error, TypeError):
            return _TYPE_ERROR
        if self.error is not None:
            return _VALUE_ERROR
        return max((len(p) for p in self.payloads), default=0)


def _agree(g: ProcessGroupLike, call: str, local: _Local, root: Any = None) -> tuple[np.ndarray, int]:
    """Exchange headers; raise alike on every member unless the call can go on. Returns the payload
    lengths (by group index; 0 for members that send nothing) and the root's group index (-1: a call
    without a root, `root` None)."""
    if root is None:
        root = _NO_ROOT
    else:
        try:
            root = operator.index(root)
            if not 0 <= root < 2**62:
                raise ValueError(f"{call}: the root, rank {root}, is out of range")
        except TypeError:
            local.error = TypeError(f"{call}: the root must be a rank, got {type(root).__name__}")
            root = _NO_ROOT
        except ValueError as exc:
            local.error, root = exc, _NO_ROOT
    mine = np.array([local.status(), local.max_bytes, root], np.int64)
    table = np.asarray(g.all_gather_tensor(mine))
    n, ranks = g.size(), g.ranks()
    if table.shape != (n, 3) or (table[:, 0] < _VALUE_ERROR).any():
        raise ValueError(f"{call}: a member sent an unreadable header")
    for code, kind in _ERRORS.items():
        failed = [rank for rank, status in zip(ranks, table[:, 0].tolist(), strict=True) if status == code]
        if failed:
            if local.error is not None:
                raise local.error
            why = f"raised {kind.__name__} before sending (their own error says why)"
            raise kind(f"{call}: rank(s) {failed} {why}")
    roots = table[:, 2].tolist()
    if any(r != roots[0] for r in roots):
        called = ", ".join(f"rank {rank} with {r}" for rank, r in zip(ranks, roots, strict=True))
        raise CollectiveMismatchError(
            f"{call}: the members disagree on the root: {called}",
            ranks=[rank for rank, r in zip(ranks, roots, strict=True) if r != roots[0]],
            call=call,
            group=ranks,
        )
    if root != _NO_ROOT and root not in ranks:
        raise ValueError(f"{call}: the root, rank {root}, is not a member of the group {ranks}")
    limit = int(table[:, 1].min())
    for rank, size in zip(ranks, table[:, 0].tolist(), strict=True):
        if size > limit:
            raise ValueError(
                f"{call}: the payload of rank {rank} ({size} bytes) exceeds max_bytes={limit} of a member; "
                "pass a larger max_bytes on every rank"
            )
    return table[:, 0], _NO_ROOT if root == _NO_ROOT else ranks.index(root)


def _padded(payload: bytes, size: int) -> np.ndarray:
    out = np.zeros(size, np.uint8)
    out[: len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def _decode_slots(buf: np.ndarray, lengths: Sequence[int], width: int, max_bytes: int) -> list[Any]:
    slots = (buf[i * width : i * width + int(n)] for i, n in enumerate(lengths))
    return [decode(slot.data, max_bytes=max_bytes) for slot in slots]


def broadcast_object(
    obj: object, src: int = 0, group: ProcessGroupLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Any:
    """Global rank `src`'s `obj` on every member (`obj` is ignored elsewhere)."""
    call = "broadcast_object(obj, src, group)"
    g = _group(group, call)
    is_src = g.rank() == src
    local = _Local(max_bytes, (lambda limit: [encode(obj, max_bytes=limit)]) if is_src else None)
    lengths, index = _agree(g, call, local, src)
    size = int(lengths[index])
    buf = np.frombuffer(local.payloads[0], np.uint8).copy() if is_src else np.empty(size, np.uint8)
    g.broadcast(buf, src)
    return decode(buf.data, max_bytes=local.max_bytes)


def all_gather_object(
    obj: object, group: ProcessGroupLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[Any]:
    """Every member's `obj`, in group order."""
    call = "all_gather_object(obj, group)"
    g = _group(group, call)
    local = _Local(max_bytes, lambda limit: [encode(obj, max_bytes=limit)])
    lengths, _ = _agree(g, call, local)
    width = int(lengths.max())
    recv = np.empty(g.size() * width, np.uint8)
    g.all_gather(_padded(local.payloads[0], width), recv)
    return _decode_slots(recv, lengths.tolist(), width, local.max_bytes)


def gather_object(
    obj: object, dst: int = 0, group: ProcessGroupLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[Any] | None:
    """Every member's `obj`, in group order, on global rank `dst`; None elsewhere."""
    call = "gather_object(obj, dst, group)"
    g = _group(group, call)
    local = _Local(max_bytes, lambda limit: [encode(obj, max_bytes=limit)])
    lengths, _ = _agree(g, call, local, dst)
    width = int(lengths.max())
    recv = np.empty(g.size() * width, np.uint8) if g.rank() == dst else None
    g.gather(_padded(local.payloads[0], width), recv, dst)
    return None if recv is None else _decode_slots(recv, lengths.tolist(), width, local.max_bytes)


def scatter_object(
    objs: Sequence[object] | None,
    src: int = 0,
    group: ProcessGroupLike | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Any:
    """The i-th of global rank `src`'s `objs` (one per member, in group order) on the i-th member
    (`objs` is ignored elsewhere)."""
    call = "scatter_object(objs, src, group)"
    g = _group(group, call)
    n, is_src = g.size(), g.rank() == src

    def make(limit: int) -> list[bytes]:
        if not isinstance(objs, list | tuple) or len(objs) != n:
            got = f"{len(objs)} objects" if isinstance(objs, list | tuple) else type(objs).__name__
            raise ValueError(
                f"{call}: objs on the source must be a list of {n} objects (one per member), not {got}"
            )
        return [encode(o, max_bytes=limit) for o in objs]

    local = _Local(max_bytes, make if is_src else None)
    lengths, index = _agree(g, call, local, src)
    width = _LEN.size + int(lengths[index])
    send = None
    if is_src:
        slots = [_padded(_LEN.pack(len(p)) + p, width) for p in local.payloads]
        send = np.concatenate(slots) if slots else np.empty(0, np.uint8)
    recv = np.empty(width, np.uint8)
    g.scatter(send, recv, src)
    (size,) = _LEN.unpack(recv[: _LEN.size].tobytes())
    if size > width - _LEN.size:
        raise ValueError(f"{call}: the source sent a slot of {size} bytes in {width - _LEN.size}")
    return decode(recv[_LEN.size : _LEN.size + size].data, max_bytes=local.max_bytes)


def send_object(
    obj: object,
    dst: int,
    group: ProcessGroupLike | None = None,
    tag: int = 0,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> None:
    """Send `obj` to global rank `dst` (matched by `recv_object` with the same source and tag). An
    object that cannot be encoded raises here and in the receiver's `recv_object`."""
    g = _group(group, "send_object(obj, dst, group, tag)")
    local = _Local(max_bytes, lambda limit: [encode(obj, max_bytes=limit)])
    g.send(np.array([local.status()], np.int64), dst, tag)
    if local.error is not None:
        raise local.error
    g.send(np.frombuffer(local.payloads[0], np.uint8), dst, tag)


def recv_object(
    src: int, group: ProcessGroupLike | None = None, tag: int = 0, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Any:
    """The object global rank `src` sent with `send_object` and `tag`. A payload over `max_bytes` is
    refused before it is received: the sender is then stuck mid-message, so the world is aborted."""
    call = "recv_object(src, group, tag)"
    g = _group(group, call)
    limit = _Local(max_bytes, None)
    if limit.error is not None:
        raise limit.error
    (status,) = g.recv_tensor((1,), np.int64, src, tag).tolist()
    if status in _ERRORS:
        raise _ERRORS[status](f"{call}: rank {src} could not encode its object (its own error says why)")
    if status < 0 or status > limit.max_bytes:
        reason = f"{call}: rank {src} sends {status} bytes, over max_bytes={limit.max_bytes}"
        backend: Any = g.backend()
        backend.abort(reason)
        raise ValueError(reason)
    return decode(g.recv_tensor((status,), np.uint8, src, tag).data, max_bytes=limit.max_bytes)
