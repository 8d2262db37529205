"""The conformance suite on every world: each check of tests/conformance.py (every collective, op, dtype
and odd size against the numpy reference; results bitwise identical on every rank) runs on the thread
world (`spawn`), the shared-memory world (processes under `ShmBackend`) and MPI (an `mpiexec` job)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest

import axonml_distributed as ad
from conformance import ABORTING, CHECKS, ERROR_CHECKS, run_checks
from mpi_run import needs_mpi, passes, remove_segments_of_aborted_jobs
from shm_run import connect, ok, run_world, segments_unchanged

# No segment of ours, nor of an aborted MPI job, is left in /dev/shm.
no_leak = pytest.fixture(autouse=True)(segments_unchanged)
no_mpich_leftovers = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)


def shm_check(
    rank: int, n: int, ports: list[int], job: str | None, timeout: float, q: Any, names: list[str]
) -> Any:
    """A worker of the shared-memory world: join it, run the checks."""
    return run_checks(connect(rank, n, ports[0], timeout), names)


# Each world runs `names` one after another in one job of `n` ranks; per rank (MPI: once, the job compares
# its ranks itself), the digests of each check.
def on_threads(names: list[str], n: int) -> list[list[list[str]]]:
    return ad.spawn(run_checks, n, names, timeout=120)


def on_shm(names: list[str], n: int) -> list[list[list[str]]]:
    return ok(run_world(n, shm_check, names, timeout=120, limit=240))


def on_mpi(names: list[str], n: int) -> list[list[list[str]]]:
    # The job compares every rank's digests itself, through mpi4py's own channel; rank 0 prints them.
    out = passes(n, "run_check.py", *names)
    assert f"conformance {' '.join(names)} OK on {n} ranks" in out
    return [json.loads(out.partition("digests: ")[2].partition("\n")[0])]


WORLDS: dict[str, Callable[[list[str], int], list[list[list[str]]]]] = {
    "threads": on_threads,
    "shm": on_shm,
    "mpi": on_mpi,
}


def alone(world: str, check: str, n: int) -> list[list[str]]:
    """Per rank, the digests of `check` run in a world of its own."""
    return [rank[0] for rank in WORLDS[world]([check], n)]


# The checks that leave their world usable run together, one world per (world, size), as a job would make
# their calls: a world's start-up (processes importing numpy and torch) costs more than most checks.
TOGETHER = [c for c in CHECKS if c not in ABORTING]


@functools.cache
def run_together(world: str, n: int) -> list[list[list[str]]] | Exception:
    """Per rank, the digests of every check of TOGETHER from one world, or why that run failed."""
    try:
        return WORLDS[world](TOGETHER, n)
    except Exception as e:  # noqa: BLE001 - reported by the test below; each check is then re-run alone
        return e


def together(world: str, n: int) -> list[list[list[str]]] | None:
    """The digests of `run_together`; None if that run failed, and each test then runs its own check
    alone, to fail with its own error."""
    ran = run_together(world, n)
    return None if isinstance(ran, Exception) else ran


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("world", [pytest.param(w, marks=needs_mpi if w == "mpi" else ()) for w in WORLDS])
def test_the_checks_run_one_after_another_in_one_world(world: str, n: int) -> None:
    # A check that passes alone but fails after the others (one that leaves its world broken) fails here.
    ran = run_together(world, n)
    assert not isinstance(ran, Exception), f"the checks together on {world}, {n} ranks: {ran!r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("world", [pytest.param(w, marks=needs_mpi if w == "mpi" else ()) for w in WORLDS])
@pytest.mark.parametrize("check", list(CHECKS))
def test_every_world_conforms(check: str, world: str, n: int) -> None:
    ran = together(world, n) if check in TOGETHER else None
    digests = [rank[TOGETHER.index(check)] for rank in ran] if ran is not None else alone(world, check, n)
    assert all(d == digests[0] for d in digests), f"{check} on {world}: results differ between ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [pytest.param("shm"), pytest.param("mpi", marks=needs_mpi)])
def test_a_mismatch_reads_the_same_in_every_world(world: str) -> None:
    # Three ranks, so the message names two that differ from the first.
    assert alone(world, "mismatch_message", 3)[0] == alone("threads", "mismatch_message", 3)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [pytest.param("shm"), pytest.param("mpi", marks=needs_mpi)])
@pytest.mark.parametrize("check", list(ERROR_CHECKS))
def test_a_mistake_reads_the_same_in_every_world(check: str, world: str) -> None:
    # The exception type and message of each mistake, against the thread world's (the core's own).
    expected = alone("threads", check, 2)
    assert all(d == expected[0] for d in expected)
    assert alone(world, check, 2)[0] == expected[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [pytest.param("shm"), pytest.param("mpi", marks=needs_mpi)])
@pytest.mark.parametrize("check", ["split_mismatch", "counts_mismatch"])
def test_a_layout_mismatch_reads_the_same_in_every_world(check: str, world: str) -> None:
    # Split sizes or counts that disagree: the core's message, from the layouts every member published.
    assert alone(world, check, 3)[0] == alone("threads", check, 3)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [pytest.param(w, marks=needs_mpi if w == "mpi" else ()) for w in WORLDS])
def test_a_refused_reduction_leaves_the_group_usable_at_three_ranks(world: str) -> None:
    # Issue 26: at 3 ranks a refusal sometimes ended the in-process world; every world refuses alike.
    digests = alone(world, "refused_reductions", 3)
    assert all(d == digests[0] for d in digests)
    assert digests[0] == alone("threads", "refused_reductions", 3)[0]
