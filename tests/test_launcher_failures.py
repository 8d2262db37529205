"""The launcher's gang supervision (`axonml_distributed.supervise`): a failing or killed worker ends the
job, teardown reaches every process, the root cause is named from the error files, signals are
forwarded once, and the workers die with a SIGKILLed launcher."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from axonml_distributed import error_file, supervise
from deaths import DEATHS, Death, survivor_says
from launcher_run import alive, finish_launcher, start_launcher, wait_for, worker_script

pytestmark = pytest.mark.timeout(60)


def test_failed_worker_ends_the_job_quickly(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        ready()
        if RANK == 1:
            wait_all_ready()
            sys.exit(3)
        time.sleep(60)
    """,
    )
    started = time.monotonic()
    launcher = start_launcher("--nproc-per-node", "3", script, tmp_path)
    _, err = finish_launcher(launcher)
    # Far below the survivors' 60 s sleep, with room for starting three Pythons on a loaded machine.
    assert time.monotonic() - started < 40
    assert launcher.returncode == 1
    assert "axonml-run: rank 1 failed first (exit code 3); terminated ranks 0, 2\n" in err


def test_teardown_reaches_the_children_of_workers(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        import subprocess
        if RANK == 1:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            (OUT / "child").write_text(str(child.pid))
        ready()
        if RANK == 0:
            wait_all_ready()
            sys.exit(3)
        time.sleep(60)
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    finish_launcher(launcher)
    assert launcher.returncode == 1
    child = (tmp_path / "child").read_text()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the worker's child survived the teardown"
        time.sleep(0.01)


def test_worker_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        ready()
        if RANK == 0:
            wait_all_ready()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == 1
    assert "axonml-run: rank 0 failed first (killed by SIGKILL); terminated rank 1\n" in err


@pytest.mark.parametrize("death", DEATHS.values(), ids=DEATHS.keys())
def test_a_dead_workers_exit_status_reaches_its_peer_and_the_summary(tmp_path: Path, death: Death) -> None:
    # Rank 1 dies while rank 0 reduces over the shared-memory world: rank 0's PeerFailureError (shown in
    # the summary's secondary line) and the summary's first line both say how.
    script = worker_script(
        tmp_path,
        f"""
        import numpy as np
        import axonml_distributed as ad

        pg = ad.init_process_group("shm", timeout=60)
        (OUT / f"pid.{{RANK}}").write_text(str(os.getpid()))
        pg.barrier()
        if RANK == 1:
            {death.code}
        while True:
            pg.all_reduce(np.ones(4, np.float32))
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == 1
    pid = (tmp_path / "pid.1").read_text()
    lines = _failure_lines(err)
    assert lines[0].startswith(f"axonml-run: rank 1 failed first ({death.launcher})"), err
    secondary = (
        "axonml-run: secondary: rank 0 failed (exit code 1): PeerFailureError: peer rank 1 died during "
    )
    assert any(
        line.startswith(secondary) and f"(pid {pid} {survivor_says(death)}" in line for line in lines
    ), err
    oom_hint = "axonml-run: SIGKILL is sent by kill -9, and by the kernel's OOM killer when memory runs out"
    assert (oom_hint in err) == (death is DEATHS["sigkill"]), err


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        signal.signal(signal.SIGTERM, record)
        ready()
        if RANK == 0:
            wait_all_ready()
            sys.exit(3)
        time.sleep(60)
    """,
    )
    started = time.monotonic()
    launcher = start_launcher("--nproc-per-node", "2", "--grace-period", "1", script, tmp_path)
    _, err = finish_launcher(launcher)
    assert 1 <= time.monotonic() - started < 40  # far below the worker's 60 s sleep
    assert launcher.returncode == 1
    assert "axonml-run: rank 0 failed first (exit code 3); terminated rank 1\n" in err
    assert "axonml-run: rank 1 still running 1 s after SIGTERM; sent SIGKILL\n" in err
    assert (tmp_path / "signals.1").read_text() == "SIGTERM\n"


def _failure_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("axonml-run: ")]


def test_the_rank_that_failed_first_is_named_not_the_first_to_exit(tmp_path: Path) -> None:
    # Rank 3 raises while its peers wait in an all_reduce: its abort makes them fail at once, and a
    # non-daemon thread keeps it alive after that, so they exit before it does.
    script = worker_script(
        tmp_path,
        """
        import threading
        import numpy as np
        import axonml_distributed as ad

        pg = ad.init_process_group("shm", timeout=60)
        if RANK == 3:
            threading.Thread(target=time.sleep, args=(1,)).start()
            raise RuntimeError("rank 3 fails in user code")
        pg.all_reduce(np.ones(4, np.float32))
    """,
    )
    launcher = start_launcher("--nproc-per-node", "4", script, tmp_path)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == 1
    lines = _failure_lines(err)
    assert lines[0].startswith("axonml-run: rank 3 failed first ("), err
    # The summary: rank 3's traceback first, then the ranks it took down.
    summary = err[err.index(lines[0]) :]
    traceback = summary.index("axonml-run: traceback of rank 3, the first to fail:\nTraceback")
    secondary = summary.index(
        "axonml-run: secondary: ranks 0, 1, 2 failed (exit code 1): PeerFailureError: the world was "
        "aborted by rank 3: RuntimeError in rank 3: rank 3 fails in user code\n"
    )
    assert traceback < summary.index("RuntimeError: rank 3 fails in user code\n") < secondary, err
    # In the workers' own output too, the root cause's traceback comes first.
    assert err.index("RuntimeError: rank 3 fails in user code") < err.index("PeerFailureError"), err


def test_the_root_cause_is_not_terminated_while_it_reports(tmp_path: Path) -> None:
    # Rank 1's own excepthook (a slow reporter, say a crash uploader) takes 2 s; its peer fails at once
    # and exits, and there is no failure grace period: still, rank 1 must not be signalled while its hook
    # runs, and its report must be complete.
    script = worker_script(
        tmp_path,
        """
        import axonml_distributed as ad

        def slow_report(kind, value, tb):
            time.sleep(2)
            sys.__excepthook__(kind, value, tb)
            (OUT / "reported").touch()

        if RANK == 1:
            signal.signal(signal.SIGTERM, record)
            sys.excepthook = slow_report
        pg = ad.init_process_group("shm", timeout=60)
        if RANK == 1:
            raise ValueError("rank 1 fails slowly")
        pg.barrier()
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", "--failure-grace-period", "0", script, tmp_path)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == 1
    assert (tmp_path / "reported").exists()
    assert not (tmp_path / "signals.1").exists(), "rank 1 was signalled while it reported"
    lines = _failure_lines(err)
    assert lines[0] == "axonml-run: rank 1 failed first (exit code 1)", err
    assert lines[1] == "axonml-run: traceback of rank 1, the first to fail:", err
    assert lines[2].startswith("axonml-run: secondary: rank 0 failed (exit code 1): PeerFailureError: "), err


def test_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        (OUT / f"pid.{RANK}").write_text(str(os.getpid()))
        ready()
        time.sleep(60)
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    for rank in range(2):
        wait_for(tmp_path / f"ready.{rank}")
    pids = [(tmp_path / f"pid.{rank}").read_text() for rank in range(2)]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived their launcher"
        time.sleep(0.01)
    launcher.communicate()


def test_the_root_cause_is_where_the_chain_of_blame_ends() -> None:
    def record(rank: int, at: float, blames: int | None) -> error_file.Record:
        return error_file.Record(rank, "PeerFailureError", "", "", at, blames, reported=True)

    # Rank 2 was killed (no record; its exit was noticed late); rank 0 saw it die, and rank 1 was aborted
    # by rank 0, both before the launcher noticed anything.
    records = {0: record(0, 1.0, 2), 1: record(1, 2.0, 0)}
    assert supervise.root_cause({0: 5.0, 1: 5.0, 2: 5.0}, records) == 2
    # Two independent failures: the earlier one; a rank blamed by nobody still counts; cycles end.
    records = {0: record(0, 3.0, None), 1: record(1, 2.0, None), 2: record(2, 4.0, 1)}
    assert supervise.root_cause({0: 5.0, 2: 5.0}, records) == 1
    assert supervise.root_cause({}, {0: record(0, 1.0, 1), 1: record(1, 2.0, 0)}) == 0
    # A PeerFailureError blaming a rank that did not fail (it exited 0 while its peers waited) stays
    # with the rank that raised it.
    assert supervise.root_cause({1: 5.0}, {1: record(1, 1.0, 0)}) == 1


@pytest.mark.parametrize("from_terminal", [False, True], ids=["kill", "ctrl-c"])
def test_sigint_to_the_launcher_reaches_every_worker_once(tmp_path: Path, from_terminal: bool) -> None:
    # A terminal's Ctrl-C goes to its whole foreground process group: the launcher's. Each worker lingers
    # after its SIGINT, long enough for a duplicate to show up in its log.
    script = worker_script(
        tmp_path,
        """
        signal.signal(signal.SIGINT, record)
        ready()
        while not (OUT / f"signals.{RANK}").exists():
            time.sleep(0.01)
        time.sleep(0.5)
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path, own_group=True)
    for rank in range(2):
        wait_for(tmp_path / f"ready.{rank}")
    if from_terminal:
        os.killpg(launcher.pid, signal.SIGINT)
    else:
        launcher.send_signal(signal.SIGINT)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == -signal.SIGINT
    assert "axonml-run: received SIGINT; forwarded it to ranks 0, 1\n" in err
    for rank in range(2):
        assert (tmp_path / f"signals.{rank}").read_text() == "SIGINT\n"


@pytest.mark.timeout(60)
def test_a_record_blames_the_rank_whose_abort_raised_it() -> None:
    # The launcher's root cause comes from the error's facts: rank 1 aborts, rank 0's barrier fails.
    from axonml_distributed._core import ProcessGroup, ThreadBackend
    from axonml_distributed.exceptions import PeerFailureError

    backends = ThreadBackend.create_world(2, timeout=30.0)
    backends[1].abort("rank 1 gives up")
    with pytest.raises(PeerFailureError) as failure:
        ProcessGroup(backends[0]).barrier()
    record = error_file.record_of(0, failure.type, failure.value, failure.tb)
    assert record.blames == 1, record.message
    other = error_file.record_of(1, ValueError, ValueError("bad"), None)
    assert other.blames is None
