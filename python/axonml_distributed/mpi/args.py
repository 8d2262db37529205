"""Arguments of the MPI group's operations: the MPI datatype and op that carry each dtype and reduce op
(the arguments themselves are checked by the core, `CallCheck`, as on every backend), and the float32
staging that float16 reductions need (MPI has no float16 arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import DTYPE_CODES, OP_CODES

# The MPI datatype that carries each dtype this backend supports, by the core's name for it. MPI has no
# portable float16 type: float16 travels as its 16-bit pattern (UINT16_T), which is exact for everything
# that only moves bytes; reductions widen it to float32 instead (see `reduction_buffer`). bfloat16 and
# bool have no numpy buffer MPI could reduce.
_CARRIERS = {
    "float16": MPI.UINT16_T,
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
    "int8": MPI.INT8_T,
    "uint8": MPI.UINT8_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
}
# The core's dtype code -> the MPI datatype that carries it: looked up on every call.
CARRIERS: dict[int, MPI.Datatype] = {DTYPE_CODES[name]: carrier for name, carrier in _CARRIERS.items()}
# numpy's dtypes this backend carries (for `empty`, which makes no call).
CARRIED = frozenset(np.dtype(name) for name in _CARRIERS)
FLOAT16_CODE = DTYPE_CODES["float16"]
# Compared with a dtype rather than with np.float16, which numpy would convert on every comparison.
FLOAT16 = np.dtype(np.float16)
# The core's name of each dtype and op code, for errors.
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_OP_NAMES = {code: name for name, code in OP_CODES.items()}

# The MPI op that performs each of the core's reduce ops (by name); AVERAGE is MPI SUM, then a division.
_MPI_OPS = {"SUM": MPI.SUM, "PRODUCT": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX, "AVERAGE": MPI.SUM}


def carrier(code: int) -> MPI.Datatype:
    """The MPI datatype of the core's dtype `code` (one the core accepted); TypeError for the dtypes
    the core takes but MPI cannot carry."""
    dt = CARRIERS.get(code)
    if dt is None:
        raise TypeError(f"the MPI backend cannot carry {_DTYPE_NAMES[code]} buffers")
    return dt


def checkable(arr: Any) -> Any:
    """What the core checks for `arr`: itself, or for a buffer not aligned for its dtype (which MPI
    moves, the native worlds refuse) an aligned stand-in of the same shape, dtype and flags."""
    if isinstance(arr, np.ndarray) and not arr.flags.aligned and arr.flags.c_contiguous:
        stand_in = np.empty(arr.shape, arr.dtype)
        stand_in.flags.writeable = arr.flags.writeable
        return stand_in
    return arr


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


def mpi_op(code: int) -> Op:
    """How MPI performs the core's op `code` (one the core accepted for the call's dtype)."""
    rop = OP_TABLE.get(code)
    if rop is None:
        raise TypeError(f"the MPI backend cannot reduce with {_OP_NAMES[code]}")
    return rop


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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
