"""Single-host launcher: ``python -m axonml_distributed.run --nproc-per-node N script.py [args...]``.

Starts N worker processes with torchrun's environment and runs them as a gang: the first worker that
fails, or a signal to the launcher, ends all of them (see `supervise`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from axonml_distributed import settings
from axonml_distributed.shm import segment_path
from axonml_distributed.supervise import Worker, say, signal_running, supervise
from axonml_distributed.trace import timeline_file as _timeline

# Every worker runs in its own process group (see `_spawn`), so the signals a terminal sends to its
# foreground group (Ctrl-C, Ctrl-\, hangup) reach the workers only through the launcher: forward them all.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# How long to drain a finished worker's output: a descendant that outlived it may keep the pipe open.
_DRAIN_TIMEOUT = 1.0
# One lock for all output pumps, so that lines of different ranks never interleave mid-line.
_OUTPUT_LOCK = threading.Lock()
# prctl(2) option: the signal a process gets when its parent (the thread that forked it) dies.
_PR_SET_PDEATHSIG = 1

_EPILOG = """\
environment of each worker (torchrun-compatible):
  RANK, LOCAL_RANK          0 .. N-1
  WORLD_SIZE, LOCAL_WORLD_SIZE
                            N
  GROUP_RANK                0 (one host)
  MASTER_ADDR, MASTER_PORT  127.0.0.1 and --master-port, or a port that was free at launch
  AXONML_JOB_ID             128 random bits in hex, new for every job
  AXONML_JOB_SECRET         256 random bits in hex, new for every job and never printed: the workers
                            prove to each other at the rendezvous that they belong to this job
  AXONML_ERROR_FILE         a path of this rank's own in a private directory of the job: an exception
                            that ends a worker's main thread after init_process_group is recorded there
  AXONML_FLIGHT_RECORD_FILE beside it: such a worker dumps its flight records there (see below)
  AXONML_LAUNCHER_PID       the launcher's pid: a process whose parent it names is a worker of the job
                            (the demo tells from it whether to train or to launch)
  OMP_NUM_THREADS           1 if unset and N > 1 (as torchrun does), so N workers do not oversubscribe cores

lifecycle:
  Workers run in their own process groups with stdin from /dev/null, and are killed (SIGKILL) if the
  launcher dies, even by SIGKILL. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher (Ctrl-C in a
  terminal reaches the launcher only) are forwarded once to every worker. When a worker exits non-zero
  or is killed, the others get --failure-grace-period seconds to exit on their own (a failing rank
  aborts the world, so its peers fail at once), then SIGTERM, except the rank that failed first while
  it is still reporting its exception. Workers still running --grace-period seconds after that (or
  after a forwarded signal) are killed with SIGKILL. The job's shared-memory segment is removed at the
  end in any case.

failure summary:
  The launcher names the rank that failed first, the root cause, with its exit code or the signal that
  killed it, and prints its traceback; then the ranks that failed after it (secondary: most fail
  because that rank aborted the world). It decides from the error files, not from the order in which
  processes happen to exit. The launcher reaps a worker as it exits, so on Linux 6.15 and later the
  kernel tells its exit status to its peers, whose PeerFailureError names it.

flight record:
  Each failed worker dumps its flight records (its last calls on each group: AXONML_FLIGHT_RECORDER_
  ENTRIES, default 64). The launcher merges them into one file (--flight-record, or a new file in the
  temporary directory), prints where it is and what it says first; `python -m
  axonml_distributed.trace analyze FILE` says which rank was where and the first call at which ranks
  diverged.

exit status:
  0 when every worker exits 0, 1 when a worker fails; a signalled launcher dies by that same signal.
"""


def launch(argv: Sequence[str] | None = None) -> int:
    """Run the job described by the command line ``argv`` (default: ``sys.argv[1:]``).

    Returns 0 on success, 1 when a worker failed, and ``128 + signal`` when the launcher received a
    forwarded signal. Must be called from the main thread, which owns signal handlers.
    """
    args = _parser().parse_args(argv)
    _timeline.cancel()  # AXONML_TIMELINE is the workers': the launcher merges their parts
    job_id = secrets.token_hex(16)
    nproc: int = args.nproc_per_node
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.script_args]
    env = _job_env(nproc, args.master_port or _free_port(), job_id, prefix_output=args.prefix_output)

    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in _FORWARDED}
    errors = Path(tempfile.mkdtemp(prefix="axonml-run-"))  # mode 0700: the error files are the job's own
    workers: list[Worker] = []
    pumps: list[threading.Thread] = []
    try:
        # Every worker is started before any pump thread: the child runs Python code between fork and
        # exec (`_die_with_launcher`), which is safe only while the launcher has a single thread.
        for rank in range(nproc):
            workers.append(_spawn(command, env, rank, errors, prefix_output=args.prefix_output))
        if args.prefix_output:
            for rank, worker in enumerate(workers):
                pumps += _start_pumps(worker, rank)
        status = supervise(workers, received, args.grace_period, args.failure_grace_period, errors)
        if status == 1:
            _collect_flight_records(errors, nproc, args.flight_record, job_id)
        _merge_timeline(nproc, job_id)
        return status
    finally:
        # The normal paths have reaped every worker; this only matters if the launcher itself failed.
        signal_running(workers, signal.SIGKILL, range(len(workers)))
        for worker in workers:
            worker.wait()
        for pump in pumps:
            pump.join(_DRAIN_TIMEOUT)
        # Usually the backend has unlinked it already; a rank killed during init may have left it behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment_path(job_id))
        shutil.rmtree(errors, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main() -> None:
    """Entry point of ``axonml-run`` and ``python -m axonml_distributed.run``."""
    status = launch()
    if status - 128 in _FORWARDED:
        # Die by the same signal, as Python does on an unhandled KeyboardInterrupt, so that a calling
        # shell sees it (a `for` loop over jobs stops on Ctrl-C instead of starting the next one).
        signal.signal(status - 128, signal.SIG_DFL)
        os.kill(os.getpid(), status - 128)
    sys.exit(status)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="axonml-run",
        description="Run SCRIPT (or a module, with -m) as N data-parallel worker processes on this host.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="number of workers (default: 1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=_at_least(1),
        metavar="P",
        help="MASTER_PORT for the workers (default: a port that is free at launch)",
    )
    parser.add_argument(
        "--prefix-output",
        action="store_true",
        help="prefix each line the workers write to stdout/stderr with '[rank N] ' "
        "(default: workers write straight to the launcher's stdout/stderr)",
    )
    parser.add_argument(
        "--grace-period",
        type=_at_least(0.0),
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM (or a forwarded signal) and SIGKILL (default: 5)",
    )
    parser.add_argument(
        "--failure-grace-period",
        type=_at_least(0.0),
        default=3.0,
        metavar="S",
        help="seconds the other workers get to exit on their own after one fails, before SIGTERM "
        "(default: 3)",
    )
    parser.add_argument(
        "--flight-record",
        type=Path,
        metavar="FILE",
        help="where a failed job's merged flight records go (default: a new file in the temporary "
        "directory, named for the job)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, run like 'python -m SCRIPT'"
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments passed to every worker"
    )
    return parser


def _at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a number of `low`'s type, at least `low`."""
    kind = type(low)

    def convert(text: str) -> float:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in "invalid int value" messages
    return convert


def _free_port() -> int:
    # The kernel hands out a port no socket is using. It is closed again before the workers start, so
    # another program may take it in between (torchrun has the same race), but as soon as rank 0 listens
    # on it no other launch can be given it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _job_env(nproc: int, port: int, job_id: str, *, prefix_output: bool) -> dict[str, str]:
    env = dict(os.environ)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if prefix_output:
        # Python block-buffers stdout into a pipe; the merged log should show lines as they are written.
        env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(
        {
            settings.WORLD_SIZE: str(nproc),
            settings.LOCAL_WORLD_SIZE: str(nproc),
            settings.GROUP_RANK: "0",
            settings.MASTER_ADDR: settings.DEFAULT_MASTER_ADDR,
            settings.MASTER_PORT: str(port),
            settings.JOB_ID: job_id,
            settings.JOB_SECRET: secrets.token_hex(32),
            settings.LAUNCHER_PID: str(os.getpid()),
        }
    )
    return env


def _spawn(
    command: list[str], env: dict[str, str], rank: int, errors: Path, *, prefix_output: bool
) -> Worker:
    # Own session, so own process group (`start_new_session`: `process_group=0` needs Python 3.11): a
    # terminal's Ctrl-C then reaches the launcher alone, and each worker gets exactly one forwarded SIGINT.
    # In the launcher's group (torchrun's way) it would get the terminal's SIGINT and the forwarded one,
    # the second interrupting its cleanup. A group also lets teardown reach the worker's own children. Its
    # cost: the workers have no controlling terminal to read from; stdin is /dev/null instead.
    pipe = subprocess.PIPE if prefix_output else None
    own = {
        settings.RANK: str(rank),
        settings.LOCAL_RANK: str(rank),
        settings.ERROR_FILE: str(errors / f"rank-{rank}.json"),
        settings.FLIGHT_RECORD_FILE: str(errors / f"flight-rank-{rank}.json"),
    }
    return subprocess.Popen(
        command,
        env={**env, **own},
        stdin=subprocess.DEVNULL,
        stdout=pipe,
        stderr=pipe,
        start_new_session=True,
        preexec_fn=_die_with_launcher(os.getpid()),
    )


def _collect_flight_records(errors: Path, nproc: int, destination: Path | None, job_id: str) -> None:
    """Merge the flight records the failed workers dumped into one file; say where it is and what it
    says first."""
    from axonml_distributed import error_file, trace

    found = []
    for rank in range(nproc):
        with contextlib.suppress(OSError, ValueError):
            found.append(trace.read(errors / f"flight-rank-{rank}.json"))
    if not found:
        say("no worker left a flight record")
        return
    merged = trace.merge(found, nproc)
    path = destination or Path(tempfile.gettempdir()) / f"axonml-flight-{job_id[:12]}.json"
    try:
        error_file.write_json(path, merged)
    except OSError as e:
        say(f"could not write the flight record to {path}: {e}")
        return
    ranks = ", ".join(sorted(merged["ranks"], key=int))
    say(f"flight record of ranks {ranks} in {path}: {trace.analyze(merged).summary()}")
    say(f"for each rank's last calls: python -m axonml_distributed.trace analyze {path}")


def _merge_timeline(nproc: int, job_id: str) -> None:
    """AXONML_TIMELINE: merge the parts the workers wrote into the one file, and say where it is."""
    path = settings.timeline_file()
    if path is None:
        return
    ranks = _timeline.merge_parts(path, nproc, job_id)
    if not ranks:
        say(f"no worker wrote a part of the timeline {path}")
        return
    missing = sorted(set(range(nproc)) - set(ranks))
    lacking = f" (no part from ranks {', '.join(map(str, missing))})" if missing else ""
    say(f"timeline of ranks {', '.join(map(str, ranks))} in {path}{lacking}")


def _die_with_launcher(launcher: int) -> Callable[[], None] | None:
    """A preexec_fn that makes the worker die with the launcher: a SIGKILLed launcher cannot tear the
    job down, and its workers must not run on unsupervised. None where prctl(2) is missing (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)

    return arm


def _start_pumps(worker: Worker, rank: int) -> list[threading.Thread]:
    prefix = f"[rank {rank}] ".encode()
    pumps = []
    for source, sink in ((worker.stdout, sys.stdout.buffer), (worker.stderr, sys.stderr.buffer)):
        assert source is not None  # piped by _spawn
        pump = threading.Thread(target=_pump, args=(source, sink, prefix), daemon=True)
        pump.start()
        pumps.append(pump)
    return pumps


def _pump(source: IO[bytes], sink: IO[bytes], prefix: bytes) -> None:
    with source:
        for line in source:
            # A last line without a newline still gets one, so the next rank's prefix starts a line.
            text = prefix + line if line.endswith(b"\n") else prefix + line + b"\n"
            # If our own output is gone (`axonml-run ... | head`), keep draining: a worker writing into a
            # full pipe would block forever.
            with _OUTPUT_LOCK, contextlib.suppress(OSError):
                sink.write(text)
                sink.flush()


if __name__ == "__main__":
    main()
