"""A mismatch over MPI carries the facts the native worlds' does (see tests/test_error_facts.py): rank 2
broadcasts where ranks 0 and 1 all-reduce, in the group's second call. Prints "error facts ok" on rank 0."""

from __future__ import annotations

import numpy as np

from axonml_distributed.exceptions import CollectiveMismatchError
from axonml_distributed.mpi import init_mpi_process_group


def main() -> None:
    pg = init_mpi_process_group(timeout=60)
    pg.barrier()
    x = np.ones(4, np.float32)
    try:
        pg.broadcast(x, 0) if pg.rank() == 2 else pg.all_reduce(x)
    except CollectiveMismatchError as e:
        got = (e.ranks, e.seq, e.group, e.calls)
    else:
        raise AssertionError("no mismatch")
    calls = {
        0: "all_reduce(#2, 4 x float32, op=SUM)",
        1: "all_reduce(#2, 4 x float32, op=SUM)",
        2: "broadcast(#2, 4 x float32, root=0)",
    }
    assert got == ((2,), 2, (0, 1, 2), calls), got
    pg.barrier()
    if pg.rank() == 0:
        print("error facts ok", flush=True)


if __name__ == "__main__":
    main()
