"""CPU torch tensors in every collective and comm helper, and `new_group(ranks)`, on each backend: the
thread world, the shm world (the launcher) and MPI (mpiexec). One check for all three:
tests/torch_jobs/tensors_everywhere.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import axonml_distributed as ad

sys.path.insert(0, str(Path(__file__).parent / "torch_jobs"))
import tensors_everywhere  # noqa: E402

JOB = Path(__file__).parent / "torch_jobs" / "tensors_everywhere.py"
# The launched workers must import the same copy of the package as this test.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(ad.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 3])
def test_thread_world(n: int) -> None:
    ad.spawn(tensors_everywhere.check, n)


@pytest.mark.timeout(120)
def test_shm_world() -> None:
    job = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", "3", str(JOB), "shm"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert job.returncode == 0, (job.stdout, job.stderr)
    assert "tensors OK on 3 ranks" in job.stdout


@pytest.mark.timeout(120)
def test_mpi() -> None:
    from mpi_run import MPIEXEC, run_job

    if MPIEXEC is None:
        pytest.fail("mpiexec is missing: the test extra installs mpi4py and mpich")
    result, _ = run_job(3, str(JOB), "mpi", env=ENV, limit=100)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "tensors OK on 3 ranks" in result.stdout
