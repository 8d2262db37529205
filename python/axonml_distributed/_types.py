"""The process-group interface every backend's group offers: the native `ProcessGroup` (threads, shm) and
`MpiProcessGroup`. DDP, the sampler and the comm helpers are written against it, so any group with these
methods works, duck-typed; mypy checks that both groups conform (tests/test_types.py).

Parameters are positional-only here: the groups name some of them differently (``group_rank(rank)`` and
``group_rank(global_rank)``), and callers pass them by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from axonml_distributed._core import ReduceOp

# A buffer as every group takes it: a numpy array, or a CPU torch tensor (used through its memory).
Buf = Any
# A reduce op as every group accepts it: a ReduceOp, None (SUM), or a name such as "sum" or "mean".
OpArg = ReduceOp | str | None


class WorkLike(Protocol):
    """The handle of an operation issued with ``async_op=True``."""

    def wait(self) -> Any: ...
    def is_completed(self) -> bool: ...


class ProcessGroupLike(Protocol):
    """A group of ranks as seen from this rank. Ranks are global; in-place operations return None, or
    their handle with ``async_op=True``; the ``*_tensor`` ones return their result (or its handle)."""

    def backend(self) -> object: ...
    def rank(self) -> int: ...
    def world_size(self) -> int: ...
    def size(self) -> int: ...
    def ranks(self) -> list[int]: ...
    def contains(self, rank: int, /) -> bool: ...
    def group_rank(self, rank: int, /) -> int: ...
    def new_group(self, ranks: Sequence[int], /) -> ProcessGroupLike: ...
    def empty(self, shape: int | Sequence[int], dtype: npt.DTypeLike, /) -> np.ndarray: ...

    def all_reduce(
        self,
        buf: Buf,
        op: OpArg = ...,
        /,
        *,
        out: Buf | None = ...,
        prescale_factor: float = ...,
        postscale_factor: float = ...,
        async_op: bool = ...,
    ) -> WorkLike | None: ...
    def broadcast(self, buf: Buf, src: int | None = ..., /, *, async_op: bool = ...) -> WorkLike | None: ...
    def all_gather(self, send: Buf, recv: Buf, /, *, async_op: bool = ...) -> WorkLike | None: ...
    def reduce_scatter(
        self, send: Buf, recv: Buf, op: OpArg = ..., /, *, async_op: bool = ...
    ) -> WorkLike | None: ...
    def gather(
        self, send: Buf, recv: Buf | None, dst: int, /, *, async_op: bool = ...
    ) -> WorkLike | None: ...
    def scatter(
        self, send: Buf | None, recv: Buf, src: int, /, *, async_op: bool = ...
    ) -> WorkLike | None: ...
    def reduce(
        self,
        buf: Buf,
        dst: int,
        op: OpArg = ...,
        /,
        *,
        out: Buf | None = ...,
        prescale_factor: float = ...,
        postscale_factor: float = ...,
        async_op: bool = ...,
    ) -> WorkLike | None: ...
    def barrier(self, *, async_op: bool = ...) -> WorkLike | None: ...
    def monitored_barrier(
        self, timeout: float | timedelta | None = ..., wait_all_ranks: bool = ..., /
    ) -> None: ...
    def send(self, buf: Buf, dst: int, tag: int = ..., /, *, async_op: bool = ...) -> WorkLike | None: ...
    def recv(self, buf: Buf, src: int, tag: int = ..., /, *, async_op: bool = ...) -> WorkLike | None: ...

    def all_reduce_tensor(
        self,
        t: Buf,
        op: OpArg = ...,
        /,
        *,
        out: Buf | None = ...,
        prescale_factor: float = ...,
        postscale_factor: float = ...,
        async_op: bool = ...,
    ) -> Any: ...
    def broadcast_tensor(self, t: Buf, src: int | None = ..., /, *, async_op: bool = ...) -> Any: ...
    def all_gather_tensor(self, t: Buf, /, *, out: Buf | None = ..., async_op: bool = ...) -> Any: ...
    def reduce_scatter_tensor(
        self, t: Buf, op: OpArg = ..., /, *, out: Buf | None = ..., async_op: bool = ...
    ) -> Any: ...
    def send_tensor(
        self, t: Buf, dst: int, tag: int = ..., /, *, async_op: bool = ...
    ) -> WorkLike | None: ...
    def recv_tensor(
        self,
        shape: int | Sequence[int],
        dtype: npt.DTypeLike,
        src: int,
        tag: int = ...,
        /,
        *,
        async_op: bool = ...,
    ) -> Any: ...
