"""Reduce ops a dtype does not support (MIN/MAX on complex, the bitwise ops on floating point), passed
alike on every rank, to every reducing collective of the MPI group: each raises TypeError on every rank,
moves nothing (every buffer as it was), and the group stays usable (the next collective gives the numpy
reference); with the signature check on and off. Rank 0 prints "unsupported ok"."""

from __future__ import annotations

import numpy as np

from axonml_distributed import ReduceOp
from axonml_distributed.mpi import MpiProcessGroup, init_mpi_process_group
from conformance import raises
from reference import all_inputs, expect_same, reduce_ref

FLOATING = ["float16", "float32", "float64", "complex64", "complex128"]
UNSUPPORTED = [(op, dtype) for op in ("BAND", "BOR", "BXOR") for dtype in FLOATING] + [
    (op, dtype) for op in ("MIN", "MAX") for dtype in ("complex64", "complex128")
]


def calls(pg: MpiProcessGroup, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> dict[str, object]:
    n = pg.size()
    counts = [i + 1 for i in range(n)]
    return {
        "all_reduce": lambda: pg.all_reduce(send, op),
        "all_reduce async": lambda: pg.all_reduce(send, op, async_op=True),
        "all_reduce out": lambda: pg.all_reduce(send, op, out=recv[: send.size]),
        "all_reduce_tensor": lambda: pg.all_reduce_tensor(send, op),
        "reduce": lambda: pg.reduce(send, 0, op),
        "reduce_scatter": lambda: pg.reduce_scatter(send, recv[: send.size // n], op),
        "reduce_scatter_tensor": lambda: pg.reduce_scatter_tensor(send, op),
        "reduce_scatter_v": lambda: pg.reduce_scatter_v(
            send[: sum(counts)], recv[: counts[pg.rank()]], counts, op
        ),
    }


def check(pg: MpiProcessGroup) -> None:
    n, me = pg.size(), pg.rank()
    for op_name, dtype in UNSUPPORTED:
        op = getattr(ReduceOp, op_name)
        send = (np.arange(4 * n * n, dtype=np.float64) + me).astype(dtype)
        recv = np.full(4 * n * n, 7, dtype)
        sent, received = send.copy(), recv.copy()
        for name, call in calls(pg, send, recv, op).items():
            raises(TypeError, call, match=op_name)
            what = f"{name} {op_name} on {dtype}"
            assert send.tobytes() == sent.tobytes() and recv.tobytes() == received.tobytes(), what
            # The group is still usable, and in step.
            inputs = all_inputs(n, what, (5,), np.float32)
            buf = inputs[me].copy()
            pg.all_reduce(buf, ReduceOp.MAX)
            expect_same(buf, reduce_ref(inputs, "MAX"), f"all_reduce after {what}")


def main() -> None:
    check(init_mpi_process_group(timeout=60))
    check(init_mpi_process_group(timeout=60, check_signatures=False))
    if init_mpi_process_group(timeout=60).rank() == 0:
        print("unsupported ok", flush=True)


if __name__ == "__main__":
    main()
