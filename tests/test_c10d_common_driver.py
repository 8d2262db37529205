"""tests/c10d_common_driver.py, which runs pytorch's test_c10d_common (not in the wheel, so not here) on
"axonml" and gloo side by side: on a small file of the same shape, it completes each mixin with the
backend and runs exactly the backend-parameterised tests at the mixin's world size, decides the file's
accelerator skips in the parent, and fails the run only on a test the reference passes; the report
counts and explains as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import c10d_common_driver as driver

DRIVER = Path(__file__).with_name("c10d_common_driver.py")

# The shape of test_c10d_common.py, with tests whose outcome is known.
SMALL_FILE = '''
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu


def ranks_meet(test, backend):
    """Every rank joins a group of `backend`; the sum of ones is how many ranks ran."""
    store = dist.FileStore(test.file_name, test.world_size)
    dist.init_process_group(backend, store=store, rank=test.rank, world_size=test.world_size)
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


class AbstractCommTest:
    @property
    def world_size(self):
        return 2

    def _test_two_ranks(self, backend):
        assert ranks_meet(self, backend) == 2 and self.device == "cpu"

    def _test_fails_on_axonml(self, backend):
        if backend == "axonml":
            raise RuntimeError("only axonml fails this")

    def _test_fails_everywhere(self, backend):
        raise ValueError("every backend fails this")

    def _test_takes_more_than_a_backend(self, backend, process_group):
        raise AssertionError("not a backend-parameterised test: never run")


class AbstractLargeCommTest:
    @property
    def world_size(self):
        return 4

    def _test_four_ranks(self, backend_name):
        assert ranks_meet(self, backend_name) == 4


class ProcessGroupWithDispatchedCollectivesTests(MultiProcessTestCase):
    @property
    def world_size(self):
        return 1

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_takes_no_backend(self):
        raise AssertionError("the mixin's own test: never run")

    def _test_one_rank(self, backend):
        assert ranks_meet(self, backend) == 1


class AbstractTimeoutTest:
    def _test_in_one_rank(self, backend):
        assert self.world_size == 1 and self.rank == 0


class CommonDistributedDataParallelTest:
    @property
    def world_size(self):
        return 2

    def _test_ddp_with_process_group(self, process_group, devices, device_ids, gradient_as_bucket_view=False):
        assert dist.get_backend(process_group) == self.backend and devices == [torch.device("cpu")]
        assert device_ids is None
        dist.barrier(process_group)  # no rank leaves while another still connects

    def test_uses_the_group(self):
        group = self._get_process_group()
        assert dist.get_world_size(group) == 2
        dist.barrier(group)

    @skip_if_lt_x_gpu(8)
    def test_needs_accelerators(self):
        raise AssertionError("skipped in the parent on a machine with fewer than 8 accelerators")
'''

RAN = {
    "CommTest.test_two_ranks": "passed",
    "CommTest.test_fails_everywhere": "failed",
    "LargeCommTest.test_four_ranks": "passed",
    "ProcessGroupWithDispatchedCollectivesTests.test_one_rank": "passed",
    "TimeoutTest.test_in_one_rank": "passed",
    "CommonDistributedDataParallelTest.test_uses_the_group": "passed",
    "CommonDistributedDataParallelTest.test_ddp_cpu_module": "passed",
    "CommonDistributedDataParallelTest.test_ddp_cpu_module_grad_is_view": "passed",
    "CommonDistributedDataParallelTest.test_needs_accelerators": "skipped",
}


@pytest.mark.timeout(300)
def test_the_driver_runs_the_backend_parameterised_tests_of_a_file_on_each_backend(tmp_path: Path) -> None:
    source = tmp_path / "pytorch"
    (source / "test" / "distributed").mkdir(parents=True)
    (source / "test" / "distributed" / "test_c10d_common.py").write_text(SMALL_FILE)
    outcomes = tmp_path / "outcomes.json"
    run = subprocess.run(
        [sys.executable, str(DRIVER), "--pytorch-src", str(source), "--outcomes", str(outcomes)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert outcomes.exists(), run.stdout[-3000:] + run.stderr[-5000:]
    got = json.loads(outcomes.read_text())
    assert got["gloo"] == {**RAN, "CommTest.test_fails_on_axonml": "passed"}, run.stdout[-3000:]
    assert got["axonml"] == {**RAN, "CommTest.test_fails_on_axonml": "failed"}, run.stdout[-3000:]
    # axonml fails a test gloo passes: the run fails, and says why.
    assert run.returncode == 1, run.stdout[-3000:]
    report = run.stdout[run.stdout.index("test_c10d_common's backend-parameterised tests") :]
    assert report.splitlines()[2:7] == [
        "              axonml      gloo",
        "ran                9         9",
        "passed             7         8",
        "failed             2         1",
        "skipped            1         1",
    ], report
    assert "axonml CommTest.test_fails_on_axonml: RuntimeError: only axonml fails this  [REGRESSION]" in (
        report
    )
    assert (
        "axonml CommTest.test_fails_everywhere: ValueError: every backend fails this  [failed on gloo too]"
        in report
    )


def test_the_report_fails_only_on_what_the_reference_passes_or_a_listed_test_passing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(driver, "KNOWN_FAILURES", {"axonml": {"T.listed": "why", "T.listed_passes": "why"}})
    gloo = {"T.ok": "passed", "T.both": "failed", "T.listed": "passed", "T.listed_passes": "passed"}
    axonml = {"T.ok": "passed", "T.both": "failed", "T.listed": "known failure", "T.listed_passes": "passed"}
    trace = "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n"
    reasons = {"axonml": {"T.both": trace, "T.listed": trace}, "gloo": {"T.both": trace}}
    assert not driver.report({"axonml": axonml, "gloo": gloo}, reasons)
    printed = capsys.readouterr().out
    assert "axonml T.listed: KeyError: 'x'  [known: why]" in printed
    assert "axonml T.both: KeyError: 'x'  [failed on gloo too]" in printed
    assert "axonml T.listed_passes: PASSED, but KNOWN_FAILURES lists it (remove it)" in printed
    del axonml["T.listed_passes"], gloo["T.listed_passes"]
    assert driver.report({"axonml": axonml, "gloo": gloo}, reasons)


def test_a_failures_reason_is_the_failing_ranks_last_exception_line() -> None:
    trace = (
        "Traceback (most recent call last):\n  File x\nRuntimeError: Process 1 exited with error code 10 and "
        "exception:\nTraceback (most recent call last):\n  File y\n"
        "torch.distributed.DistBackendError: the peer left\n\nTo execute this test, run the following\n"
    )
    assert driver.reason(trace) == "torch.distributed.DistBackendError: the peer left"
    assert driver.reason("no exception named\nat all\n") == "at all"
