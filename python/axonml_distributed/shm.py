"""The multi-process world on one host, through a shared-memory segment (backend "shm").

Processes find each other through rank 0, which listens on MASTER_ADDR:MASTER_PORT while the job starts
(so jobs with different ports never mix); after that everything goes through one /dev/shm segment that
is already unlinked, so nothing is left behind even if every rank is killed.
"""

from __future__ import annotations

import os
import stat
import time

from axonml_distributed import settings
from axonml_distributed._core import (
    SEGMENT_DIR,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    ProcessGroup,
    ShmBackend,
    segment_name,
)
from axonml_distributed.hosts.layout import proof_creator

# The header fields the cleanup reads come first in every segment: the core names where each lies.
_HEADER_BYTES = max(offset + size for offset, size in SEGMENT_HEADER.values())


def segment_path(job_id: str) -> str:
    """The file of job ``job_id``'s shared-memory segment (``segment_name`` is the backend's name)."""
    return SEGMENT_DIR + segment_name(job_id)


def init_shm_process_group(rank: int, world_size: int, timeout: float | None = None) -> ProcessGroup:
    """Join the shared-memory world as ``rank`` of ``world_size`` and return the group of every rank.

    Reads MASTER_ADDR (default 127.0.0.1), MASTER_PORT (required), AXONML_JOB_SECRET (set by axonml-run:
    hex digits of at least 16 random bytes, the same for every rank; only processes that know it can
    join the job, and without it any process of the same user can), AXONML_JOB_ID (set by axonml-run:
    names the segment so the launcher can remove it after a crash) and AXONML_SHM_ARENA_MB (room per
    rank for ``ProcessGroup.empty`` arrays, default 64; arrays that do not fit fall back to private
    memory), all through `axonml_distributed.settings`. Rank 0's core also reads AXONML_SHM_CHUNK_KIB,
    the pipeline round size for large messages on private arrays (default 1024), a tuning knob.
    ``timeout`` bounds the rendezvous and every later wait (seconds, default 300).
    """
    port = settings.master_port()
    if port is None:
        raise ValueError(
            f"{settings.MASTER_PORT} is not set: start the job with axonml-run, or set it (and "
            f"{settings.MASTER_ADDR})"
        )
    backend = ShmBackend.connect(
        rank,
        world_size,
        settings.master_addr(),
        port,
        timeout=timeout,
        job_id=settings.job_id(),
        arena_bytes=settings.shm_arena_bytes(),
        secret=settings.job_secret(),
    )
    return ProcessGroup(backend)


def cleanup_stale_segments(min_age: float = 60.0) -> list[str]:
    """Remove segments that crashed jobs of this user left in /dev/shm; returns the removed names.

    A job's segment has a name only while its ranks start up (it is unlinked once all have attached,
    and axonml-run removes it after any crash), so a leftover exists only when a job without the
    launcher died during start-up. Only files named ``axonml-<our uid>-*``, owned by us, carrying our
    header (or none yet: empty or zero-filled, its creator killed before writing it), older than
    ``min_age`` seconds, whose creating process no longer exists are removed: never a live job's
    segment, nor anything of other users or programs. The same goes for the proof objects
    of a job over several hosts (``axonml-proof-<our uid>-<creator pid>-*``, `hosts.layout`), which live
    while its ranks find their hosts: one whose creator is gone was left by a process killed then.
    """
    removed = []
    prefix = segment_name("").lstrip("/")
    for name in sorted(os.listdir(SEGMENT_DIR)):
        proof_by = proof_creator(name)
        if not name.startswith(prefix) and proof_by is None:
            continue
        path = os.path.join(SEGMENT_DIR, name)
        try:
            # Never follow a symbolic link, nor block on a FIFO planted under our prefix.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            head = os.read(fd, _HEADER_BYTES)
        finally:
            os.close(fd)
        if st.st_uid != os.geteuid() or time.time() - st.st_mtime < min_age:
            continue
        creator: int | None = proof_by
        if proof_by is None:  # a segment: its header says it is ours and who made it
            if not head.strip(b"\0"):
                # Empty or zero-filled: its creator was killed between creating the name and writing
                # the header (a few microseconds); no rank can attach to it, and the age rules out a
                # creation under way.
                creator = None
            elif len(head) < _HEADER_BYTES or _field(head, "magic") != SEGMENT_MAGIC:
                continue
            else:
                creator = _field(head, "creator")
        if creator is not None and _alive(creator):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append("/" + name)
    return removed


def _field(head: bytes, name: str) -> int:
    offset, size = SEGMENT_HEADER[name]
    return int.from_bytes(head[offset : offset + size], "little")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
