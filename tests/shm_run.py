"""Running a world of processes over shared memory, for the shm tests: workers are started with the
multiprocessing "spawn" method, as a user would, with nothing but the rendezvous arguments, and report
back through a queue. Also a key-value store in this process with torch's Store methods (`DictStore`),
and a stranger's view of the rendezvous (rank 0's TCP store's wire, the hellos and their HMAC), to speak
it from outside.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import multiprocessing as mp
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from axonml_distributed import ProcessGroup, timeline
from axonml_distributed._core import SEGMENT_HEADER, ShmBackend

SHM = "/dev/shm"


PREFIX = f"axonml-{os.getuid()}-"


def ours() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The job secret of the job a worker process belongs to (set by `_worker`; None: no secret).
_SECRET: bytes | None = None


def connect(rank: int, n: int, port: int, timeout: float, job_id: str | None = None) -> ProcessGroup:
    b = ShmBackend.connect(
        rank, n, "127.0.0.1", port, timeout=timeout, job_id=job_id, arena_bytes=40 << 20, secret=_SECRET
    )
    return ProcessGroup(b)


def _worker(
    rank: int,
    n: int,
    ports: list[int],
    job: str | None,
    fn: Callable[..., Any],
    args: tuple,
    q: Any,
    timeout: float,
    secret: bytes | None,
):
    global _SECRET
    _SECRET = secret
    try:
        res = fn(rank, n, ports, job, timeout, q, *args)
        q.put((rank, "ok", res, time.time()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts on it
        q.put((rank, type(e).__name__, str(e), time.time()))


def w_under_timeline(
    rank: int,
    n: int,
    ports: list[int],
    job: Any,
    timeout: float,
    q: Any,
    path: str,
    calls: Callable[..., Any],
) -> str:
    """A `run_world` worker: `calls(pg)` (a module-level function) inside `timeline(path)`."""
    pg = connect(rank, n, ports[0], timeout)
    with timeline(path):
        calls(pg)
    return "done"


def run_world(
    n: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 20.0,
    worlds: int = 1,
    job: str | None = None,
    on_started: Any = None,
    limit: float = 60.0,
    secret: bytes | None | str = "fresh",
    ports: list[int] | None = None,
) -> dict[int, tuple]:
    """Run `fn(rank, n, ports, ...)` (a module-level function) in `n` spawned processes; returns
    {rank: (status, value, time)}. Every job has a fresh secret unless `secret` is given (None: a job
    without one)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = ports or [free_port() for _ in range(worlds)]
    key = secrets.token_bytes(32) if secret == "fresh" else secret
    procs = [
        ctx.Process(target=_worker, args=(r, n, ports, job, fn, args, q, timeout, key), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.time() + limit
    try:
        started = 0
        while len(results) < n and time.time() < deadline:
            try:
                msg = q.get(timeout=0.1)
            except Exception:  # noqa: BLE001 - queue.Empty
                if any(p.exitcode not in (None, 0) for i, p in enumerate(procs) if i not in results):
                    # A killed worker never reports: count it as reported once its exit is known.
                    for i, p in enumerate(procs):
                        if i not in results and p.exitcode is not None and p.exitcode < 0:
                            results[i] = ("killed", p.exitcode, time.time())
                continue
            if msg[1] == "started":
                started += 1
                if started == n and on_started:
                    on_started(procs)
                continue
            results[msg[0]] = msg[1:]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    assert len(results) == n, f"workers did not finish in {limit} s: {results}"
    return results


def ok(results: dict[int, tuple]) -> list[Any]:
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return [results[r][1] for r in sorted(results)]


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """The rendezvous' HMAC-SHA256 over length-prefixed parts (rust/rendezvous/secret.rs)."""
    msg = label + b"".join(len(p).to_bytes(8, "little") + p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).digest()


def hello(rank: int, world: int, proof: bytes | None = None, host: str = "h") -> bytes:
    """A hello as the ranks write it into the store (rust/rendezvous/hello.rs), with `proof` if given."""
    head = struct.pack("<8sIIBB", b"AXONHI03", rank, world, proof is not None, len(host.encode()))
    return head + host.encode() + os.urandom(32) + (proof or b"")


def this_host() -> str:
    """This host as the rendezvous names it (rust/rendezvous/meet.rs): its name and boot id."""
    with open("/proc/sys/kernel/hostname") as f, open("/proc/sys/kernel/random/boot_id") as g:
        return f"{f.read().strip()} (boot {g.read().strip()})"


def request(op: int, key: str, operand: bytes = b"") -> bytes:
    """A request to rank 0's TCP store (rust/rendezvous/tcp.rs): 1 set, 2 get, 3 add, 4 delete, 5 check."""
    body = struct.pack("<H", len(key)) + key.encode() + operand
    return struct.pack("<BH", op, len(body)) + body


class DictStore:
    """A key-value store in this process with torch.distributed.Store's methods, for joining a world
    through `ShmBackend.join` without torch. `on_set(key, value)` sees every value set, before the
    waiting ranks do."""

    def __init__(self, on_set: Callable[[str, bytes], None] | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._on_set = on_set

    def set(self, key: str, value: bytes) -> None:
        if self._on_set:
            self._on_set(key, value)
        with self._changed:
            self._data[key] = bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        with self._changed:
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._changed:
            if not self._changed.wait_for(
                lambda: all(k in self._data for k in keys), timeout.total_seconds()
            ):
                raise TimeoutError(f"keys {keys} not set after {timeout}")

    def add(self, key: str, value: int) -> int:
        with self._changed:
            total = int(self._data.get(key, b"0")) + value
            self._data[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None


def recv_exact(conn: socket.socket, k: int) -> bytes:
    out = b""
    while len(out) < k:
        got = conn.recv(k - len(out))
        if not got:
            break
        out += got
    return out


def segments_unchanged() -> Iterator[None]:
    """Nothing of ours may be left in /dev/shm by a test: each shm test module makes this its autouse
    fixture. Other jobs' segments are not our business: one of this user's jobs starting up meanwhile
    (another test run) names a segment too, so a new name counts only once its creator is not a live
    process outside this one's tree, and only if it is still there a moment later."""
    before = ours()
    yield
    deadline = time.monotonic() + 5
    while (left := {name for name in ours() - before if not _foreign(name)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"segments left in {SHM}: {sorted(left)}"


def _foreign(name: str) -> bool:
    """Whether segment `name` is another program's: its creator (in the header) is alive and not this
    process nor a descendant of it."""
    offset, size = SEGMENT_HEADER["creator"]
    try:
        with open(os.path.join(SHM, name), "rb") as f:
            head = f.read(offset + size)
    except OSError:
        return True  # gone: not left behind
    creator = int.from_bytes(head[offset : offset + size], "little") if len(head) == offset + size else 0
    pid = creator
    while pid > 1:
        if pid == os.getpid():
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return False  # dead (or never written): ours to answer for
    return creator > 1
