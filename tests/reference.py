"""Independent numpy references for the collectives: reduce in rank order with numpy's own ufuncs."""

from __future__ import annotations

from typing import Any

import numpy as np

import axonml_distributed as ad

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_]
FLOATS = [np.float16, np.float32, np.float64]
OPS = [ad.ReduceOp.SUM, ad.ReduceOp.PRODUCT, ad.ReduceOp.MIN, ad.ReduceOp.MAX, ad.ReduceOp.AVERAGE]

_UFUNC = {
    ad.ReduceOp.SUM: np.add,
    ad.ReduceOp.AVERAGE: np.add,
    ad.ReduceOp.PRODUCT: np.multiply,
    ad.ReduceOp.MIN: np.minimum,
    ad.ReduceOp.MAX: np.maximum,
}


def valid(op: Any, dtype: Any) -> bool:
    """AVERAGE is only defined for floating-point dtypes."""
    return op != ad.ReduceOp.AVERAGE or np.issubdtype(dtype, np.floating)


def reduce_ref(arrays: list[np.ndarray], op: Any) -> np.ndarray:
    """Reduce in rank order; float16 accumulates in float32 and rounds once (as documented). numpy's
    ufuncs on bool are the documented bool ops: add and maximum are OR, multiply and minimum AND."""
    dtype = arrays[0].dtype
    work = [a.astype(np.float32) for a in arrays] if dtype == np.float16 else arrays
    acc = work[0].copy()
    with np.errstate(all="ignore"):
        for a in work[1:]:
            acc = _UFUNC[op](acc, a)
        if op == ad.ReduceOp.AVERAGE:
            acc = acc / acc.dtype.type(len(arrays))
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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
