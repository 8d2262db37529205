"""What a process on a simulated host sees and reaches, for tests/test_simhosts.py (run there by path).

``hold NAME``: create the file /dev/shm/NAME, the POSIX shared-memory object NAME.posix and a SysV
segment keyed by NAME; print ``held``; remove them once stdin closes.
``look NAME...``: print as JSON this host's identity (hostname, machine id, boot id) and, for each NAME,
which of its three segments open here and whether its holder's process is in sight.
``serve ADDR PORT``: answer each TCP connection's line with ``LINE from HOSTNAME``; print ``listening``.
``call HOST PORT LINE TIMEOUT``: print the answer to LINE, or ``unreachable: ...`` and exit 1.
"""

from __future__ import annotations

# The module behind multiprocessing.shared_memory, without its resource tracker (which unlinks every
# object a process opened when the process exits, so a look would remove what it looked at).
import _posixshmem
import ctypes
import json
import os
import socket
import sys
import zlib
from pathlib import Path

_IPC_CREAT = 0o1000
_IPC_RMID = 0
_libc = ctypes.CDLL(None, use_errno=True)


def _sysv_key(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def hold(name: str) -> None:
    Path("/dev/shm", name).write_text("held")
    fd = _posixshmem.shm_open(f"/{name}.posix", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    segment = _libc.shmget(_sysv_key(name), 4096, _IPC_CREAT | 0o600)
    if segment < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    print("held", flush=True)
    sys.stdin.read()
    _libc.shmctl(segment, _IPC_RMID, None)
    _posixshmem.shm_unlink(f"/{name}.posix")
    Path("/dev/shm", name).unlink()


def _opens_posix(name: str) -> bool:
    try:
        os.close(_posixshmem.shm_open(f"/{name}.posix", os.O_RDONLY, 0))
        return True
    except FileNotFoundError:
        return False


def _process_in_sight(name: str) -> bool:
    """Whether this host's /proc lists the process holding NAME (it has NAME in its command line)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hold" in words and name.encode() in words:
            return True
    return False


def look(names: list[str]) -> None:
    seen = {
        name: {
            "file": Path("/dev/shm", name).exists(),
            "posix": _opens_posix(name),
            "sysv": _libc.shmget(_sysv_key(name), 0, 0) >= 0,
            "process": _process_in_sight(name),
        }
        for name in names
    }
    identity = {
        "hostname": socket.gethostname(),
        "machine_id": Path("/etc/machine-id").read_text().strip(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
    }
    print(json.dumps({**identity, "seen": seen}))


def serve(addr: str, port: int) -> None:
    with socket.create_server((addr, port)) as server:
        print("listening", flush=True)
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile("rw") as stream:
                stream.write(f"{stream.readline().strip()} from {socket.gethostname()}\n")


def call(host: str, port: int, line: str, timeout: float) -> int:
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn, conn.makefile("rw") as stream:
            stream.write(line + "\n")
            stream.flush()
            print(stream.readline().strip())
        return 0
    except OSError as exc:
        print(f"unreachable: {exc!r}")
        return 1


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "hold":
        hold(args[0])
    elif command == "look":
        look(args)
    elif command == "serve":
        serve(args[0], int(args[1]))
    else:
        sys.exit(call(args[0], int(args[1]), args[2], float(args[3])))
