"""Flows torch and Horovod users know, on our API, at 2 ranks under the launcher
(tests/torch_jobs/flows.py): the PyTorch DDP tutorial against torch DDP over gloo (bitwise), the
ddp-tutorial-series snapshot resume and Horovod's pytorch_mnist against one process replaying both ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import axonml_distributed as ad

sys.path.insert(0, str(Path(__file__).parent / "torch_jobs"))
import flows  # noqa: E402

JOB = Path(flows.__file__)
# The launched workers must import the same copy of the package as this test.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(ad.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    ),
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}


def _run(out: Path, flow: str, impl: str, *args: str) -> list[dict[str, Any]]:
    job = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", "2", str(JOB), flow, impl]
        + [str(out), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert job.returncode == 0, (flow, impl, job.stdout, job.stderr)
    return [torch.load(out / f"{flow}.{impl}.{rank}.pt", weights_only=True) for rank in range(2)]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), what
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), (what, key)


@pytest.mark.timeout(150)
def test_the_ddp_tutorial_flows_match_torch_ddp_over_gloo(tmp_path: Path) -> None:
    theirs = _run(tmp_path, "tutorial", "torch")
    ours = _run(tmp_path, "tutorial", "axonml")
    for rank in range(2):
        for flow in ("basic", "checkpoint", "no_sync"):
            _assert_same(ours[rank][flow], theirs[rank][flow], f"{flow} rank {rank}")
            _assert_same(ours[rank][flow], ours[0][flow], f"{flow}: replicas agree")
    # The checkpoint torch DDP wrote loads into ours: the same module.-prefixed keys.
    torch_checkpoint = torch.load(tmp_path / "tutorial.torch.ckpt", weights_only=True)
    ddp = ad.DistributedDataParallel(flows.ToyModel(), ad.ProcessGroup(ad.ThreadBackend.single()))
    ddp.load_state_dict(torch_checkpoint)
    _assert_same(ddp.state_dict(), torch_checkpoint, "torch's checkpoint in our DDP")


@pytest.mark.timeout(150)
def test_the_ddp_tutorial_series_resumes_from_its_snapshot(tmp_path: Path) -> None:
    first = _run(tmp_path, "series", "axonml", "2")  # "crashes" after epoch 2, its snapshot saved
    assert [r["epochs_run"] for r in first] == [0, 0]
    resumed = _run(tmp_path, "series", "axonml", str(flows.SERIES_EPOCHS))
    assert [r["epochs_run"] for r in resumed] == [2, 2]
    want = flows.series_reference()
    for rank in range(2):
        _assert_same(resumed[rank]["model"], want, f"rank {rank}")


@pytest.fixture
def one_thread() -> Iterator[None]:
    # As the ranks (OMP_NUM_THREADS=1): convolutions sum in another order with more threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(150)
def test_horovods_pytorch_mnist_on_our_api_trains_like_one_process(tmp_path: Path, one_thread: None) -> None:
    ours = _run(tmp_path, "horovod", "axonml")
    want = flows.horovod_reference()
    for rank in range(2):
        _assert_same(ours[rank]["model"], want["model"], f"rank {rank}")
        # The ranks average float32 scalar tensors (metric_average), the reference Python floats.
        for got, expected in zip(ours[rank]["metrics"], want["metrics"], strict=True):
            assert got == pytest.approx(expected, rel=1e-6)
