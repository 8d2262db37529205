"""Static typing: the package type-checks, and every backend's group conforms to `ProcessGroupLike`, the
one protocol DDP, the sampler and the comm helpers are written against."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

PACKAGE = Path(__file__).parents[1] / "python" / "axonml_distributed"

# Assigning each group to the protocol makes mypy compare every method's signature.
CONFORMANCE = """\
from axonml_distributed._core import ProcessGroup
from axonml_distributed._types import ProcessGroupLike
from axonml_distributed.mpi import MpiProcessGroup


def native(pg: ProcessGroup) -> ProcessGroupLike:
    return pg


def mpi(pg: MpiProcessGroup) -> ProcessGroupLike:
    return pg
"""


def test_the_package_type_checks_and_every_group_is_a_process_group_like(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    pytest.importorskip("mpi4py")
    check = tmp_path / "conformance.py"
    check.write_text(CONFORMANCE)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", str(PACKAGE), str(check)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
