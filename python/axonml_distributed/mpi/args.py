"""Arguments of the MPI group's operations: the MPI datatype and op that carry each dtype and reduce
op, buffer checks, and the float32 staging that float16 reductions need (MPI has no float16 arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import DTYPE_CODES, OP_CODES, ReduceOp, check_op
from axonml_distributed._types import OpArg
from axonml_distributed.tensors import is_tensor

# The MPI datatype that carries each dtype this backend supports, by the core's name for it (its code in
# call signatures is the core's, `DTYPE_CODES`). MPI has no portable float16 type: float16 travels as its
# 16-bit pattern (UINT16_T), which is exact for everything that only moves bytes; reductions widen it to
# float32 instead (see `reduction_buffer`). bfloat16 and bool have no numpy buffer MPI could reduce.
_CARRIERS = {
    "float16": MPI.UINT16_T,
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
    "int8": MPI.INT8_T,
    "uint8": MPI.UINT8_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
}
# numpy dtype -> (the core's code, the MPI datatype that carries it): looked up on every call.
DTYPES: dict[np.dtype, tuple[int, MPI.Datatype]] = {
    np.dtype(name): (DTYPE_CODES[name], carrier) for name, carrier in _CARRIERS.items()
}
# Compared with a dtype rather than with np.float16, which numpy would convert on every comparison.
FLOAT16 = np.dtype(np.float16)
FLOAT16_CODE = DTYPES[FLOAT16][0]

# The MPI op that performs each of the core's reduce ops (by name); AVERAGE is MPI SUM, then a division.
_MPI_OPS = {"SUM": MPI.SUM, "PRODUCT": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX, "AVERAGE": MPI.SUM}


def transport_dtype(arr: np.ndarray, what: str) -> tuple[int, MPI.Datatype]:
    """The signature code of `arr`'s dtype and the MPI datatype that carries its elements; TypeError for
    dtypes the native backends do not support."""
    entry = DTYPES.get(arr.dtype)
    if entry is None:
        supported = ", ".join(dt.name for dt in DTYPES)
        raise TypeError(f"{what}: unsupported dtype {arr.dtype}; supported: {supported}")
    return entry


# What an operation returns: None for in-place ones, for the *_tensor ones the new array (a torch tensor
# over it when the caller passed a tensor).
Result = Any
# Post-processing once the MPI request completed, given its status (AVERAGE's division, float16's
# rounding, a receive's size check); None when there is nothing to do, the common case.
Finish = Callable[[MPI.Status], None] | None
# Builds an operation's description for error messages; called only when one is raised, so the
# common path never formats strings.
Describe = Callable[[], str]


@dataclass(frozen=True)
class Op:
    code: int
    mpi_op: MPI.Op
    average: bool
    # SUM or AVERAGE (an MPI SUM): a small all_reduce with this op can ride along with the check.
    sums: bool


# The core's op code -> how MPI performs it.
OP_TABLE = {
    OP_CODES[name]: Op(OP_CODES[name], mpi_op, name == "AVERAGE", mpi_op is MPI.SUM)
    for name, mpi_op in _MPI_OPS.items()
}
# The core's name of each dtype code, for asking the core about a dtype by its code.
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
# (type, op, dtype code) -> Op: the core's answer for each combination a program uses, remembered because
# resolving an op is on every reduction's path (the type keeps 1 apart from ReduceOp.SUM, equal to it).
_RESOLVED: dict[tuple[type, object, int], Op] = {}
_RESOLVED_MAX = 1024


def resolve_op(op: OpArg, dtype: int) -> Op:
    """How MPI performs `op` (None: SUM) on the dtype of code `dtype`, once the core's rule allows it
    (`check_op`: AVERAGE of integers is refused, names are read as the native groups read them); else the
    core's error."""
    key = (type(op), op, dtype)
    try:
        return _RESOLVED[key]
    except (KeyError, TypeError):  # TypeError: an unhashable op, which the core refuses below
        pass
    code = check_op(ReduceOp.SUM if op is None else op, _DTYPE_NAMES[dtype])
    rop = OP_TABLE.get(code)
    if rop is None:
        name = next(name for name, known in OP_CODES.items() if known == code)
        raise TypeError(f"the MPI backend cannot reduce with {name}")
    if len(_RESOLVED) < _RESOLVED_MAX:
        _RESOLVED[key] = rop
    return rop


# --- arguments ---------------------------------------------------------------------------------------


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def readable(arr: object, what: str, write: bool = False) -> tuple[int, MPI.Datatype]:
    """Validate an array MPI reads (and writes, with `write`); returns its `transport_dtype`."""
    if not isinstance(arr, np.ndarray):
        got = f"a tensor on {arr.device}" if is_tensor(arr) else type(arr).__name__  # type: ignore[attr-defined]
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, got {got}")
    entry = DTYPES.get(arr.dtype) or transport_dtype(arr, what)  # the call raises the error
    flags = arr.flags  # a new object on every access
    if not flags.c_contiguous:
        raise ValueError(f"{what}: the array must be C-contiguous (pass np.ascontiguousarray(a))")
    if write and not flags.writeable:
        raise ValueError(f"{what}: the array is read-only")
    return entry


def writable(arr: object, what: str) -> tuple[int, MPI.Datatype]:
    """Validate an array MPI writes; returns its `transport_dtype`."""
    return readable(arr, what, write=True)


def companion(ref: np.ndarray, other: object, size: int, what: str, write: bool) -> None:
    """The second buffer of a collective: valid itself, with `ref`'s dtype and `size` elements."""
    (writable if write else readable)(other, what)
    assert isinstance(other, np.ndarray)
    if other.dtype != ref.dtype:
        raise ValueError(f"{what}: dtype {other.dtype} differs from {ref.dtype}")
    if other.size != size:
        raise ValueError(f"{what}: {other.size} elements, expected {size} (group size x chunk size)")


def reduction_buffer(
    buf: np.ndarray, dt: MPI.Datatype, rop: Op, size: int, copy_in: bool, write_back: bool
) -> tuple[np.ndarray, MPI.Datatype, Finish]:
    """The array MPI reduces into (float16 is widened to a float32 copy) and the step that divides for
    AVERAGE and writes the result back to `buf` (None when MPI's result needs nothing more). `dt` is
    `buf`'s transport datatype."""
    # MPI has no float16 arithmetic: widen to float32, reduce, and round to float16 once at the end.
    if buf.dtype == FLOAT16:
        wide = buf.astype(np.float32) if copy_in else np.empty(buf.shape, np.float32)

        def narrow(_status: MPI.Status) -> None:
            if write_back:
                if rop.average:
                    np.divide(wide, size, out=wide)
                np.copyto(buf, wide)  # the only rounding to float16

        return wide, MPI.FLOAT, narrow
    if not (write_back and rop.average):
        return buf, dt, None

    def scale(_status: MPI.Status) -> None:
        np.divide(buf, size, out=buf)

    return buf, dt, scale
