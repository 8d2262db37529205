"""The launcher (`python -m axonml_distributed.run`), run as a subprocess on small worker scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from axonml_distributed import error_file, run, shm, supervise

pytestmark = pytest.mark.timeout(60)

# The launcher subprocess must import the same copy of the package as this test; OMP_NUM_THREADS is
# dropped so that the launcher's default for it shows.
_ENV = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
_ENV["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(Path(run.__file__).parents[1]), os.environ.get("PYTHONPATH")])
)

# Every worker script starts with this. Workers get the test's tmp_path as their first argument and
# synchronize through files in it: `ready()` once their signal handlers are in place, so that a signal
# sent after `wait_all_ready()` meets the handler and not Python's startup.
_PRELUDE = """\
import json, os, signal, sys, time
from pathlib import Path

RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
OUT = Path(sys.argv[1])

def ready():
    (OUT / f"ready.{RANK}").touch()

def wait_all_ready():
    while len(list(OUT.glob("ready.*"))) < WORLD_SIZE:
        time.sleep(0.01)

def record(signum, frame):
    with open(OUT / f"signals.{RANK}", "a") as log:
        log.write(signal.Signals(signum).name + "\\n")
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(_PRELUDE + textwrap.dedent(body))
    return path


def _start(*args: str | Path, cwd: Path | None = None, own_group: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "axonml_distributed.run", *map(str, args)],
        env=_ENV,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,  # `process_group=0` needs Python 3.11
    )


def _finish(launcher: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _alive(pid: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, merely not yet reaped by its new parent


def test_every_worker_gets_the_torchrun_environment(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "AXONML_JOB_ID", "AXONML_LAUNCHER_PID", "OMP_NUM_THREADS"]
        env = {key: os.environ.get(key) for key in keys}
        secret, errors = os.environ.get("AXONML_JOB_SECRET"), os.environ.get("AXONML_ERROR_FILE")
        errors_dir = os.stat(os.path.dirname(errors))
        private = [errors_dir.st_mode & 0o777, errors_dir.st_uid == os.geteuid()]
        seen = {"env": env, "argv": sys.argv[2:], "secret": secret, "errors": errors, "private": private}
        (OUT / f"env.{RANK}.json").write_text(json.dumps(seen))
    """,
    )
    launcher = _start("--nproc-per-node", "3", script, tmp_path, "--lr", "0.1", "-m", "x")
    out, err = _finish(launcher)
    assert launcher.returncode == 0

    seen = [json.loads((tmp_path / f"env.{rank}.json").read_text()) for rank in range(3)]
    assert all(worker["argv"] == ["--lr", "0.1", "-m", "x"] for worker in seen)
    shared = seen[0]["env"]
    assert 0 < int(shared["MASTER_PORT"]) < 65536
    assert len(shared["AXONML_JOB_ID"]) == 32
    int(shared["AXONML_JOB_ID"], 16)
    # One secret for the whole job, 256 bits, never printed.
    secret = seen[0]["secret"]
    assert len(secret) == 64 and int(secret, 16) and all(worker["secret"] == secret for worker in seen)
    assert secret not in out + err
    # A distinct error file per rank, in one directory only the launcher's user can enter, removed after.
    errors = [Path(worker["errors"]) for worker in seen]
    assert len(set(errors)) == 3 and len({path.parent for path in errors}) == 1
    assert all(worker["private"] == [0o700, True] for worker in seen)
    assert not errors[0].parent.exists()
    for rank, worker in enumerate(seen):
        assert worker["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": shared["MASTER_PORT"],
            "AXONML_JOB_ID": shared["AXONML_JOB_ID"],
            "AXONML_LAUNCHER_PID": str(launcher.pid),
            "OMP_NUM_THREADS": "1",
        }


def test_every_worker_leads_its_own_session_and_process_group(tmp_path: Path) -> None:
    # A new session (start_new_session, Python 3.10) rather than only a new group (process_group=0, 3.11).
    script = _script(
        tmp_path,
        """
        pid = os.getpid()
        (OUT / f"ids.{RANK}.json").write_text(json.dumps([os.getpgid(0) == pid, os.getsid(0) == pid]))
    """,
    )
    launcher = _start("--nproc-per-node", "2", script, tmp_path)
    _finish(launcher)
    assert launcher.returncode == 0
    for rank in range(2):
        assert json.loads((tmp_path / f"ids.{rank}.json").read_text()) == [True, True]


def test_segment_name_uses_the_effective_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    # The backend names the segment with geteuid(); under setuid the real uid would name another file.
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert shm.segment_name("ab12") == "/axonml-4242-ab12"


def test_concurrent_jobs_get_distinct_ports_and_job_ids(tmp_path: Path) -> None:
    # Job "a" keeps listening on its MASTER_PORT, as a rank 0 store would, until job "b" has run.
    script = _script(
        tmp_path,
        """
        import socket
        with socket.create_server(("127.0.0.1", int(os.environ["MASTER_PORT"]))):
            keys = ["MASTER_PORT", "AXONML_JOB_ID", "AXONML_JOB_SECRET"]
            (OUT / f"{sys.argv[2]}.json").write_text(json.dumps({key: os.environ[key] for key in keys}))
            while not (OUT / "b.json").exists():
                time.sleep(0.01)
    """,
    )
    first = _start(script, tmp_path, "a")
    _wait_for(tmp_path / "a.json")
    second = _start(script, tmp_path, "b")
    _finish(second)
    _finish(first)
    assert first.returncode == second.returncode == 0

    a, b = (json.loads((tmp_path / f"{job}.json").read_text()) for job in "ab")
    assert a["MASTER_PORT"] != b["MASTER_PORT"]
    assert a["AXONML_JOB_ID"] != b["AXONML_JOB_ID"]
    assert a["AXONML_JOB_SECRET"] != b["AXONML_JOB_SECRET"]


def test_failed_worker_ends_the_job_quickly(tmp_path: Path) -> None:
    script = _script(
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
    launcher = _start("--nproc-per-node", "3", script, tmp_path)
    _, err = _finish(launcher)
    assert time.monotonic() - started < 10
    assert launcher.returncode == 1
    assert "axonml-run: rank 1 failed (exit code 3); terminated ranks 0, 2\n" in err


def test_teardown_reaches_the_children_of_workers(tmp_path: Path) -> None:
    script = _script(
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
    launcher = _start("--nproc-per-node", "2", script, tmp_path)
    _finish(launcher)
    assert launcher.returncode == 1
    child = (tmp_path / "child").read_text()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the worker's child survived the teardown"
        time.sleep(0.01)


def test_worker_killed_by_a_signal_is_named(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        ready()
        if RANK == 0:
            wait_all_ready()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    launcher = _start("--nproc-per-node", "2", script, tmp_path)
    _, err = _finish(launcher)
    assert launcher.returncode == 1
    assert "axonml-run: rank 0 failed (killed by SIGKILL); terminated rank 1\n" in err


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = _script(
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
    launcher = _start("--nproc-per-node", "2", "--grace-period", "1", script, tmp_path)
    _, err = _finish(launcher)
    assert 1 <= time.monotonic() - started < 10
    assert launcher.returncode == 1
    assert "axonml-run: rank 0 failed (exit code 3); terminated rank 1\n" in err
    assert "axonml-run: rank 1 still running 1 s after SIGTERM; sent SIGKILL\n" in err
    assert (tmp_path / "signals.1").read_text() == "SIGTERM\n"


def _failure_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("axonml-run: ")]


def test_the_rank_that_failed_first_is_named_not_the_first_to_exit(tmp_path: Path) -> None:
    # Rank 3 raises while its peers wait in an all_reduce: its abort makes them fail at once, and a
    # non-daemon thread keeps it alive after that, so they exit before it does.
    script = _script(
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
    launcher = _start("--nproc-per-node", "4", script, tmp_path)
    _, err = _finish(launcher)
    assert launcher.returncode == 1
    lines = _failure_lines(err)
    assert lines[0].startswith("axonml-run: rank 3 failed ("), err
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
    script = _script(
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
    launcher = _start("--nproc-per-node", "2", "--failure-grace-period", "0", script, tmp_path)
    _, err = _finish(launcher)
    assert launcher.returncode == 1
    assert (tmp_path / "reported").exists()
    assert not (tmp_path / "signals.1").exists(), "rank 1 was signalled while it reported"
    lines = _failure_lines(err)
    assert lines[0] == "axonml-run: rank 1 failed (exit code 1)", err
    assert lines[1] == "axonml-run: traceback of rank 1, the first to fail:", err
    assert lines[2].startswith("axonml-run: secondary: rank 0 failed (exit code 1): PeerFailureError: "), err


def test_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        (OUT / f"pid.{RANK}").write_text(str(os.getpid()))
        ready()
        time.sleep(60)
    """,
    )
    launcher = _start("--nproc-per-node", "2", script, tmp_path)
    for rank in range(2):
        _wait_for(tmp_path / f"ready.{rank}")
    pids = [(tmp_path / f"pid.{rank}").read_text() for rank in range(2)]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
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
    script = _script(
        tmp_path,
        """
        signal.signal(signal.SIGINT, record)
        ready()
        while not (OUT / f"signals.{RANK}").exists():
            time.sleep(0.01)
        time.sleep(0.5)
    """,
    )
    launcher = _start("--nproc-per-node", "2", script, tmp_path, own_group=True)
    for rank in range(2):
        _wait_for(tmp_path / f"ready.{rank}")
    if from_terminal:
        os.killpg(launcher.pid, signal.SIGINT)
    else:
        launcher.send_signal(signal.SIGINT)
    _, err = _finish(launcher)
    assert launcher.returncode == -signal.SIGINT
    assert "axonml-run: received SIGINT; forwarded it to ranks 0, 1\n" in err
    for rank in range(2):
        assert (tmp_path / f"signals.{rank}").read_text() == "SIGINT\n"


def test_prefix_output_tags_every_line_with_its_rank(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
        sys.stdout.write(f"no newline {RANK}")
    """,
    )
    launcher = _start("--nproc-per-node", "2", "--prefix-output", script, tmp_path)
    out, err = _finish(launcher)
    assert launcher.returncode == 0
    assert sorted(out.splitlines()) == [
        "[rank 0] no newline 0",
        "[rank 0] out 0",
        "[rank 1] no newline 1",
        "[rank 1] out 1",
    ]
    assert sorted(err.splitlines()) == ["[rank 0] err 0", "[rank 1] err 1"]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_leftover_segment_is_removed_after_sigkilled_workers(tmp_path: Path) -> None:
    # Rank 0 plays a backend killed between creating the segment and unlinking it.
    script = _script(
        tmp_path,
        """
        segment = f"/dev/shm/axonml-{os.geteuid()}-{os.environ['AXONML_JOB_ID']}"
        if RANK == 0:
            os.close(os.open(segment, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            (OUT / "segment.json").write_text(json.dumps([os.environ["AXONML_JOB_ID"], segment]))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    launcher = _start("--nproc-per-node", "2", script, tmp_path)
    _finish(launcher)
    assert launcher.returncode == 1
    job_id, segment = json.loads((tmp_path / "segment.json").read_text())
    assert segment == "/dev/shm" + shm.segment_name(job_id)
    assert not Path(segment).exists()


def test_module_mode_runs_a_module(tmp_path: Path) -> None:
    (tmp_path / "axonml_launcher_test_module.py").write_text(
        _PRELUDE
        + textwrap.dedent("""
        (OUT / f"module.{RANK}").write_text(json.dumps(sys.argv))
    """)
    )
    launcher = _start("--nproc-per-node", "2", "-m", "axonml_launcher_test_module", tmp_path, cwd=tmp_path)
    _finish(launcher)
    assert launcher.returncode == 0
    for rank in range(2):
        argv = json.loads((tmp_path / f"module.{rank}").read_text())
        assert argv == [str(tmp_path / "axonml_launcher_test_module.py"), str(tmp_path)]


def test_launch_returns_the_job_status_and_restores_signal_handlers(tmp_path: Path) -> None:
    script = _script(tmp_path, "sys.exit(int(sys.argv[2]) if RANK == 1 else 0)\n")
    handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
    assert run.launch(["--nproc-per-node", "2", str(script), str(tmp_path), "0"]) == 0
    assert run.launch(["--nproc-per-node", "2", str(script), str(tmp_path), "4"]) == 1
    assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers
