"""The exception hierarchy. Every collective failure is a `DistributedError` (a RuntimeError):

- `CollectiveMismatchError`: ranks called different collectives (kind, shape, dtype, op or root);
  no buffer was changed.
- `CollectiveTimeoutError`: some ranks never arrived; the message names them.
- `PeerFailureError`: a peer died, or the world was aborted (by a failing rank, a timeout or a
  mismatch elsewhere); the message names the rank.
- `SpawnError`: a rank's function raised under `spawn`; the original exception is chained.

Bad arguments raise `TypeError` (dtype) or `ValueError` (layout, ranks, sizes).
"""

from axonml_distributed._core import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    PeerFailureError,
)


class SpawnError(DistributedError):
    """A rank's function raised under `spawn`; `rank` names it and `__cause__` is the original error."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedError",
    "PeerFailureError",
    "SpawnError",
]
