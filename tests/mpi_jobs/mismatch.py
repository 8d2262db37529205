"""Mismatched calls (collective, count, dtype, op, root, invalid arguments on one rank, a skipped call):
every rank raises before any data moves, naming the ranks that differ in the native worlds' words (the
core describes the mismatch), and the group stays usable. Rank 1 is the odd one out. Exit code 0 = pass.
"""

from __future__ import annotations

import numpy as np

from axonml_distributed import ReduceOp
from axonml_distributed.exceptions import CollectiveMismatchError
from axonml_distributed.mpi import MpiProcessGroup, init_mpi_process_group
from conformance import raises
from reference import expect_same

ODD = 1


def expect_mismatch(pg: MpiProcessGroup, call: object, buf: np.ndarray, *words: str) -> None:
    before = buf.copy()
    message = raises(CollectiveMismatchError, call)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    expect_same(buf, before, "buffer untouched by a mismatched call")
    still_works(pg)


def still_works(pg: MpiProcessGroup) -> None:
    buf = np.ones(3, np.float32)
    pg.all_reduce(buf)
    expect_same(buf, np.full(3, pg.size(), np.float32), "all_reduce after a mismatch")


def main() -> None:
    pg = init_mpi_process_group(timeout=60)
    odd = pg.rank() == ODD
    differ = f"rank {ODD} called"
    a = np.arange(6, dtype=np.float32)

    # A different collective.
    expect_mismatch(
        pg,
        (lambda: pg.broadcast(a, 0)) if odd else (lambda: pg.all_reduce(a)),
        a,
        differ,
        "broadcast(",
        "all_reduce(",
    )
    # A different count on every rank (Horovod's [17 + rank] case).
    b = np.ones(1000 + pg.rank(), np.float32)
    expect_mismatch(pg, lambda: pg.all_reduce(b), b, "1000 x float32", "1001 x float32")
    # Small all_reduces whose data rides along with the check: still no buffer changes on a mismatch.
    small = np.ones(3 + pg.rank(), np.float64)
    expect_mismatch(pg, lambda: pg.all_reduce(small), small, "3 x float64", "4 x float64")
    # A different dtype.
    c = np.zeros(6, np.float64 if odd else np.float32)
    expect_mismatch(pg, lambda: pg.all_reduce(c), c, differ, "6 x float64", "6 x float32")
    # A different reduce op.
    op = ReduceOp.MAX if odd else ReduceOp.SUM
    expect_mismatch(pg, lambda: pg.all_reduce(a, op), a, differ, "op=MAX", "op=SUM")
    # A different root.
    expect_mismatch(pg, lambda: pg.broadcast(a, ODD if odd else 0), a, differ, "root=1", "root=0")
    # The same mismatch in an async call is reported when it is issued.
    expect_mismatch(pg, lambda: pg.all_gather_tensor(c, async_op=True), c, differ)

    # Invalid arguments on one rank only: that rank raises its own ValueError, the others a mismatch.
    d = np.zeros(12, np.float32)
    if odd:
        raises(ValueError, pg.all_reduce, d[::2], match="contiguous")
        still_works(pg)
    else:
        expect_mismatch(pg, lambda: pg.all_reduce(d[:6]), d, differ, "invalid arguments")

    # Point-to-point sizes that disagree: longer (MPI truncates) and shorter messages than the buffer.
    if pg.rank() == 0:
        pg.send(np.ones(5, np.float32), ODD, tag=3)
        pg.send(np.ones(2, np.float32), ODD, tag=4)
    elif odd:
        raises(CollectiveMismatchError, pg.recv, np.zeros(3, np.float32), 0, 3, match="recv(src=0, tag=3")
        raises(CollectiveMismatchError, pg.recv, np.zeros(3, np.float32), 0, 4, match="sent 2 elements")
    still_works(pg)

    # A subgroup checks its own calls.
    sub = pg.new_group([0, 1])
    if sub.contains(pg.rank()):
        e = np.zeros(4, np.float32)
        expect_mismatch(sub, lambda: sub.all_reduce(e, ReduceOp.MIN if odd else ReduceOp.SUM), e, "op=MIN")

    # A rank that skips a call: the others' barrier meets its all_reduce.
    skipping = (lambda: pg.all_reduce(a)) if odd else pg.barrier
    expect_mismatch(pg, skipping, a, differ, "barrier(", "all_reduce(")
    if pg.rank() == 0:
        print(f"mismatch OK on {pg.size()} ranks", flush=True)


if __name__ == "__main__":
    main()
