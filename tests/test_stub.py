"""The hand-written `_core.pyi` agrees with the compiled module."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_stub_matches_the_native_module() -> None:
    pytest.importorskip("mypy")
    run = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "axonml_distributed._core"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
