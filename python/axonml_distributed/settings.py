"""Every environment variable the package reads or the launcher sets: named, and parsed, here alone.

Each reader looks at the environment when it is called, so a script may set a variable before
`init_process_group`; unset or empty means the default, and a value that cannot be used is a ValueError
naming the variable. The core's own knobs (AXONML_WAIT_SPIN_US, AXONML_WAIT_YIELD_US, AXONML_WAIT_MOVE,
AXONML_SHM_CHUNK_KIB, AXONML_SHM_CMA) are read by the core alone, in rust/config.rs.
"""

from __future__ import annotations

import os
import re

# Shortest job secret: the core's (JobSecret::MIN_BYTES in rust/rendezvous/secret.rs), which checks it.
from axonml_distributed._core import JOB_SECRET_MIN_BYTES as JOB_SECRET_MIN_BYTES
from axonml_distributed._core import SEGMENT_DIR, check_job_secret

# torchrun's variables: the launcher sets them, `init_process_group("shm")` reads the first four.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
# Ours. The launcher sets the first four (the error file one per rank); the arena is the user's.
JOB_ID = "AXONML_JOB_ID"
JOB_SECRET = "AXONML_JOB_SECRET"
ERROR_FILE = "AXONML_ERROR_FILE"
FLIGHT_RECORD_FILE = "AXONML_FLIGHT_RECORD_FILE"
LAUNCHER_PID = "AXONML_LAUNCHER_PID"
SHM_ARENA_MB = "AXONML_SHM_ARENA_MB"
TIMELINE = "AXONML_TIMELINE"
# Several hosts (see `axonml_distributed.hosts`).
HOST_ID = "AXONML_HOST_ID"
HOSTS_FLAT_BELOW = "AXONML_HOSTS_FLAT_BELOW"
HOSTS_SEGMENT_KIB = "AXONML_HOSTS_SEGMENT_KIB"

# All ranks run on this host.
DEFAULT_MASTER_ADDR = "127.0.0.1"
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")
_DIGITS = re.compile(r"[0-9]+")
_MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"


def rank() -> int | None:
    """RANK: this process's rank, 0 or more; None when unset."""
    return _whole(RANK, 0)


def world_size() -> int | None:
    """WORLD_SIZE: ranks in the job, 1 or more; None when unset."""
    return _whole(WORLD_SIZE, 1)


def master_addr() -> str:
    """MASTER_ADDR: where rank 0 listens while the shm world starts (default 127.0.0.1)."""
    return _value(MASTER_ADDR) or DEFAULT_MASTER_ADDR


def master_port() -> int | None:
    """MASTER_PORT: the TCP port rank 0 listens on while the shm world starts, 1-65535; None when unset."""
    port = _whole(MASTER_PORT, 1)
    if port is not None and port > 65535:
        raise ValueError(f"{MASTER_PORT} must be a TCP port, 1 to 65535, got {port}")
    return port


def job_id() -> str | None:
    """AXONML_JOB_ID: names the job's shared-memory segment, so the launcher can remove it after a crash
    (the core checks its form); None when unset."""
    return _value(JOB_ID)


def job_secret() -> bytes | None:
    """AXONML_JOB_SECRET: the job's secret, hex digits (surrounding whitespace ignored) decoded to at
    least `JOB_SECRET_MIN_BYTES` bytes (the core checks the length, as its rendezvous does); None when
    unset. Only processes that know it join the job."""
    text = (_value(JOB_SECRET) or "").strip()
    if not text:
        return None
    if not _HEX.fullmatch(text):
        raise ValueError(f"{JOB_SECRET} must be hex digits, two per byte (e.g. from {_MAKE_SECRET})")
    secret = bytes.fromhex(text)
    check_job_secret(secret)
    return secret


def error_file() -> str | None:
    """AXONML_ERROR_FILE: where this rank records the exception that ends it (see `error_file`); None
    when unset."""
    return _value(ERROR_FILE)


def flight_record_file() -> str | None:
    """AXONML_FLIGHT_RECORD_FILE: where this rank dumps its flight records when an exception ends it
    (see `trace`); None when unset."""
    return _value(FLIGHT_RECORD_FILE)


def timeline_file() -> str | None:
    """AXONML_TIMELINE: where the process's timeline goes, written when it exits (a Chrome trace; in a
    world of processes, see `trace.timeline_file` for the parts and their merge); None when unset. A path
    whose directory cannot be made is a warning at the package's import and no timeline, not an error:
    torch imports the package through its backend entry point."""
    return _value(TIMELINE)


def launched_by_axonml_run() -> bool:
    """Whether axonml-run started this very process: AXONML_LAUNCHER_PID names its parent. A process
    that only inherited a worker's environment (a worker's own child) is not a worker of the job."""
    pid = _whole(LAUNCHER_PID, 1)
    return pid is not None and pid == os.getppid()


def shm_arena_bytes() -> int | None:
    """AXONML_SHM_ARENA_MB: room per rank for `ProcessGroup.empty` arrays in the shm world, in MiB, a
    whole number from 1 to the size of /dev/shm; None when unset (the core's default, 64 MiB). Rank 0's
    value counts."""
    mib = _whole(SHM_ARENA_MB, 1)
    if mib is None:
        return None
    try:
        fs = os.statvfs(SEGMENT_DIR)
    except OSError:
        return mib << 20  # the core reports a missing /dev/shm
    room = fs.f_blocks * fs.f_frsize
    if mib << 20 > room:
        raise ValueError(f"{SHM_ARENA_MB}={mib} is more than {SEGMENT_DIR} holds ({room >> 20} MiB)")
    return mib << 20


def host_id() -> str | None:
    """AXONML_HOST_ID: stands in for the machine's own identity (hostname, boot id, machine id, IPC
    namespace, /dev/shm) when ranks are sorted into hosts; only ranks that then also prove they open one
    another's shared memory share a host. None when unset."""
    return _value(HOST_ID)


def hosts_flat_below() -> int | None:
    """AXONML_HOSTS_FLAT_BELOW: across hosts, all_reduces of fewer bytes than this go straight to the
    engine between hosts (one flat call) instead of through the two levels; None when unset."""
    return _whole(HOSTS_FLAT_BELOW, 0)


def hosts_segment_bytes() -> int | None:
    """AXONML_HOSTS_SEGMENT_KIB: the two-level all_reduce's pipeline segment, in KiB (a whole number of
    at least 4); None when unset."""
    kib = _whole(HOSTS_SEGMENT_KIB, 4)
    return None if kib is None else kib << 10


def _value(name: str) -> str | None:
    return os.environ.get(name) or None


def _whole(name: str, low: int) -> int | None:
    text = _value(name)
    if text is None:
        return None
    digits = text.strip()
    if not _DIGITS.fullmatch(digits) or int(digits) < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {text!r}")
    return int(digits)
