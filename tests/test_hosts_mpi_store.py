"""`mpi.host_store.HostStore`, the store each host's ranks meet through under MPI across hosts, under a
local `mpiexec` (its use in a job across simulated hosts: tests/test_hosts_mpi.py): every operation the
rendezvous uses, from the keeper and from the ranks that ask it, against the values each rank set."""

from __future__ import annotations

import pytest

from mpi_run import needs_mpi, passes


@needs_mpi
@pytest.mark.timeout(120)
def test_every_rank_sets_adds_waits_reads_and_deletes_through_the_keeper() -> None:
    assert "host store OK on 3 ranks" in passes(3, "host_store.py")
