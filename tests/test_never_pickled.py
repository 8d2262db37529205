"""No object path pickles or unpickles anything, on any backend: every object collective and Horovod's
broadcast_optimizer_state run with pickle and torch.save/torch.load trapped (tests/never_pickled.py)
and give the references, torch tensors of every carried dtype and a torch optimizer's state included."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import axonml_distributed as ad
from mpi_run import needs_mpi, passes, remove_segments_of_aborted_jobs
from never_pickled import check_object_paths
from shm_run import connect, ok, run_world, segments_unchanged

no_leak = pytest.fixture(autouse=True)(segments_unchanged)
no_mpich_leftovers = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_thread_world(n: int) -> None:
    assert ad.spawn(check_object_paths, n, timeout=60) == [[]] * n


def shm_paths(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    return check_object_paths(connect(rank, n, ports[0], timeout))


@pytest.mark.timeout(180)
def test_shm_world() -> None:
    assert ok(run_world(2, shm_paths, timeout=60, limit=150)) == [[], []]


@needs_mpi
@pytest.mark.timeout(240)
def test_mpi() -> None:
    assert "never pickled ok" in passes(3, "object_paths.py")


def test_the_trap_is_lifted_after_the_rank_threads_leave() -> None:
    # Rank threads enter and leave the trap in any order; afterwards pickle and torch.load are the real
    # ones again (other tests of this process read their results with torch.load).
    ad.spawn(check_object_paths, 3, timeout=60)
    assert pickle.loads(pickle.dumps([1, "a"])) == [1, "a"]
    assert torch.load.__module__ == "torch.serialization"
