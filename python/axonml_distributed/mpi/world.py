"""Joining the MPI job: `init_mpi_process_group`, the group of every rank, flat, or over several hosts
when the job spans hosts with more than one rank on each (`mpi.hosts`)."""

from __future__ import annotations

from mpi4py import MPI

from axonml_distributed._core import checked_timeout
from axonml_distributed.mpi.group import MpiProcessGroup
from axonml_distributed.mpi.hosts import MpiHostsProcessGroup, find_layout, two_level
from axonml_distributed.mpi.queue import await_peers, complete_or_abort


def init_mpi_process_group(timeout: float | None = None, check_signatures: bool = True) -> MpiProcessGroup:
    """The group of every rank of the MPI job, on a private duplicate of COMM_WORLD (so our messages never
    match the application's own MPI calls). `timeout` in seconds, default 300. Collective.

    When the job spans several hosts, each with the same number (more than one) of ranks, the group is an
    `MpiHostsProcessGroup`: its large all_reduces run through our shared memory inside each host and MPI
    between hosts. Otherwise (one host, one rank per host, or hosts with different numbers of ranks) it
    is the flat `MpiProcessGroup`, every call MPI's."""
    timeout = checked_timeout(timeout)
    world = MPI.COMM_WORLD
    ranks = list(range(world.Get_size()))
    me = world.Get_rank()
    describe = "init_mpi_process_group (duplicating COMM_WORLD)"
    await_peers(world, {r: r for r in ranks if r != me}, timeout, describe, ranks)
    comm, request = world.Idup()
    complete_or_abort(world, request, timeout, describe, ranks)  # everyone is there: it completes at once
    layout = find_layout(comm, timeout)
    if two_level(layout):
        return MpiHostsProcessGroup(comm, ranks, me, timeout, check_signatures, layout)
    return MpiProcessGroup(comm, ranks, me, timeout, check_signatures)
