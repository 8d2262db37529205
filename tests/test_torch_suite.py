"""torch's own generic distributed tests (`DistributedTest`) at 2 ranks on "axonml", through our driver
(tests/torch_suite.py), checked against the same tests on gloo in the same run: every test gloo passes
passes on "axonml" too, unless the driver lists it as a known failure (torch refusing the backend for
what it is; the driver reports it "known failure", and itself fails on any other failure and on a listed
test that passes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("torch_suite.py")


def run_suite(backend: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """The driver's run at 2 ranks on `backend`, and each test's outcome."""
    outcomes = tmp_path / f"{backend}.json"
    run = subprocess.run(
        [sys.executable, str(DRIVER), "--backend", backend, "--world-size", "2", "--outcomes", str(outcomes)],
        capture_output=True,
        text=True,
        timeout=420,  # a whole run takes 1-2 min on 2 loaded cores
    )
    return run, json.loads(outcomes.read_text()) if outcomes.exists() else {}


def of(outcomes: dict[str, str], *kinds: str) -> set[str]:
    """The tests whose outcome is one of `kinds`."""
    return {test for test, outcome in outcomes.items() if outcome in kinds}


@pytest.mark.timeout(900)
def test_torch_distributed_suite_passes_on_axonml_as_on_gloo(tmp_path: Path) -> None:
    gloo_run, gloo = run_suite("gloo", tmp_path)
    assert gloo_run.returncode == 0, gloo_run.stdout[-3000:] + gloo_run.stderr[-5000:]
    axonml_run, axonml = run_suite("axonml", tmp_path)
    assert axonml_run.returncode == 0, axonml_run.stdout[-3000:] + axonml_run.stderr[-5000:]

    assert axonml.keys() == gloo.keys()
    assert of(axonml, "passed", "failed", "known failure") == of(gloo, "passed", "failed", "known failure")
    passed_on_gloo = of(gloo, "passed")
    assert passed_on_gloo <= of(axonml, "passed", "known failure")
    assert not of(axonml, "failed")
    assert len(passed_on_gloo) > 50, "torch's suite ran almost nothing: a gate or the driver broke"
