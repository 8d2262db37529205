"""Arguments of the MPI group's operations: the MPI datatype and op that carry each dtype and reduce
op, buffer checks, and the float32 staging that float16 reductions need (MPI has no float16 arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from axonml_distributed._core import ReduceOp
from axonml_distributed._types import OpArg
from axonml_distributed.tensors import is_tensor

# numpy dtype -> (code used in call signatures, MPI datatype that carries it).
# MPI has no portable float16 type: float16 travels as its 16-bit pattern (UINT16_T), which is exact
# for everything that only moves bytes; reductions widen it to float32 instead (see `reduction_buffer`).
DTYPES: dict[np.dtype, tuple[int, MPI.Datatype]] = {
    np.dtype(np.float16): (1, MPI.UINT16_T),
    np.dtype(np.float32): (2, MPI.FLOAT),
    np.dtype(np.float64): (3, MPI.DOUBLE),
    np.dtype(np.int8): (4, MPI.INT8_T),
    np.dtype(np.uint8): (5, MPI.UINT8_T),
    np.dtype(np.int32): (6, MPI.INT32_T),
    np.dtype(np.int64): (7, MPI.INT64_T),
}
DTYPE_NAMES = {code: dt.name for dt, (code, _) in DTYPES.items()}
# Compared with a dtype rather than with np.float16, which numpy would convert on every comparison.
FLOAT16 = np.dtype(np.float16)
FLOAT16_CODE = DTYPES[FLOAT16][0]

# (member, MPI op); an op's code in call signatures is its position + 1. ReduceOp members are compared
# with ==, not hashed: the native enum is not hashable. AVERAGE is MPI SUM, then a division.
OPS: tuple[tuple[ReduceOp, MPI.Op], ...] = (
    (ReduceOp.SUM, MPI.SUM),
    (ReduceOp.PRODUCT, MPI.PROD),
    (ReduceOp.MIN, MPI.MIN),
    (ReduceOp.MAX, MPI.MAX),
    (ReduceOp.AVERAGE, MPI.SUM),
)
# Names as the native enum spells its members ("ReduceOp.SUM" -> "SUM"), for messages.
OP_NAMES = {code: repr(member).rpartition(".")[2] for code, (member, _) in enumerate(OPS, 1)}
SUM_CODE = 1
AVERAGE_CODE = len(OPS)
# Names accepted in place of a member, case-insensitive, as by the native groups: the enum's own
# attributes (AVG is torch's name for AVERAGE), and "MEAN", which only the native parser knows.
OP_BY_NAME = {
    **{name: getattr(ReduceOp, name) for name in dir(ReduceOp) if name.isupper()},
    "MEAN": ReduceOp.AVERAGE,
}

KIND_NAMES = {
    1: "all_reduce",
    2: "broadcast",
    3: "all_gather",
    4: "reduce_scatter",
    5: "gather",
    6: "scatter",
    7: "reduce",
    8: "barrier",
}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}


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


# Built once: resolving an op is on every reduction's path.
OP_TABLE = tuple(
    Op(code, mpi_op, code == AVERAGE_CODE, mpi_op is MPI.SUM) for code, (_, mpi_op) in enumerate(OPS, 1)
)


def resolve_op(op: OpArg, dtype: np.dtype, what: str) -> Op:
    code = _op_code(op, what)
    if code == AVERAGE_CODE and dtype.kind != "f":
        # An integer mean would have to truncate; the native backends refuse it too.
        raise TypeError(f"{what}: AVERAGE needs a floating dtype, got {dtype}; use SUM and divide")
    return OP_TABLE[code - 1]


def _op_code(op: OpArg, what: str) -> int:
    if op is None:
        return SUM_CODE
    if isinstance(op, str):
        member = OP_BY_NAME.get(op.upper())
        if member is None:
            raise ValueError(f'{what}: unknown reduce op "{op}"; use a ReduceOp member')
        op = member
    for code, (member, _) in enumerate(OPS, 1):
        # The class attributes are singletons: `is` settles the usual case without a native __eq__.
        if op is member or op == member:
            return code
    raise TypeError(f"{what}: op must be a ReduceOp, got {type(op).__name__}")


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
