"""Shared by the scripts that the MPI tests run under `mpiexec ... python -m mpi4py` (see tests/mpi_run.py,
which puts tests/ on their path: the numpy reference and the conformance checks come from there).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def identical_on_all_ranks(arr: np.ndarray, what: str) -> None:
    """Compare raw bytes across COMM_WORLD through mpi4py's own pickle path (not the code under test)."""
    every = MPI.COMM_WORLD.allgather(np.ascontiguousarray(arr).tobytes())
    if any(b != every[0] for b in every):
        raise AssertionError(f"{what}: results differ between ranks")
