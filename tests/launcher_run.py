"""Running the launcher (`python -m axonml_distributed.run`) as a subprocess on small worker scripts, for
the launcher tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from axonml_distributed import run

# The launcher subprocess must import the same copy of the package as this test; OMP_NUM_THREADS is
# dropped so that the launcher's default for it shows.
LAUNCHER_ENV = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
LAUNCHER_ENV["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(Path(run.__file__).parents[1]), os.environ.get("PYTHONPATH")])
)


# Every worker script starts with this. Workers get the test's tmp_path as their first argument and
# synchronize through files in it: `ready()` once their signal handlers are in place, so that a signal
# sent after `wait_all_ready()` meets the handler and not Python's startup.
PRELUDE = """\
import json, os, signal, sys, time
from pathlib import Path

from axonml_distributed import run

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


def worker_script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def start_launcher(
    *args: str | Path, cwd: Path | None = None, own_group: bool = False
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "axonml_distributed.run", *map(str, args)],
        env=LAUNCHER_ENV,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,  # `process_group=0` needs Python 3.11
    )


def finish_launcher(launcher: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def alive(pid: str) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, merely not yet reaped by its new parent
