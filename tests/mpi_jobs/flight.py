"""The MPI group's calls in the flight recorder: each rank makes the calls below (rank 1 goes astray at
the fifth collective with MODE "mismatch"), then dumps its record and its stats into DIR, which the test
(test_flight_mpi.py) checks against the calls made. Usage: flight.py DIR MODE. Exit code 0 = pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from axonml_distributed import trace
from axonml_distributed.exceptions import CollectiveMismatchError
from axonml_distributed.mpi import init_mpi_process_group


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    pg = init_mpi_process_group(timeout=60)
    me, n = pg.rank(), pg.size()
    x = np.ones(4, np.float32)
    pg.all_reduce(x)  # the blocking path of small all_reduces
    work = pg.all_reduce(np.ones(1000, np.float64), async_op=True)
    assert work is not None
    work.wait()
    pg.broadcast(x, 0)
    pg.all_gather(x, np.empty(4 * n, np.float32))
    if me == 0:
        pg.send(np.ones(5, np.int32), 1, tag=2)
        pg.send(np.ones(3, np.float64), 1, tag=4)
    elif me == 1:
        pg.recv(np.empty(5, np.int32), 0, tag=2)
        assert pg.recv_any(np.empty(3, np.float64), tag=4) == 0
    if mode == "mismatch":
        try:
            pg.broadcast(x, 0) if me == 1 else pg.all_reduce(x)
        except CollectiveMismatchError:
            pass
        else:
            raise AssertionError("the mismatch was not found")
    pg.barrier()
    trace.dump_flight_recorder(out / f"rank{me}.json")
    (out / f"stats{me}.json").write_text(json.dumps(pg.stats()))
    # A group's stats before any call, a non-member's (rank 1) too: none, as the native groups' (made after
    # the dump, which the test reads with one group).
    solo = pg.new_group([0])
    assert solo.stats() == {}, solo.stats()
    print(f"flight {mode} OK on rank {me}")


if __name__ == "__main__":
    main()
