"""The exception hierarchy. Every collective failure is a `DistributedError` (a RuntimeError):

- `CollectiveMismatchError`: ranks called different collectives (kind, shape, dtype, op or root);
  no buffer was changed.
- `CollectiveTimeoutError`: some ranks never arrived; the message names them.
- `PeerFailureError`: a peer died, or the world was aborted (by a failing rank, a timeout or a
  mismatch elsewhere); the message names the rank.
- `SpawnError`: a rank's function raised under `spawn`; the original exception is chained.

Bad arguments raise `TypeError` (dtype) or `ValueError` (layout, ranks, sizes).

The facts a message tells are attributes too, so a program need not parse the text: `rank` (the rank
that raised it), `ranks` (the ranks it is about: those that never arrived, the dead or aborting peer,
those whose call differs), `call` (the call, as the message names it), `seq` (that call's sequence
number in its group: 1 for the group's first collective), `group` (the group's global ranks), `progress`
(where each rank of the group was, as the message ends: "where each rank is: rank 0 completed #2 barrier
and waits in #3 all_reduce, ..."), and per class `calls`, `waited`, `pid`, `exit_code`, `signal`. A fact
the error does not know is None (`ranks`: empty). The native worlds set them in one place
(`rust/bindings/exceptions.rs`, from the core's error); the MPI backend sets the ones it knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class DistributedError(RuntimeError):
    """Base of every collective failure."""

    def __init__(
        self,
        message: str = "",
        *,
        rank: int | None = None,
        ranks: Iterable[int] = (),
        call: str | None = None,
        seq: int | None = None,
        group: Iterable[int] | None = None,
        progress: str | None = None,
    ) -> None:
        super().__init__(message)
        self.progress = progress
        self.rank = rank
        self.ranks = tuple(ranks)
        self.call = call
        self.seq = seq
        self.group = None if group is None else tuple(group)


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives (kind, shape, dtype, op or root). No buffer was changed.

    `ranks`: the members whose call differs from the group's first member's (and those that entered no
    call), as the message names them after "but"; `calls`: every member's call that entered one, by
    global rank."""

    def __init__(self, message: str = "", *, calls: Mapping[int, str] | None = None, **facts: Any) -> None:
        super().__init__(message, **facts)
        self.calls = dict(calls or {})


class CollectiveTimeoutError(DistributedError):
    """Some ranks never arrived before the timeout; the message names them (`ranks`). The world is
    aborted. `waited`: the timeout, in seconds."""

    def __init__(self, message: str = "", *, waited: float | None = None, **facts: Any) -> None:
        super().__init__(message, **facts)
        self.waited = waited


class PeerFailureError(DistributedError):
    """A peer died (the message gives its pid and exit code or signal, or why that is unknown), or the
    world was aborted (by a failing rank, a timeout or a mismatch elsewhere). `ranks`: the dead peer, or
    the rank that aborted the world; `pid`, `exit_code`, `signal`: the dead peer's process, its exit
    code or the signal that killed it, where this rank learnt them."""

    def __init__(
        self,
        message: str = "",
        *,
        pid: int | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        **facts: Any,
    ) -> None:
        super().__init__(message, **facts)
        self.pid = pid
        self.exit_code = exit_code
        self.signal = signal


class SpawnError(DistributedError):
    """A rank's function raised under `spawn`; `rank` names it and `__cause__` is the original error."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message, rank=rank)


__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "PeerFailureError",
    "SpawnError",
]
