"""The MPI process group under real `mpiexec` jobs (scripts in tests/mpi_jobs/, see mpi_run): what only
MPI does (async completion order, small all_reduces riding along with the check, staging buffers kept
alive, unaligned and strided buffers, the check switched off, the network transport), DDP over MPI, the
import errors and the MPI bench. The collectives every world shares are in test_conformance.py.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import types

import pytest

from mpi_run import (
    needs_mpi,
    network_only_env,
    passes,
    remove_segments_of_aborted_jobs,
)

_segments = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_op_and_dtype_matches_numpy(n: int) -> None:
    assert f"collectives OK on {n} ranks" in passes(n, "collectives.py")


@needs_mpi
@pytest.mark.timeout(300)
def test_bytes_cross_the_network_transport_when_shared_memory_is_off() -> None:
    out = passes(2, "collectives.py", "--network", env=network_only_env())
    assert "crossed lo" in out and "collectives OK on 2 ranks" in out


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_ddp_over_mpi_trains_like_one_process(n: int) -> None:
    import axonml_distributed

    if not hasattr(axonml_distributed, "DistributedDataParallel"):
        pytest.skip("axonml_distributed does not export DistributedDataParallel yet")
    assert f"ddp OK on {n} ranks" in passes(n, "ddp_equivalence.py")


def _forget_mpi_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    package = "axonml_distributed.mpi"
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)


def test_without_mpi4py_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_mpi_modules(monkeypatch)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # "import mpi4py" now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "axonml-distributed\[mpi\]"'):
        importlib.import_module("axonml_distributed.mpi")


def test_without_an_mpi_library_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str) -> object:
        raise RuntimeError("cannot load MPI library")  # what mpi4py raises when no libmpi is found

    fake = types.ModuleType("mpi4py")
    fake.__getattr__ = no_library  # type: ignore[method-assign]
    _forget_mpi_modules(monkeypatch)
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    with pytest.raises(ImportError, match=r'pip install "axonml-distributed\[mpi\]"') as info:
        importlib.import_module("axonml_distributed.mpi")
    assert isinstance(info.value.__cause__, RuntimeError)


@needs_mpi
@pytest.mark.timeout(180)
def test_the_mpi_bench_prints_raw_and_ours_with_and_without_the_check() -> None:
    # Through the bench command, which launches the mpiexec job itself. No timing assertions: the
    # numbers only have to be there and make sense.
    cmd = [sys.executable, "-m", "axonml_distributed.bench", "--backend", "mpi", "--ranks", "2"]
    cmd += ["--sizes", "8,65536", "--json", "--timeout", "120"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = result.stdout.splitlines()
    report = json.loads(lines[-1])
    assert [(row["ranks"], row["bytes"]) for row in report["all_reduce"]] == [(2, 8), (2, 65536)]
    for row in report["all_reduce"]:
        for name in ("raw", "checked", "unchecked"):
            assert row[f"{name}_s"] > 0 and row[f"{name}_busbw_gbps"] > 0
        assert row["checked_over_raw"] > 0 and row["unchecked_over_raw"] > 0
    # The table: one row per size with both ratios, and the 8-byte target line.
    for size in ("8 B", "64 KiB"):
        row = next(line for line in lines if line.lstrip().startswith(f"{size} |"))
        assert len(re.findall(r"\d+\.\d\dx", row)) == 2, row
    assert any(line.startswith("target at 8 B: ours/raw <= 2.0x; check on ") for line in lines)


def test_without_mpiexec_the_bench_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_mpi = importlib.import_module("axonml_distributed.bench.mpi")
    monkeypatch.setattr(bench_mpi, "find_mpiexec", lambda: None)
    for variable in bench_mpi.MPI_JOB_VARIABLES:  # as if run outside any MPI job
        monkeypatch.delenv(variable, raising=False)
    assert bench_mpi.main(["--backend", "mpi", "--ranks", "2"]) == 2
    assert 'mpiexec was not found: pip install "axonml-distributed[mpi]"' in capsys.readouterr().err
