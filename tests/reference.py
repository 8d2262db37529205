"""Independent numpy references for the collectives: reduce in rank order with numpy's own ufuncs, and
the deterministic inputs every rank can build for every other (so each computes the whole reference
itself). The one reference of the suite: the in-process, shared-memory and MPI tests all use it.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import numpy as np

import axonml_distributed as ad

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_]
FLOATS = [np.float16, np.float32, np.float64]
# The dtypes every world carries (MPI has no bool).
NUMBERS = [d for d in DTYPES if d is not np.bool_]
OP_NAMES = ["SUM", "PRODUCT", "MIN", "MAX", "AVERAGE"]
OPS = [getattr(ad.ReduceOp, name) for name in OP_NAMES]

_UFUNC = {
    ad.ReduceOp.BAND: np.bitwise_and,
    ad.ReduceOp.BOR: np.bitwise_or,
    ad.ReduceOp.BXOR: np.bitwise_xor,
    ad.ReduceOp.SUM: np.add,
    ad.ReduceOp.AVERAGE: np.add,
    ad.ReduceOp.PRODUCT: np.multiply,
    ad.ReduceOp.MIN: np.minimum,
    ad.ReduceOp.MAX: np.maximum,
}


def valid(op: Any, dtype: Any) -> bool:
    """AVERAGE is only defined for floating-point dtypes."""
    return op != ad.ReduceOp.AVERAGE or np.issubdtype(dtype, np.floating)


def _scaled(a: np.ndarray, factor: float, divisor: int = 1) -> np.ndarray:
    """`a` times a real factor (or divided by a count) in `a`'s precision; complex numbers part by
    part (as documented)."""
    if factor == 1.0 and divisor == 1:
        return a
    real = np.finfo(a.dtype).dtype.type
    out = np.array(a)  # an array even for a numpy scalar (what ufuncs make of 0-d arrays), in place below
    for part in (out.real, out.imag) if a.dtype.kind == "c" else (out,):
        if divisor != 1:
            part /= real(divisor)
        else:
            part *= real(factor)
    return out


def reduce_ref(arrays: Any, op: Any, pre: float = 1.0, post: float = 1.0) -> np.ndarray:
    """Reduce `arrays` (one per rank, or stacked on axis 0) in rank order with `op` (a ReduceOp or its
    name), each input times `pre` and the result (after AVERAGE's division) times `post`; float16 and
    bfloat16 accumulate in float32 and round once (as documented). numpy's ufuncs on bool are the
    documented bool ops: add and maximum are OR, multiply and minimum AND."""
    if isinstance(op, str):
        op = getattr(ad.ReduceOp, op)
    arrays = list(arrays)
    dtype = arrays[0].dtype
    half = np.dtype(dtype).name in ("float16", "bfloat16")
    work = [_scaled(a.astype(np.float32) if half else a, pre) for a in arrays]
    acc = work[0].copy()
    with np.errstate(all="ignore"):
        for a in work[1:]:
            acc = _UFUNC[op](acc, a)
        if op == ad.ReduceOp.AVERAGE:
            acc = _scaled(acc, 1.0, len(arrays))
        acc = _scaled(acc, post)
    return acc.astype(dtype)


def data(rank: int, n: int, dtype: Any, seed: int = 0) -> np.ndarray:
    """Rank `rank`'s deterministic input: small values so products stay finite in every dtype."""
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.issubdtype(dtype, np.floating):
        return rng.uniform(-2.0, 2.0, n).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 1, n, endpoint=True).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dtype)


def wide_values(rank: int, case: int, size: int, dtype: Any, op: str = "SUM") -> np.ndarray:
    """Inputs across each dtype's whole range (integer sums wrap), for worlds that reduce in rank order:
    normal floats, or near 1 for PRODUCT so products stay finite."""
    rng = np.random.default_rng(rank * 1_000_003 + case)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        x = rng.uniform(0.5, 1.5, size) if op == "PRODUCT" else rng.standard_normal(size) * 10
        return x.astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size, dtype=dt, endpoint=True)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def small_values(rank: int, case: str, shape: tuple[int, ...], dtype: Any, op: str = "SUM") -> np.ndarray:
    """Integer-valued inputs small enough that every op is exact in every dtype and any order of
    reduction: results can be compared bit for bit on backends that reduce in another order (MPI).
    PRODUCT draws from {1, 2} (and -1 when signed)."""
    rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
    if np.dtype(dtype).kind == "c":
        if op == "PRODUCT":
            return rng.choice(np.array([1, -1, 1j, -1j, 1 + 1j]), size=shape).astype(dtype)
        parts = rng.integers(-8, 9, size=(2, *shape))
        return (parts[0] + 1j * parts[1]).astype(dtype)
    if op == "PRODUCT":
        choices = [1, 2] if np.dtype(dtype).kind in "ub" else [-1, 1, 2]
        return rng.choice(choices, size=shape).astype(dtype)
    low = 0 if np.dtype(dtype).kind in "ub" else -8
    return rng.integers(low, 9, size=shape).astype(dtype)


def all_inputs(size: int, case: str, shape: tuple[int, ...], dtype: Any, op: str = "SUM") -> np.ndarray:
    """Every rank's `small_values`, stacked in rank order."""
    return np.stack([small_values(r, case, shape, dtype, op) for r in range(size)])


def digest(arr: Any) -> str:
    """A short fingerprint of an array's bytes, for comparing results across processes."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def expect_same(actual: Any, expected: Any, what: str) -> None:
    """`same_bits`, or an AssertionError saying what differs."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: got {actual.dtype}{actual.shape}, expected {expected.dtype}{expected.shape}"
        )
    if not same_bits(actual, expected):
        got, want = actual.ravel()[:16], expected.ravel()[:16]
        raise AssertionError(f"{what}: values differ\n got      {got}\n expected {want}")
