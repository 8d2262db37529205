"""CPU torch tensors in every collective and comm helper, and `new_group(ranks)`, on each backend: the
thread world, the shm world (the launcher) and MPI (mpiexec). One check for all three:
tests/torch_jobs/tensors_everywhere.py. Beside it, on the thread world: tensors reduced in place, bfloat16
and non-contiguous tensors in the returning variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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


def test_a_torch_tensor_is_reduced_in_place_and_tensor_helpers_return_tensors() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        t = torch.full((3,), float(pg.rank() + 1), requires_grad=True)
        pg.all_reduce(t, ad.ReduceOp.AVG)
        g = torch.arange(4, dtype=torch.int64) * (pg.rank() + 1)
        out = pg.all_reduce_tensor(g, "sum")
        return t.detach().tolist(), type(out).__name__, out.tolist()

    res = ad.spawn(fn, 2, timeout=30)
    assert res == [([1.5] * 3, "Tensor", [0, 3, 6, 9])] * 2


def test_tensor_helpers_keep_bfloat16_and_take_non_contiguous_tensors() -> None:
    import torch

    def fn(pg: ad.ProcessGroup) -> Any:
        t = torch.full((4,), 1.5 + pg.rank(), dtype=torch.bfloat16)
        out = pg.all_reduce_tensor(t)
        nc = (torch.arange(8.0).reshape(2, 4) + 10 * pg.rank()).t()  # a transposed view
        b = pg.broadcast_tensor(nc, 0)
        return out.dtype, out.tolist(), b.tolist(), float(t[0])

    for r, (dtype, out, b, mine) in enumerate(ad.spawn(fn, 2, timeout=30)):
        assert dtype == torch.bfloat16 and out == [4.0] * 4
        assert b == torch.arange(8.0).reshape(2, 4).t().tolist()
        assert mine == 1.5 + r  # the input is left alone


def test_a_view_with_a_storage_offset_reduces_only_its_own_elements() -> None:
    def fn(pg: ad.ProcessGroup) -> list[float]:
        base = torch.arange(8.0) * (pg.rank() + 1)
        pg.all_reduce(base[2:5])
        return base.tolist()

    for r, got in enumerate(ad.spawn(fn, 2, timeout=30)):
        want = torch.arange(8.0) * (r + 1)
        want[2:5] = torch.arange(2.0, 5.0) * 3
        assert got == want.tolist()


@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_a_lazily_conjugated_or_negated_view_is_refused_not_reduced_as_stored(lazy: str) -> None:
    # Such a view's memory does not hold its values (torch applies the conjugation or negation on read).
    def fn(pg: ad.ProcessGroup) -> None:
        t = (
            torch.tensor([1 + 2j], dtype=torch.complex64).conj()
            if lazy == "conj"
            else torch._neg_view(torch.ones(2))
        )
        pg.all_reduce(t)

    with pytest.raises(ad.SpawnError) as e:
        ad.spawn(fn, 1, timeout=30)
    assert isinstance(e.value.__cause__, TypeError) and "no CPU numpy view" in str(e.value.__cause__)
