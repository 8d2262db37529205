"""Shared by the scripts that tests/test_mpi.py runs under `mpiexec ... python -m mpi4py`.

Every rank can build every rank's input (seeded by rank and case), so each rank computes the numpy
reference for the whole collective on its own, independently of the MPI path under test.
"""

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from axonml_distributed import ReduceOp
from axonml_distributed.mpi import MpiWork

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]
FLOATS = [np.float16, np.float32, np.float64]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVERAGE"]

# numpy reductions over the stacked inputs of all ranks (axis 0), in the input dtype.
REFERENCE = {
    "SUM": lambda stack: np.add.reduce(stack, axis=0, dtype=stack.dtype),
    "PRODUCT": lambda stack: np.multiply.reduce(stack, axis=0, dtype=stack.dtype),
    "MIN": lambda stack: np.minimum.reduce(stack, axis=0),
    "MAX": lambda stack: np.maximum.reduce(stack, axis=0),
    "AVERAGE": lambda stack: (stack.astype(np.float64).sum(axis=0) / len(stack)).astype(stack.dtype),
}


def reduce_op(name: str) -> ReduceOp:
    op: ReduceOp = getattr(ReduceOp, name)
    return op


def small_values(rank: int, case: str, shape: tuple[int, ...], dtype: type, op: str = "SUM") -> np.ndarray:
    """Integer-valued inputs small enough that every op is exact in every dtype and any order of
    reduction: results can be compared bit for bit. PRODUCT draws from {1, 2} (and -1 when signed)."""
    rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
    if op == "PRODUCT":
        choices = [1, 2] if np.dtype(dtype).kind == "u" else [-1, 1, 2]
        return rng.choice(choices, size=shape).astype(dtype)
    low = 0 if np.dtype(dtype).kind == "u" else -8
    return rng.integers(low, 9, size=shape).astype(dtype)


def all_inputs(size: int, case: str, shape: tuple[int, ...], dtype: type, op: str = "SUM") -> np.ndarray:
    return np.stack([small_values(r, case, shape, dtype, op) for r in range(size)])


def same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: got {actual.dtype}{actual.shape}, expected {expected.dtype}{expected.shape}"
        )
    if actual.tobytes() != expected.tobytes():
        got, want = actual.ravel()[:16], expected.ravel()[:16]
        raise AssertionError(f"{what}: values differ\n got      {got}\n expected {want}")


def identical_on_all_ranks(arr: np.ndarray, what: str) -> None:
    """Compare raw bytes across COMM_WORLD through mpi4py's own pickle path (not the code under test)."""
    every = MPI.COMM_WORLD.allgather(np.ascontiguousarray(arr).tobytes())
    if any(b != every[0] for b in every):
        raise AssertionError(f"{what}: results differ between ranks")


def raises(exc_type: type[BaseException], fn: object, *args: object, match: str = "") -> str:
    """Run fn and require exc_type whose message contains `match`; return the message."""
    try:
        fn(*args)  # type: ignore[operator]
    except exc_type as exc:
        if match not in str(exc):
            raise AssertionError(f"{exc_type.__name__} without {match!r}: {exc}") from exc
        return str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def started(work: MpiWork | None) -> MpiWork:
    """The work of an operation issued with async_op=True."""
    assert work is not None
    return work
