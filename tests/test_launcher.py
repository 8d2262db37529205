"""The launcher (`python -m axonml_distributed.run`): the workers' environment, sessions and ports, the
job's segment name, output prefixes, module mode, the job status; run as a subprocess (see launcher_run)."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from axonml_distributed import run, shm
from launcher_run import PRELUDE, finish_launcher, start_launcher, wait_for, worker_script

pytestmark = pytest.mark.timeout(60)


def test_every_worker_gets_the_torchrun_environment(tmp_path: Path) -> None:
    script = worker_script(
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
    launcher = start_launcher("--nproc-per-node", "3", script, tmp_path, "--lr", "0.1", "-m", "x")
    out, err = finish_launcher(launcher)
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
    script = worker_script(
        tmp_path,
        """
        pid = os.getpid()
        (OUT / f"ids.{RANK}.json").write_text(json.dumps([os.getpgid(0) == pid, os.getsid(0) == pid]))
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    finish_launcher(launcher)
    assert launcher.returncode == 0
    for rank in range(2):
        assert json.loads((tmp_path / f"ids.{rank}.json").read_text()) == [True, True]


def test_segment_name_uses_the_effective_uid() -> None:
    # The launcher removes the file the backend names with geteuid() (under setuid the real uid would
    # name another file): the one name builder, the core's.
    assert shm.segment_name("ab12") == f"/axonml-{os.geteuid()}-ab12"
    assert shm.segment_path("ab12") == f"/dev/shm/axonml-{os.geteuid()}-ab12"


def test_concurrent_jobs_get_distinct_ports_and_job_ids(tmp_path: Path) -> None:
    # Job "a" keeps listening on its MASTER_PORT, as a rank 0 store would, until job "b" has run.
    script = worker_script(
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
    first = start_launcher(script, tmp_path, "a")
    wait_for(tmp_path / "a.json")
    second = start_launcher(script, tmp_path, "b")
    finish_launcher(second)
    finish_launcher(first)
    assert first.returncode == second.returncode == 0

    a, b = (json.loads((tmp_path / f"{job}.json").read_text()) for job in "ab")
    assert a["MASTER_PORT"] != b["MASTER_PORT"]
    assert a["AXONML_JOB_ID"] != b["AXONML_JOB_ID"]
    assert a["AXONML_JOB_SECRET"] != b["AXONML_JOB_SECRET"]


def test_prefix_output_tags_every_line_with_its_rank(tmp_path: Path) -> None:
    script = worker_script(
        tmp_path,
        """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
        sys.stdout.write(f"no newline {RANK}")
    """,
    )
    launcher = start_launcher("--nproc-per-node", "2", "--prefix-output", script, tmp_path)
    out, err = finish_launcher(launcher)
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
    script = worker_script(
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
    launcher = start_launcher("--nproc-per-node", "2", script, tmp_path)
    finish_launcher(launcher)
    assert launcher.returncode == 1
    job_id, segment = json.loads((tmp_path / "segment.json").read_text())
    assert segment == "/dev/shm" + shm.segment_name(job_id)
    assert not Path(segment).exists()


def test_module_mode_runs_a_module(tmp_path: Path) -> None:
    (tmp_path / "axonml_launcher_test_module.py").write_text(
        PRELUDE
        + textwrap.dedent("""
        (OUT / f"module.{RANK}").write_text(json.dumps(sys.argv))
    """)
    )
    module = "axonml_launcher_test_module"
    launcher = start_launcher("--nproc-per-node", "2", "-m", module, tmp_path, cwd=tmp_path)
    finish_launcher(launcher)
    assert launcher.returncode == 0
    for rank in range(2):
        argv = json.loads((tmp_path / f"module.{rank}").read_text())
        assert argv == [str(tmp_path / "axonml_launcher_test_module.py"), str(tmp_path)]


def test_launch_returns_the_job_status_and_restores_signal_handlers(tmp_path: Path) -> None:
    script = worker_script(tmp_path, "sys.exit(int(sys.argv[2]) if RANK == 1 else 0)\n")
    handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
    assert run.launch(["--nproc-per-node", "2", str(script), str(tmp_path), "0"]) == 0
    assert run.launch(["--nproc-per-node", "2", str(script), str(tmp_path), "4"]) == 1
    assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers
