"""The timeline of a job: every collective of every rank (not only the flight recorder's last calls),
the gradient buckets of the DDPs and the user's spans (`trace_span`), written as one Chrome trace
(`chrome`) to open in https://ui.perfetto.dev or chrome://tracing.

Turned on for a block by ``with timeline(path):``, or for the whole process by AXONML_TIMELINE=path
(from the package's import to the process's exit). One timeline at a time per process. While it is
on, the engine logs each call as it finishes, about 100 bytes a call, until the timeline is written.

Worlds:
- the thread world (`spawn`): one process holds every rank, so its file holds them all;
- the shared-memory world of processes (and the torch backend "axonml", which runs on the same
  engine): each process writes its part, ``path.rank{R}`` (R its rank in the job: across hosts, where
  each host's world numbers its ranks from 0, the job's, `record.to_job_ranks`), when its timeline ends. For
  AXONML_TIMELINE under axonml-run, the launcher merges the parts into ``path`` after the job,
  whatever its outcome, and removes them. Otherwise (a `timeline()` block, or another launcher) rank
  0 merges them when its own timeline ends, after waiting up to `MERGE_WAIT` seconds for the others'
  parts (ranks whose part is still missing then are left out, with a warning); not at all when its
  block, or the process, ended with an exception: it merges the parts already there.

Clocks: every span is stamped with the engine's wall clock (`_core.wall_ns`: the realtime clock read
once per process, advanced by the monotonic clock), the same clock for every process on a host, so the
ranks line up to the precision of that clock (exact in one process).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from axonml_distributed import _core, settings
from axonml_distributed.error_file import write_json
from axonml_distributed.trace import spans
from axonml_distributed.trace.chrome import chrome_trace, engine_spans
from axonml_distributed.trace.record import to_job_ranks

PART_FORMAT = "axonml-timeline-part"
PART_VERSION = 1
# How long rank 0, outside axonml-run, waits for the other processes' parts before it merges.
MERGE_WAIT = 60.0
_POLL = 0.05

# The path of the timeline on in this process, if any.
_active: str | None = None


def part_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Where the process of global rank `rank` writes its part of the timeline `path`."""
    return Path(f"{os.fspath(path)}.rank{rank}")


def start(path: str | os.PathLike[str]) -> None:
    """Turn the timeline on, to be written to `path` by `finish`; RuntimeError when one is on already.
    The file's directory is made now, so that a path that cannot be written fails before the job."""
    global _active
    if _active is not None:
        raise RuntimeError(f"a timeline is already on in this process (to {_active}): one at a time")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Absolute: a process that changes directory still writes where its launcher (or rank 0) looks.
    _active = os.path.abspath(path)
    _core.take_timeline()  # what an earlier timeline left
    spans.start()
    _core.set_timeline(True)


def finish(wait: bool = True) -> Path | None:
    """Turn the timeline off and write it (see the module's docs); returns the file written, the whole
    timeline's or this process's part; None when none was on, or nothing was recorded (a process that
    made no call, such as a tool run with AXONML_TIMELINE still set, leaves the file alone). `wait`:
    whether rank 0 waits for the other parts (`MERGE_WAIT`) or merges those already there."""
    global _active
    path, _active = _active, None
    if path is None:
        return None
    _core.set_timeline(False)
    records = _core.take_timeline()
    job_size = to_job_ranks(records)
    engine = engine_spans(records)
    kept = engine + spans.stop()
    if not kept:
        return None
    sizes = [r["world_size"] for r in records]
    if job_size is not None:
        world_size = job_size
    else:
        world_size = max(sizes) if sizes else settings.world_size() or 1
    held = {r["rank"] for r in records}
    # A span whose rank nothing named is the process's: the one rank its groups hold, else rank 0.
    mine = min(held) if len(held) == 1 else 0
    for span in kept:
        if span["rank"] is None:
            span["rank"] = mine
    ranks = held | {s["rank"] for s in kept}
    if ranks >= set(range(world_size)):
        write_json(path, chrome_trace(kept, world_size))
        return Path(path)
    me = min(ranks)
    part = part_path(path, me)
    write_json(
        part,
        {
            "format": PART_FORMAT,
            "version": PART_VERSION,
            "job": job_key(),
            "world_size": world_size,
            "ranks": sorted(ranks),
            "spans": kept,
        },
    )
    if me != 0 or (settings.launched_by_axonml_run() and _is_environment_s(path)):
        return part  # rank 0 merges, or the launcher after the job (its AXONML_TIMELINE)
    merged = merge_parts(path, world_size, job_key(), wait=MERGE_WAIT if wait else 0.0)
    return Path(path) if merged else part


@contextlib.contextmanager
def timeline(path: str | os.PathLike[str]) -> Iterator[None]:
    """Record the timeline of the block and write it to `path` (JSON, a Chrome trace) at its end.

    Use it around `spawn` for the thread world; in a process of the shared-memory world each process
    enters it (see the module's docs for how the parts become one file). One timeline at a time: a
    RuntimeError when one is on already (AXONML_TIMELINE, say).

    A block that raises still writes this process's part, but rank 0 merges only the parts already
    there (the others may never come), and a failure to write is a warning: the block's exception is
    the one that propagates."""
    start(path)
    try:
        yield
    except BaseException:
        try:
            finish(wait=False)
        except Exception as e:  # noqa: BLE001 - said, but the block's exception is the one to see
            warnings.warn(f"timeline {path} not written: {e!r}", stacklevel=3)
        raise
    finish()


def merge_parts(path: str | os.PathLike[str], world_size: int, job: str, wait: float = 0.0) -> list[int]:
    """Merge the parts of job `job` (`job_key`) of the timeline `path` into it and remove them, once they
    cover every rank of `world_size` or after `wait` seconds; returns the ranks merged (none: no part,
    nothing written). Parts of another job are left alone."""
    deadline = time.monotonic() + wait
    while True:
        found = _parts(path, job)
        covered = {r for content, _ in found for r in content["ranks"]}
        if covered >= set(range(world_size)) or time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    if not found:
        return []
    missing = sorted(set(range(world_size)) - covered)
    if missing:
        warnings.warn(f"timeline {path}: no part from ranks {missing}, merged without them", stacklevel=2)
    kept = [span for content, _ in found for span in content["spans"]]
    size = max([world_size] + [content["world_size"] for content, _ in found])
    write_json(path, chrome_trace(kept, size))
    for _, part in found:
        with contextlib.suppress(OSError):
            part.unlink()
    return sorted(covered)


def _parts(path: str | os.PathLike[str], job: str) -> Sequence[tuple[dict[str, Any], Path]]:
    """The parts of job `job` beside `path`, read."""
    base = Path(path)
    found = []
    for part in sorted(base.parent.glob(f"{base.name}.rank*")):
        with contextlib.suppress(OSError, ValueError):
            content = json.loads(part.read_text())
            if (
                content.get("format") == PART_FORMAT
                and content.get("version") == PART_VERSION
                and content.get("job") == job
            ):
                found.append((content, part))
    return found


def job_key() -> str:
    """What tells this job's parts from another's: the launcher's job id (AXONML_JOB_ID), else the
    rendezvous."""
    return settings.job_id() or f"{settings.master_addr()}:{settings.master_port()}"


def _is_environment_s(path: str) -> bool:
    """Whether `path` (absolute, as `start` keeps it) is AXONML_TIMELINE's."""
    named = settings.timeline_file()
    return named is not None and os.path.abspath(named) == path


def from_environment() -> None:
    """AXONML_TIMELINE: turn the timeline on for the whole process, written when it exits. A path whose
    directory cannot be made is a warning and no timeline: this runs at the package's import, which
    torch makes through its backend entry point, so raising would break every ``import torch``."""
    path = settings.timeline_file()
    if path is not None and _active is None:
        try:
            start(path)
        except OSError as e:
            warnings.warn(
                f"{settings.TIMELINE}={path}: its directory cannot be made ({e}); no timeline", stacklevel=2
            )
            return
        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    # An exception that ended the process (the interpreter keeps it as sys.last_value): as a
    # `timeline` block that raised, rank 0 merges the parts already there rather than wait for ranks
    # that may have failed too.
    finish(wait=not hasattr(sys, "last_value"))


def cancel() -> None:
    """Turn the timeline off without writing it (the launcher, which only merges its workers')."""
    global _active
    if _active is not None:
        _active = None
        _core.set_timeline(False)
        _core.take_timeline()
        spans.stop()
