"""The default group of a launched process: `init_process_group("shm")` and `destroy_process_group`; and
the timeouts every world accepts (and refuses, before anything starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import axonml_distributed as ad

pytestmark = pytest.mark.timeout(60)

# The launched workers must import the same copy of the package as this test.
_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(ad.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    ),
}


def _launch(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    start = time.monotonic()
    job = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", "2", str(script), str(tmp_path)],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=50,
    )
    return job, time.monotonic() - start


def test_an_exception_aborts_the_world_even_if_the_process_lingers(tmp_path: Path) -> None:
    # Rank 1 raises while a non-daemon thread keeps its process alive for 60 s: its peers must fail at
    # once, not wait for the timeout (120 s) or for the process to end. (The bound leaves room for
    # starting Python and torch on a loaded machine.)
    job, took = _launch(
        tmp_path,
        """
        import sys, threading, time
        import axonml_distributed as ad

        pg = ad.init_process_group("shm", timeout=120)
        if pg.rank() == 1:
            threading.Thread(target=time.sleep, args=(60,)).start()
            raise ValueError("bad batch on rank 1")
        try:
            ad.barrier()
        except ad.PeerFailureError as e:
            print(f"rank 0: {type(e).__name__}: {e}", flush=True)
            sys.exit(3)
        """,
    )
    assert took < 40, (took, job.stdout, job.stderr)
    assert job.returncode == 1, job.stderr
    assert "rank 0: PeerFailureError:" in job.stdout, job.stdout
    assert "ValueError in rank 1: bad batch on rank 1" in job.stdout, job.stdout
    assert "ValueError: bad batch on rank 1" in job.stderr, "the original hook still reports it"


def test_destroy_process_group_forgets_the_group_and_the_hook(tmp_path: Path) -> None:
    job, _ = _launch(
        tmp_path,
        """
        import json, os, sys
        from pathlib import Path
        import axonml_distributed as ad

        before = sys.excepthook
        ad.init_process_group("shm", timeout=30)
        installed = sys.excepthook is not before
        ad.barrier()
        ad.destroy_process_group()
        result = [installed, sys.excepthook is before, ad.is_initialized()]
        Path(sys.argv[1], f"out.{os.environ['RANK']}").write_text(json.dumps(result))
        """,
    )
    assert job.returncode == 0, job.stderr
    for rank in range(2):
        assert (tmp_path / f"out.{rank}").read_text() == "[true, true, false]"


def test_destroy_process_group_clears_the_thread_default() -> None:
    def fn(pg: ad.ProcessGroup) -> bool:
        assert ad.is_initialized()
        ad.destroy_process_group()
        return ad.is_initialized()

    assert ad.spawn(fn, 2) == [False, False]


def test_torch_style_arguments(tmp_path: Path) -> None:
    job, _ = _launch(
        tmp_path,
        """
        import datetime, json, os, sys
        from pathlib import Path
        import axonml_distributed as ad

        ad.init_process_group("shm", "env://", datetime.timedelta(seconds=30))
        result = [ad.get_rank(), ad.get_world_size(), int(os.environ["RANK"])]
        ad.barrier()
        ad.destroy_process_group()
        ad.init_process_group(backend="shm", init_method=None, timeout=30.0, world_size=-1, rank=-1)
        result.append(ad.get_rank())
        Path(sys.argv[1], f"out.{os.environ['RANK']}").write_text(json.dumps(result))
        """,
    )
    assert job.returncode == 0, job.stderr
    for rank in range(2):
        assert json.loads((tmp_path / f"out.{rank}").read_text()) == [rank, 2, rank, rank]


def test_unsupported_init_methods_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="init_method 'tcp://127.0.0.1:1234' is not supported"):
        ad.init_process_group("shm", init_method="tcp://127.0.0.1:1234")
    with pytest.raises(TypeError, match="second argument is init_method.*rank= and world_size="):
        ad.init_process_group("shm", 0, 2)  # an older (backend, rank, world_size) order
    assert not ad.is_initialized()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_torch_backends_name_the_fix(backend: str) -> None:
    fix = r"use 'shm'.*import axonml_distributed\.torch and use backend 'axonml'"
    with pytest.raises(ValueError, match=fix):
        ad.init_process_group(backend)
    assert not ad.is_initialized()


@pytest.mark.parametrize("timeout", [1e19, float("inf"), float("nan"), -1.0, 0.0, 2e9])
def test_absurd_timeouts_are_refused_clearly(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ad.ThreadBackend.create_world(2, timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        ad.spawn(lambda pg: None, 2, timeout=timeout)


@pytest.mark.parametrize("backend", ["shm", "mpi"])
def test_absurd_init_timeouts_are_refused_before_anything_starts(backend: str) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ad.init_process_group(backend, timeout=1e19)
    assert not ad.is_initialized()


def test_the_longest_timeout_accepted_works() -> None:
    assert ad.spawn(lambda pg: pg.all_reduce_tensor(np.ones(2)).tolist(), 2, timeout=1e9) == [[2.0, 2.0]] * 2
