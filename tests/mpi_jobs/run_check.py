"""Checks of the conformance suite (tests/conformance.py), one after another on one MPI group:
``run_check.py CHECK...``.
Every rank's digests are compared through mpi4py's own pickle path, not through the group under test;
rank 0 prints them. Exit code 0 = pass."""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from axonml_distributed.mpi import init_mpi_process_group
from conformance import run_checks


def main() -> None:
    names = sys.argv[1:]
    pg = init_mpi_process_group(timeout=120)
    digests = run_checks(pg, names)
    every = MPI.COMM_WORLD.allgather(digests)
    if any(d != every[0] for d in every):
        raise AssertionError(f"{names}: results differ between ranks: {every}")
    pg.barrier()
    if pg.rank() == 0:
        print(f"digests: {json.dumps(digests)}", flush=True)
        print(f"conformance {' '.join(names)} OK on {pg.size()} ranks", flush=True)


if __name__ == "__main__":
    main()
