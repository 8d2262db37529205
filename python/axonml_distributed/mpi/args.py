"""Arguments of the MPI group's operations: the MPI datatype and op that carry each dtype and reduce op
(the arguments themselves are checked by the core, `ProcessGroup.call_check`, as on every backend), the
float32 staging that float16 and bfloat16 reductions need (MPI has no 16-bit float arithmetic), and
Horovod's scaling factors, applied around the MPI call as the core applies them in its kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import DTYPE_CODES, OP_CODES

try:
    from ml_dtypes import bfloat16
except ImportError:  # numpy arrays of bfloat16 need ml_dtypes
    bfloat16 = None

# The MPI datatype that carries each dtype this backend supports, by the core's name for it. MPI has no
# portable float16 or bfloat16 type: they travel as their 16-bit patterns (UINT16_T), which is exact for
# everything that only moves bytes; reductions widen them to float32 instead (see `reduction_buffer`),
# the core's own accumulation, rounded once. (bfloat16 comes as ml_dtypes' numpy arrays: torch's
# bfloat16 tensors have no numpy view.)
_CARRIERS = {
    "float16": MPI.UINT16_T,
    "bfloat16": MPI.UINT16_T,
    "int16": MPI.INT16_T,
    "uint16": MPI.UINT16_T,
    "uint32": MPI.UINT32_T,
    "uint64": MPI.UINT64_T,
    "complex64": MPI.C_FLOAT_COMPLEX,
    "complex128": MPI.C_DOUBLE_COMPLEX,
    "bool": MPI.C_BOOL,
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
CARRIED = frozenset(
    [np.dtype(name) for name in _CARRIERS if name != "bfloat16"] + ([] if bfloat16 is None else [bfloat16])
)
# The dtypes whose reductions run in a float32 copy, by code and as numpy dtypes (compared with a dtype
# rather than with np.float16, which numpy would convert on every comparison).
WIDENED_CODES = frozenset((DTYPE_CODES["float16"], DTYPE_CODES["bfloat16"]))
WIDENED = frozenset([np.dtype(np.float16)] + ([] if bfloat16 is None else [np.dtype(bfloat16)]))
BOOL_CODE = DTYPE_CODES["bool"]
# The core's name of each dtype and op code, for errors.
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_OP_NAMES = {code: name for name, code in OP_CODES.items()}

# The MPI op that performs each of the core's reduce ops (by name); AVERAGE is MPI SUM, then a division.
_MPI_OPS = {
    "SUM": MPI.SUM,
    "PRODUCT": MPI.PROD,
    "MIN": MPI.MIN,
    "MAX": MPI.MAX,
    "AVERAGE": MPI.SUM,
    "BAND": MPI.BAND,
    "BOR": MPI.BOR,
    "BXOR": MPI.BXOR,
}
# On bool, MPI's logical ops: SUM and MAX are OR, PRODUCT and MIN are AND (the core's rules).
_BOOL_OPS = {
    "SUM": MPI.LOR,
    "PRODUCT": MPI.LAND,
    "MIN": MPI.LAND,
    "MAX": MPI.LOR,
    "BAND": MPI.LAND,
    "BOR": MPI.LOR,
    "BXOR": MPI.LXOR,
}


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
# rounding, a receive's size check); None when there is nothing to do, the common case. What it returns,
# unless None, becomes the operation's result (a receive from any source returns its sender).
Finish = Callable[[MPI.Status], object] | None
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


# The core's op code -> how MPI performs it, on every dtype but bool, and on bool.
OP_TABLE = {
    OP_CODES[name]: Op(OP_CODES[name], mpi_op, name == "AVERAGE", mpi_op is MPI.SUM)
    for name, mpi_op in _MPI_OPS.items()
}
BOOL_OP_TABLE = {
    OP_CODES[name]: Op(OP_CODES[name], mpi_op, False, False) for name, mpi_op in _BOOL_OPS.items()
}


def mpi_op(code: int, dtype: int) -> Op:
    """How MPI performs the core's op `code` on the core's dtype `dtype` (a pair the core accepted)."""
    rop = (BOOL_OP_TABLE if dtype == BOOL_CODE else OP_TABLE).get(code)
    if rop is None:
        raise TypeError(f"the MPI backend cannot reduce {_DTYPE_NAMES[dtype]} with {_OP_NAMES[code]}")
    return rop


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def parts(a: np.ndarray) -> np.ndarray:
    """`a`'s real numbers: a complex array's real and imaginary parts (a zero-copy view), so that scaling
    multiplies each part by the real factor, as the core does, never as a complex product."""
    return a.view(np.float32 if a.dtype == np.complex64 else np.float64) if a.dtype.kind == "c" else a


def prescale(buf: np.ndarray, source: np.ndarray, pre: float) -> None:
    """`buf` = `source` times the prescale factor `pre`, in `buf`'s own precision, as the core's kernel
    does (`source` may be `buf`)."""
    real = parts(buf)
    np.multiply(parts(source), real.dtype.type(pre), out=real)


def finish_result(buf: np.ndarray, average: int, post: float) -> None:
    """AVERAGE's division by `average` (0: not AVERAGE), then the postscale factor, in `buf`'s own
    precision, as the core's kernel does."""
    real = parts(buf)
    if average:
        np.divide(real, average, out=real)
    if post != 1.0:
        np.multiply(real, real.dtype.type(post), out=real)


def reduction_buffer(
    buf: np.ndarray,
    dt: MPI.Datatype,
    rop: Op,
    size: int,
    copy_in: bool,
    write_back: bool,
    send: np.ndarray | None = None,
    pre: float = 1.0,
    post: float = 1.0,
) -> tuple[np.ndarray, MPI.Datatype, Callable[[], None] | None, Finish]:
    """The array MPI reduces into, the step that fills it with the (prescaled) input once the signatures
    agree (then MPI reduces it in place; None: MPI reads `send`, or `buf` itself when `send` is None) and
    the step that divides for AVERAGE, postscales and writes the result to `buf` (None when MPI's result
    needs nothing more). `dt` is `buf`'s transport datatype; `send` is the input when it is not `buf`
    (out=)."""
    source = buf if send is None else send
    average = size if rop.average else 0
    # MPI has no 16-bit float arithmetic: widen to float32, reduce, round once at the end.
    if buf.dtype in WIDENED:
        wide = np.empty(buf.shape, np.float32)

        def widen() -> None:
            np.copyto(wide, source)
            if pre != 1.0:
                np.multiply(wide, np.float32(pre), out=wide)

        def narrow(_status: MPI.Status) -> None:
            if write_back:
                finish_result(wide, average, post)
                np.copyto(buf, wide)  # the only rounding to 16 bits

        return wide, MPI.FLOAT, widen if copy_in else None, narrow
    prepare = None
    if copy_in and pre != 1.0:

        def prepare() -> None:
            prescale(buf, source, pre)

    if not write_back or (not average and post == 1.0):
        return buf, dt, prepare, None

    def scale(_status: MPI.Status) -> None:
        finish_result(buf, average, post)

    return buf, dt, prepare, scale
