"""Supervising the launcher's workers as a gang: noticing the first failure, forwarding signals, ending
the others with a grace period, and naming the root cause from the workers' error files."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from axonml_distributed import error_file

Worker = subprocess.Popen[bytes]

# A forwarded signal is noticed within this long. Polling is simpler than waiting on child exits and
# signals at once, and 20 wake-ups a second cost nothing measurable. A worker's exit wakes the poll at once
# (`_pause`).
_POLL_INTERVAL = 0.05


def supervise(
    workers: list[Worker], received: list[int], grace: float, failure_grace: float, errors: Path
) -> int:
    """Wait until every worker exits 0 (returns 0), one fails (1), or a signal arrives (128 + signal)."""
    failed_at: dict[int, float] = {}  # rank -> time.time() when its failure was noticed
    exits = _exit_fds(workers)
    try:
        while True:
            if received:
                return _forward(workers, received[0], grace)
            codes = _note_failures(workers, failed_at)
            if failed_at:
                return _end_after_failure(workers, exits, received, grace, failure_grace, errors, failed_at)
            if all(code == 0 for code in codes):
                return 0
            _pause(workers, exits)
    finally:
        for fd in exits:
            if fd is not None:
                os.close(fd)


def _exit_fds(workers: list[Worker]) -> list[int | None]:
    """A pidfd of each worker (None where the kernel has none): readable once it exits."""
    fds: list[int | None] = []
    for worker in workers:
        try:
            fds.append(os.pidfd_open(worker.pid))  # not reaped yet: the pid is still the worker's
        except (AttributeError, OSError):  # not Linux, or older than 5.3
            fds.append(None)
    return fds


def _pause(workers: list[Worker], exits: list[int | None]) -> None:
    """Sleep `_POLL_INTERVAL`, or until a running worker exits: it is then reaped at once, and the kernel
    tells its exit status to its peers, which wait a moment for it to name it in their errors (Linux
    6.15; rust/transport/shm/liveness.rs)."""
    running = [
        fd for worker, fd in zip(workers, exits, strict=True) if fd is not None and worker.returncode is None
    ]
    if not running:
        time.sleep(_POLL_INTERVAL)
        return
    exited = select.poll()  # not select.select: no limit on the descriptors' numbers
    for fd in running:
        exited.register(fd, select.POLLIN)
    exited.poll(_POLL_INTERVAL * 1000)


def _note_failures(workers: list[Worker], failed_at: dict[int, float]) -> list[int | None]:
    """Poll every worker; note when a failure (non-zero exit) is first seen. Returns the exit codes."""
    codes = [worker.poll() for worker in workers]
    now = time.time()
    for rank, code in enumerate(codes):
        if code and rank not in failed_at:
            failed_at[rank] = now
    return codes


def _forward(workers: list[Worker], signum: int, grace: float) -> int:
    sig = signal.Signals(signum)
    ranks = signal_running(workers, sig, range(len(workers)))
    say(f"received {sig.name}" + (f"; forwarded it to {_ranks(ranks)}" if ranks else ""))
    _reap(workers, ranks, sig, grace)
    return 128 + sig


def _end_after_failure(
    workers: list[Worker],
    exits: list[int | None],
    received: list[int],
    grace: float,
    failure_grace: float,
    errors: Path,
    failed_at: dict[int, float],
) -> int:
    """A worker failed: give the others `failure_grace` seconds to exit on their own (an aborted world
    makes them fail within moments), terminate the rest, then report the root cause first."""
    everyone = range(len(workers))
    deadline = time.monotonic() + failure_grace
    while time.monotonic() < deadline and any(worker.poll() is None for worker in workers):
        if received:
            return _forward(workers, received[0], grace)
        _pause(workers, exits)
        _note_failures(workers, failed_at)
    records = _read_records(errors, len(workers))
    root = root_cause(failed_at, records)
    record = records.get(root)
    # The root cause's report is the one that matters most: a rank still printing it gets no SIGTERM,
    # only --grace-period seconds more to finish and exit on its own.
    reporting = record is not None and not record.reported and workers[root].poll() is None
    spared = (root,) if reporting else ()
    terminated = signal_running(workers, signal.SIGTERM, [rank for rank in everyone if rank not in spared])
    _reap(workers, terminated, signal.SIGTERM, grace, spared)
    _summarize(workers, root, terminated, failed_at, _read_records(errors, len(workers)))
    return 1


def _read_records(errors: Path, nproc: int) -> dict[int, error_file.Record]:
    found = {rank: error_file.read(errors / f"rank-{rank}.json") for rank in range(nproc)}
    return {rank: record for rank, record in found.items() if record is not None}


def root_cause(failed_at: dict[int, float], records: dict[int, error_file.Record]) -> int:
    """The rank whose failure came first. A rank whose record blames another failed rank (its world was
    aborted by it, or it saw it die) failed because of that one; of the ranks the chains lead to, the one
    that failed earliest (by its record's time, else by when its exit was noticed) is the root cause."""
    when = {**failed_at, **{rank: record.time for rank, record in records.items()}}

    def origin(rank: int) -> int:
        seen = {rank}
        while True:
            record = records.get(rank)
            blamed = None if record is None else record.blames
            if blamed is None or blamed not in when or blamed in seen:
                return rank
            rank = blamed
            seen.add(rank)

    return min({origin(rank) for rank in when}, key=lambda rank: (when[rank], rank))


def _summarize(
    workers: list[Worker],
    root: int,
    terminated: list[int],
    failed_at: dict[int, float],
    records: dict[int, error_file.Record],
) -> None:
    """Name the root cause with its traceback, then the secondary failures, grouped by how they failed."""
    codes = [worker.wait() for worker in workers]
    say(
        f"rank {root} failed first ({_describe(codes[root])})"
        + (f"; terminated {_ranks(sorted(terminated))}" if terminated else "")
    )
    if codes[root] == -signal.SIGKILL:
        say(
            "SIGKILL is sent by kill -9, and by the kernel's OOM killer when memory runs out "
            "('dmesg' or 'journalctl -k' name the processes it killed)"
        )
    record = records.get(root)
    if record is not None:
        say(f"traceback of rank {root}, the first to fail:\n{record.traceback.rstrip()}")
    # Secondary: every other rank that failed on its own, before the launcher signalled it.
    groups: dict[str, list[int]] = {}
    for rank in sorted((set(failed_at) | set(records)) - {root}):
        other = records.get(rank)
        how = f"({_describe(codes[rank])})" + (f": {other.type}: {other.message}" if other else "")
        groups.setdefault(how, []).append(rank)
    for how, ranks in groups.items():
        say(f"secondary: {_ranks(ranks)} failed {how}")


def _reap(
    workers: list[Worker], ranks: list[int], sent: signal.Signals, grace: float, spared: Sequence[int] = ()
) -> None:
    """Give `ranks`, just sent `sent`, and the `spared` ranks (not signalled) `grace` seconds to exit,
    then SIGKILL them."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(workers[rank].poll() is None for rank in [*ranks, *spared]):
        time.sleep(_POLL_INTERVAL)
    stubborn = signal_running(workers, signal.SIGKILL, ranks)
    if stubborn:
        say(f"{_ranks(stubborn)} still running {grace:g} s after {sent.name}; sent SIGKILL")
    stubborn = signal_running(workers, signal.SIGKILL, spared)
    if stubborn:
        say(f"{_ranks(stubborn)} (spared {sent.name}) still running {grace:g} s later; sent SIGKILL")
    for rank in [*ranks, *spared]:
        workers[rank].wait()


def signal_running(workers: list[Worker], sig: int, ranks: Sequence[int]) -> list[int]:
    """Send `sig` to the process group of each of `ranks` still running; return those ranks."""
    running = [rank for rank in ranks if workers[rank].poll() is None]
    for rank in running:
        # Only groups of unreaped workers are signalled: their pid, which names the group, cannot have
        # been reused by an unrelated process.
        try:
            os.killpg(workers[rank].pid, sig)
        except ProcessLookupError:  # the worker moved to another group; reach it at least
            workers[rank].send_signal(sig)
    return running


def _describe(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-code}"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def say(message: str) -> None:
    # After SIGHUP, stderr may be a terminal that is gone; the teardown must go on regardless.
    with contextlib.suppress(OSError):
        print(f"axonml-run: {message}", file=sys.stderr, flush=True)
