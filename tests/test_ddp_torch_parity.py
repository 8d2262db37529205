"""Our DDP against torch's own over gloo: the same script (tests/torch_jobs/ddp_parity.py, which only
swaps its imports) at 2 ranks must end with bitwise the same state_dicts, keys included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import axonml_distributed as ad

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).parent / "torch_jobs" / "ddp_parity.py"
# The launched workers must import the same copy of the package as this test.
_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(ad.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    ),
}


def _run(impl: str, out: Path) -> list[dict[str, dict[str, torch.Tensor]]]:
    job = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", "2", str(JOB), impl, str(out)],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert job.returncode == 0, (impl, job.stdout, job.stderr)
    return [torch.load(out / f"{impl}.{rank}.pt") for rank in range(2)]


def test_same_weights_as_torch_ddp_over_gloo(tmp_path: Path) -> None:
    theirs = _run("torch", tmp_path)
    ours = _run("axonml", tmp_path)
    for rank in range(2):
        for model in ("toy", "cnn"):
            want, got = theirs[rank][model], ours[rank][model]
            assert list(got) == list(want)  # torch DDP's keys: module.<name>
            assert all(key.startswith("module.") for key in got)
            for key in want:
                assert got[key].dtype == want[key].dtype, key
                assert torch.equal(got[key], want[key]), (rank, model, key)
    # The replicas agree (rank 1 started from other weights and saw other data); batch-norm statistics
    # are the one per-rank state, as in torch.
    for model in ("toy", "cnn"):
        for key, value in ours[0][model].items():
            if "running" not in key:
                assert torch.equal(value, ours[1][model][key]), key
    assert not torch.equal(ours[0]["cnn"]["module.bn.running_mean"], ours[1]["cnn"]["module.bn.running_mean"])
