"""Every object path over MPI with pickle trapped (tests/never_pickled.py); rank 0 prints "never pickled
ok". A rank whose paths differ from the references raises, which ends the job."""

from __future__ import annotations

from axonml_distributed.mpi import init_mpi_process_group
from never_pickled import check_object_paths


def main() -> None:
    pg = init_mpi_process_group(timeout=120)
    failures = check_object_paths(pg)
    if failures:
        raise AssertionError("\n".join(failures))
    sub = pg.new_group([1, 2])
    if sub.contains(pg.rank()):
        failures = check_object_paths(sub)
        if failures:
            raise AssertionError("\n".join(failures))
    pg.barrier()
    if pg.rank() == 0:
        print("never pickled ok", flush=True)


if __name__ == "__main__":
    main()
