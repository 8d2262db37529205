"""The shared-memory world across real processes: every collective against numpy, faults, and hygiene.

Workers are started with the multiprocessing "spawn" method, as a user would, with nothing but the
rendezvous arguments; each computes its references independently. Every test checks that no segment of
ours is left in /dev/shm afterwards, including the crash tests.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import multiprocessing as mp
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from axonml_distributed import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
    ProcessGroup,
    ReduceOp,
)
from axonml_distributed._core import ShmBackend
from interrupts import sigint_once_in

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVERAGE"]
SHM = "/dev/shm"
PREFIX = f"axonml-{os.getuid()}-"


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leak():
    """Nothing of ours may be left in /dev/shm by a test (other jobs' segments are not our business)."""
    before = _ours()
    yield
    assert _ours() - before == set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# Running a world of processes


# The job secret of the job a worker process belongs to (set by `_worker`; None: no secret).
_SECRET: bytes | None = None


def _connect(rank: int, n: int, port: int, timeout: float, job_id: str | None = None) -> ProcessGroup:
    b = ShmBackend.connect(
        rank, n, "127.0.0.1", port, timeout=timeout, job_id=job_id, arena_bytes=40 << 20, secret=_SECRET
    )
    return ProcessGroup(b)


def _worker(
    rank: int,
    n: int,
    ports: list[int],
    job: str | None,
    fn: str,
    args: tuple,
    q: Any,
    timeout: float,
    secret: bytes | None,
):
    global _SECRET
    _SECRET = secret
    try:
        res = globals()[fn](rank, n, ports, job, timeout, q, *args)
        q.put((rank, "ok", res, time.time()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts on it
        q.put((rank, type(e).__name__, str(e), time.time()))


def _run(
    n: int,
    fn: str,
    *args: Any,
    timeout: float = 20.0,
    worlds: int = 1,
    job: str | None = None,
    on_started: Any = None,
    limit: float = 60.0,
    secret: bytes | None | str = "fresh",
    ports: list[int] | None = None,
) -> dict[int, tuple]:
    """Run `fn(rank, n, ports, ...)` in `n` spawned processes; returns {rank: (status, value, time)}.
    Every job has a fresh secret unless `secret` is given (None: a job without one)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = ports or [_free_port() for _ in range(worlds)]
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


def _ok(results: dict[int, tuple]) -> list[Any]:
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return [results[r][1] for r in sorted(results)]


# ---------------------------------------------------------------------------------------------------
# References, computed by every rank independently, in rank order


def _input(rank: int, case: int, size: int, dtype: Any, op: str = "SUM") -> np.ndarray:
    rng = np.random.default_rng(rank * 1_000_003 + case)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        x = rng.uniform(0.5, 1.5, size) if op == "PRODUCT" else rng.standard_normal(size) * 10
        return x.astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size, dtype=dt, endpoint=True)


def _reduce_ref(xs: list[np.ndarray], op: str) -> np.ndarray:
    dt = xs[0].dtype
    acc_t = np.dtype(np.float32) if dt == np.float16 else dt
    acc = xs[0].astype(acc_t)
    for x in xs[1:]:
        x = x.astype(acc_t)
        if op in ("SUM", "AVERAGE"):
            acc = acc + x
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "MIN":
            acc = np.minimum(acc, x)
        else:
            acc = np.maximum(acc, x)
    if op == "AVERAGE":
        acc = acc / acc_t.type(len(xs))
    return acc.astype(dt)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.tobytes() == want.tobytes()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Worker bodies (run in the spawned processes)


def w_collectives(rank, n, ports, job, timeout, q):
    """Every collective x dtype (x op) x size on private arrays, then on segment arrays."""
    pg = _connect(rank, n, ports[0], timeout)
    fails: list[str] = []
    digests: list[str] = []
    case = 0

    def check(name: str, got: np.ndarray, want: np.ndarray, everywhere: bool = True) -> None:
        """`everywhere`: the result is the same on every rank, so its digest is compared across ranks."""
        if everywhere:
            digests.append(f"{name}={_digest(got)}")
        if not _same(got, want):
            fails.append(f"{name}: got {got.ravel()[:4]} want {want.ravel()[:4]}")

    sizes = [0, 1, 7, 1023, 3 * 4096 + 3, 40_003]
    for dt in DTYPES:
        for op in OPS:
            if op == "AVERAGE" and np.dtype(dt).kind != "f":
                continue
            for size in sizes:
                case += 1
                xs = [_input(r, case, size, dt, op) for r in range(n)]
                x = xs[rank].copy()
                pg.all_reduce(x, op)
                check(f"all_reduce {dt.__name__} {op} {size}", x, _reduce_ref(xs, op))
                x = xs[rank].copy()
                pg.reduce(x, n - 1, op)
                want = _reduce_ref(xs, op) if rank == n - 1 else xs[rank]
                check(f"reduce {dt.__name__} {op} {size}", x, want, everywhere=False)
                big = [_input(r, case, n * size, dt, op) for r in range(n)]
                out = np.empty(size, dt)
                pg.reduce_scatter(big[rank], out, op)
                want = _reduce_ref(big, op)[rank * size : (rank + 1) * size]
                check(f"reduce_scatter {dt.__name__} {op} {size}", out, want, everywhere=False)
        for size in sizes:
            case += 1
            xs = [_input(r, case, size, dt) for r in range(n)]
            root = case % n
            x = xs[rank].copy()
            pg.broadcast(x, root)
            check(f"broadcast {dt.__name__} {size}", x, xs[root])
            out = np.empty((n, size), dt)
            pg.all_gather(xs[rank], out)
            check(f"all_gather {dt.__name__} {size}", out, np.stack(xs))
            g = np.empty((n, size), dt) if rank == root else None
            pg.gather(xs[rank], g, root)
            if rank == root:
                check(f"gather {dt.__name__} {size}", g, np.stack(xs), everywhere=False)
            full = [_input(r, case + 7, n * size, dt) for r in range(n)]
            out = np.empty(size, dt)
            pg.scatter(full[rank] if rank == root else None, out, root)
            want = full[root][rank * size : (rank + 1) * size]
            check(f"scatter {dt.__name__} {size}", out, want, everywhere=False)
    # Large messages cross many pipeline rounds (1 MiB buffers): >= 8 MiB per rank.
    large = [(np.float32, 2 * 1024 * 1024 + 3), (np.float16, 4 * 1024 * 1024 + 1), (np.int8, 8 << 20)]
    for dt, size in large:
        case += 1
        xs = [_input(r, case, size, dt) for r in range(n)]
        x = xs[rank].copy()
        pg.all_reduce(x)
        check(f"all_reduce large {dt.__name__}", x, _reduce_ref(xs, "SUM"))
    case += 1
    xs = [_input(r, case, 2 * 1024 * 1024 + 5, np.float32) for r in range(n)]
    x = xs[rank].copy()
    pg.broadcast(x, 1)
    check("broadcast large", x, xs[1])
    out = np.empty((n, xs[0].size), np.float32)
    pg.all_gather(xs[rank], out)
    check("all_gather large", out, np.stack(xs))
    pg.barrier()
    # Segment arrays: collectives run straight on them (zero copy), results identical.
    for dt in DTYPES:
        for size in [1, 1023, 40_003, 3 * 4096 + 3]:
            case += 1
            xs = [_input(r, case, size, dt) for r in range(n)]
            a = pg.empty(size, dt)
            assert isinstance(a.base, object) and a.flags.c_contiguous and a.flags.writeable
            a[:] = xs[rank]
            pg.all_reduce(a, "MAX")
            check(f"segment all_reduce {dt.__name__} {size}", a, _reduce_ref(xs, "MAX"))
            a[:] = xs[rank]
            pg.broadcast(a, 0)
            check(f"segment broadcast {dt.__name__} {size}", a, xs[0])
            out = pg.empty((n, size), dt)
            pg.all_gather(xs[rank], out)  # private send, segment recv: staged, still right
            check(f"mixed all_gather {dt.__name__} {size}", out, np.stack(xs))
            s = pg.empty(n * size, dt)
            s[:] = _input(rank, case + 9, n * size, dt)
            full = [_input(r, case + 9, n * size, dt) for r in range(n)]
            r = pg.empty(size, dt)
            pg.reduce_scatter(s, r)
            want = _reduce_ref(full, "SUM")[rank * size :][:size]
            check(f"segment reduce_scatter {dt.__name__} {size}", r, want, everywhere=False)
    case += 1
    size = 2 * 1024 * 1024 + 3
    xs = [_input(r, case, size, np.float32) for r in range(n)]
    a = pg.empty(size, np.float32)
    a[:] = xs[rank]
    pg.all_reduce(a)
    check("segment all_reduce large", a, _reduce_ref(xs, "SUM"))
    # Point to point: a ring, two tags, in order.
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for tag, size in [(3, 5), (4, 300_001)]:
        msg = _input(rank, tag, size, np.int64)
        if rank % 2 == 0:
            pg.send(msg, nxt, tag)
            got = np.empty(size, np.int64)
            pg.recv(got, prv, tag)
        else:
            got = np.empty(size, np.int64)
            pg.recv(got, prv, tag)
            pg.send(msg, nxt, tag)
        check(f"send/recv tag {tag}", got, _input(prv, tag, size, np.int64), everywhere=False)
    # Subgroups: evens and odds reduce concurrently.
    from axonml_distributed import World

    world = World(pg.backend())
    evens, odds = world.new_group(list(range(0, n, 2))), world.new_group(list(range(1, n, 2)))
    mine = evens if rank % 2 == 0 else odds
    x = np.full(70_000, rank + 1, np.int64)
    mine.all_reduce(x)
    want = np.full(70_000, sum(r + 1 for r in mine.ranks()), np.int64)
    check("subgroup all_reduce", x, want, everywhere=False)
    return fails, digests


def w_mismatch(rank, n, ports, job, timeout, q):
    """One fresh world per kind of mismatch; returns what each call raised and whether buffers changed."""
    out = []
    for i, kind in enumerate(["op", "shape", "dtype", "root", "kind"]):
        pg = _connect(rank, n, ports[i], timeout)
        odd = rank == n - 1
        length = 1000 + (rank if kind == "shape" and odd else 0)
        x = np.arange(length, dtype=np.float64 if kind == "dtype" and odd else np.float32) + rank
        before = x.copy()
        try:
            if kind == "op":
                pg.all_reduce(x, "MAX" if odd else "SUM")
            elif kind == "root":
                pg.broadcast(x, 1 if odd else 0)
            elif kind == "kind" and odd:
                pg.broadcast(x, 0)
            else:
                pg.all_reduce(x)
            out.append((kind, "no error", ""))
        except CollectiveMismatchError as e:
            out.append((kind, "mismatch", str(e)))
        assert _same(x, before), f"{kind}: the buffer was changed"
        del pg
    return out


def w_timeout(rank, n, ports, job, timeout, q):
    pg = _connect(rank, n, ports[0], timeout)
    if rank == n - 1:
        time.sleep(timeout + 2)
        return "slept"
    t = time.time()
    try:
        pg.all_reduce(np.ones(100_000, np.float32))
    except CollectiveTimeoutError as e:
        return ("timeout", str(e), time.time() - t)


def w_interrupt(rank, n, ports, job, timeout, q):
    """Rank 0 gets Ctrl-C while it waits for rank 1, which arrives late."""
    pg = _connect(rank, n, ports[0], timeout)
    if rank == 1:
        time.sleep(1.5)
        try:
            pg.barrier()
        except PeerFailureError as e:
            return ("aborted", str(e))
        return ("no error", "")
    sigint_once_in("pg.all_reduce(np.ones(10, np.float32))  # rank 1 comes late")
    t = time.time()
    try:
        pg.all_reduce(np.ones(10, np.float32))  # rank 1 comes late
    except KeyboardInterrupt:
        return ("interrupted", time.time() - t)
    return ("no error", 0)


def w_loop(rank, n, ports, job, timeout, q, size, segment):
    """Reduce until a peer dies; report the error and when it was raised."""
    pg = _connect(rank, n, ports[0], timeout, job)
    x = pg.empty(size, np.float32) if segment else np.ones(size, np.float32)
    q.put((rank, "started"))
    end = time.time() + 20
    while time.time() < end:
        pg.all_reduce(x)
    return "no failure"


def w_simple(rank, n, ports, job, timeout, q):
    pg = _connect(rank, n, ports[0], timeout, job)
    # Once every rank has joined, the segment has no name left to leak.
    assert job is None or not os.path.exists(f"{SHM}/{PREFIX}{job}")
    x = np.full(10, rank + 1, np.float32)
    pg.all_reduce(x)
    return float(x[0])


def w_crowd(rank, n, ports, job, timeout, q):
    """More ranks than cores: waits must yield and sleep, not spin each other out."""
    pg = _connect(rank, n, ports[0], timeout)
    x = np.empty(64 << 10, np.float32)
    t = time.time()
    for i in range(30):
        x[:] = rank + i
        pg.all_reduce(x)
        assert x[0] == sum(range(n)) + n * i
    pg.barrier()
    return time.time() - t


# ---------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_dtype_and_op_matches_numpy_bitwise_on_every_rank(n):
    results = _ok(_run(n, "w_collectives", limit=110))
    for rank, (fails, _) in enumerate(results):
        assert not fails, f"rank {rank}: {fails[:5]}"
    for rank, (_, digests) in enumerate(results):
        assert digests == results[0][1], f"rank {rank} differs from rank 0"


@pytest.mark.timeout(60)
def test_mismatches_raise_on_every_rank_and_leave_buffers_untouched():
    res = _ok(_run(3, "w_mismatch", worlds=5, timeout=10))
    for rank, cases in enumerate(res):
        for kind, what, msg in cases:
            assert what == "mismatch", f"rank {rank} {kind}: {what}"
            assert "rank 2" in msg, msg


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_times_out_naming_it():
    res = _run(3, "w_timeout", timeout=1.5)
    for rank in (0, 1):
        status, val, _ = res[rank]
        assert status == "ok" and val is not None, res[rank]
        kind, msg, waited = val
        assert "[2]" in msg, msg
        assert 1.0 < waited < 4.0, waited


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_interrupts_and_the_peer_is_told():
    res = _ok(_run(2, "w_interrupt", timeout=30))
    assert res[0][0] == "interrupted" and res[0][1] < 1.0, res[0]
    assert res[1][0] == "aborted" and "rank 0" in res[1][1], res[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,segment,size", [(2, False, 1 << 20), (3, True, 1 << 20), (4, False, 1000)])
def test_a_rank_killed_mid_collective_is_named_by_every_survivor_within_2s(n, segment, size):
    killed: dict[str, float] = {}

    def kill(procs):
        time.sleep(0.3)
        killed["t"] = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)

    job = secrets.token_hex(16)
    res = _run(n, "w_loop", size, segment, timeout=30, job=job, on_started=kill)
    assert res[1][0] == "killed"
    for rank in [r for r in range(n) if r != 1]:
        status, msg, t = res[rank]
        assert status == "PeerFailureError", res[rank]
        assert "rank 1" in msg, msg
        assert t - killed["t"] < 2.0, t - killed["t"]
    assert not os.path.exists(f"{SHM}/{PREFIX}{job}")


@pytest.mark.timeout(60)
def test_a_stale_segment_of_a_killed_job_does_not_break_the_next_job():
    stale = f"{SHM}/{PREFIX}{secrets.token_hex(16)}"
    with open(stale, "wb") as f:
        f.write(b"\0" * 8192)
    os.chmod(stale, 0o600)
    try:
        assert _ok(_run(2, "w_simple", job=secrets.token_hex(16))) == [3.0, 3.0]
    finally:
        os.unlink(stale)


@pytest.mark.timeout(60)
def test_more_ranks_than_cores_make_progress():
    took = _ok(_run(6, "w_crowd", timeout=20))
    assert max(took) < 15, took


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["file", "symlink"])
def test_a_precreated_segment_name_is_refused(how, tmp_path):
    job = secrets.token_hex(16)
    path = f"{SHM}/{PREFIX}{job}"
    if how == "file":
        with open(path, "wb") as f:
            f.write(b"x")
    else:
        os.symlink(tmp_path / "target", path)
    try:
        with pytest.raises(FileExistsError, match="already exists") as e:
            ShmBackend.connect(0, 1, "127.0.0.1", _free_port(), timeout=5, job_id=job)
        assert e.value.errno == errno.EEXIST
        assert not (tmp_path / "target").exists()
    finally:
        os.unlink(path)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """The rendezvous' HMAC-SHA256 over length-prefixed parts (rust/transport/shm/auth.rs)."""
    msg = label + b"".join(len(p).to_bytes(8, "little") + p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _hello(rank: int, world: int, with_secret: bool) -> bytes:
    return struct.pack("<8sIII", b"AXONRDV2", int(with_secret), rank, world) + os.urandom(32)


def _recv_exact(conn: socket.socket, k: int) -> bytes:
    out = b""
    while len(out) < k:
        got = conn.recv(k - len(out))
        if not got:
            break
        out += got
    return out


def _fake_rank0(port_box: list, name: str, nonce: bytes, key: bytes, answers: list) -> None:
    """Speak rank 0's side of the rendezvous (with the job secret `key`), handing out `name`, and record
    whether the rank's proof verified and the rank's verdict on the segment."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_box.append(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            hello = _recv_exact(conn, 52)
            assert hello[:8] == b"AXONRDV2" and struct.unpack("<III", hello[8:20]) == (1, 1, 2)
            challenge = os.urandom(32)
            conn.sendall(challenge)
            tag = _recv_exact(conn, 32)
            answers.append(hmac.compare_digest(tag, _mac(key, b"axonml rendezvous client", hello, challenge)))
            body = name.encode() + nonce
            body += _mac(key, b"axonml rendezvous server", hello, challenge, tag, b"\x01", body)
            conn.sendall(bytes([1]) + struct.pack("<H", len(body)) + body)
            head = _recv_exact(conn, 3)
            answers.append((head[:1], _recv_exact(conn, struct.unpack("<H", head[1:3])[0]).decode()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("problem", ["mode", "magic", "truncated"])
def test_a_foreign_or_bad_segment_is_refused_on_attach(problem):
    name = f"/{PREFIX}{secrets.token_hex(16)}"
    path = SHM + name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    key = secrets.token_bytes(32)
    try:
        os.write(fd, (b"AXONSHM1" if problem != "magic" else b"NOTOURS!") + b"\0" * (1 << 16))
        if problem == "mode":
            os.fchmod(fd, 0o644)
        if problem == "truncated":
            os.ftruncate(fd, 16)
        box: list = []
        answers: list = []
        t = threading.Thread(target=_fake_rank0, args=(box, name, b"n" * 16, key, answers))
        t.start()
        while not box:
            time.sleep(0.01)
        expect = {"mode": "mode 644", "magic": "magic", "truncated": "bytes long"}[problem]
        with pytest.raises(OSError, match=expect) as e:
            ShmBackend.connect(1, 2, "127.0.0.1", box[0], timeout=5, secret=key)
        # A real errno, not 0: PermissionError for a mode others can use, EBADMSG for bad contents.
        want = {"mode": errno.EACCES, "magic": errno.EBADMSG, "truncated": errno.EBADMSG}[problem]
        assert e.value.errno == want, e.value
        assert problem != "mode" or isinstance(e.value, PermissionError)
        t.join()
        assert answers[0] is True, "the rank's proof verifies against an independent HMAC"
        assert answers[1][0] == b"\x02", answers
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.timeout(30)
def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(OSError, match="MASTER_PORT"):
            ShmBackend.connect(0, 2, "127.0.0.1", s.getsockname()[1], timeout=2)


@pytest.mark.timeout(30)
def test_a_single_rank_world_works_and_leaves_nothing():
    pg = _connect(0, 1, _free_port(), 5)
    a = pg.empty((3, 4), np.int32)
    a[:] = 7
    pg.all_reduce(a)
    assert (a == 7).all()
    x = np.arange(5, dtype=np.float32)
    pg.broadcast(x, 0)
    assert pg.backend().name() == "shm"
    assert ReduceOp.SUM is not None


_SCRIPT = """\
import os, sys
import numpy as np
import axonml_distributed as ad

pg = ad.init_process_group("shm", timeout=20)
assert ad.world_size() == int(os.environ["WORLD_SIZE"]) and pg.backend().name() == "shm"
x = np.full(5, ad.rank() + 1.0, np.float32)
ad.all_reduce_sum(x)
g = pg.empty(1000, np.float64)
g[:] = ad.rank()
ad.all_reduce_mean(g)
ad.barrier()
print("RESULT", x[0], g[0], flush=True)
ad.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_the_launcher_runs_init_process_group_shm_and_cleans_up(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "axonml_distributed.run",
        "--nproc-per-node",
        "3",
        "--prefix-output",
        str(script),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    results = sorted(line for line in out.stdout.splitlines() if "RESULT" in line)
    assert results == [f"[rank {r}] RESULT 6.0 1.0" for r in range(3)], out.stdout


@pytest.mark.timeout(30)
def test_a_rank0_killed_during_start_up_leaves_the_name_the_launcher_removes():
    from axonml_distributed.shm import segment_name

    job = secrets.token_hex(16)
    code = (
        "from axonml_distributed._core import ShmBackend\n"
        f"ShmBackend.connect(0, 2, '127.0.0.1', {_free_port()}, timeout=20, job_id='{job}')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    path = SHM + segment_name(job)

    def header() -> tuple:
        try:
            with open(path, "rb") as f:
                return struct.unpack("<8sIIII", f.read(24))
        except (OSError, struct.error):
            return ()

    try:
        # Rank 0 creates the job's segment, then writes its header, while it waits for rank 1.
        deadline = time.time() + 10
        while not header()[:1] == (b"AXONSHM1",) and time.time() < deadline:
            time.sleep(0.01)
        magic, version, world, uid, creator = header()
        assert (magic, world, uid, creator) == (b"AXONSHM1", 2, os.geteuid(), proc.pid)
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    finally:
        proc.kill()
        proc.wait()
        left = os.path.exists(path)
        # What axonml-run does at the end of every job:
        if left:
            os.unlink(path)
    assert left, "SIGKILL during start-up leaves the job's segment, under the name the launcher removes"


@pytest.mark.timeout(30)
def test_cleanup_removes_only_our_stale_segments():
    from axonml_distributed.shm import cleanup_stale_segments

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def segment(creator: int, magic: bytes = b"AXONSHM1", age: float = 3600) -> str:
        path = f"{SHM}/{PREFIX}{secrets.token_hex(16)}"
        with open(path, "wb") as f:
            f.write(struct.pack("<8sIIII", magic, 1, 2, os.geteuid(), creator) + bytes(64))
        os.chmod(path, 0o600)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    stale = segment(dead.pid)
    keep = [segment(os.getpid()), segment(dead.pid, magic=b"NOTOURS!"), segment(dead.pid, age=1)]
    try:
        assert cleanup_stale_segments(min_age=60) == ["/" + os.path.basename(stale)]
        assert not os.path.exists(stale)
        assert all(os.path.exists(p) for p in keep)
    finally:
        for p in [stale, *keep]:
            if os.path.exists(p):
                os.unlink(p)


# ---------------------------------------------------------------------------------------------------
# Hardening regressions in the shm world (the in-process ones are in test_hardening.py)


def w_two_groups(rank, n, ports, job, timeout, q):
    """Two groups over one backend, async on one and blocking on the other, in the same program order."""
    pg = _connect(rank, n, ports[0], timeout)
    g2 = ProcessGroup(pg.backend())
    seen = []
    for i in range(100):
        a = np.full(4, 10.0 * (rank + 1) + i, np.float64)
        c = np.full(4, 1.0 * (rank + 1), np.float64)
        w = pg.all_reduce(a, async_op=True)
        g2.all_reduce(c)
        w.wait()
        seen.append((float(a[0]), float(c[0])))
    return seen == [(30.0 + 2 * i, 3.0) for i in range(100)]


def w_exchange(rank, n, ports, job, timeout, q, size):
    """isend then a blocking recv on both ranks, above the eager limit."""
    pg = _connect(rank, n, ports[0], timeout)
    peer = 1 - rank
    x = np.arange(size, dtype=np.float32) + 1000 * rank
    y = np.zeros(size, np.float32)
    w = pg.send(x, peer, async_op=True)
    pg.recv(y, peer)
    w.wait()
    return bool(np.array_equal(y, np.arange(size, dtype=np.float32) + 1000 * peer))


def w_late_barrier(rank, n, ports, job, timeout, q):
    """Rank 2 completes one all_reduce, then never comes to the barrier."""
    pg = _connect(rank, n, ports[0], timeout)
    pg.all_reduce(np.ones(4, np.float32))
    if rank == 2:
        time.sleep(timeout + 3)
        return "left"
    pg.barrier()
    return "no error"


def w_stopped_peer(rank, n, ports, job, timeout, q):
    """Rank 2 never calls; rank 1 arrives and is then SIGSTOPped by the test; rank 0 times out."""
    pg = _connect(rank, n, ports[0], timeout)
    x = pg.empty(1 << 16, np.float32)  # segment arrays: peers may write them (the zero-copy path)
    x[:] = 1
    q.put((rank, "started"))
    if rank == 2:
        time.sleep(25)
        return "left"
    pg.all_reduce(x)
    return "no error"


@pytest.mark.timeout(90)
def test_two_groups_over_one_shm_backend_match_calls_in_program_order():
    assert _ok(_run(2, "w_two_groups", timeout=30)) == [True, True]


@pytest.mark.timeout(90)
def test_the_isend_recv_exchange_completes_above_the_eager_limit():
    assert _ok(_run(2, "w_exchange", 1 << 20, timeout=30)) == [True, True]


@pytest.mark.timeout(90)
def test_every_waiting_shm_rank_gets_the_timeout_with_where_each_rank_is():
    res = _run(3, "w_late_barrier", timeout=6.0)  # room for a slow start on a busy machine
    for r in (0, 1):
        status, msg, _ = res[r]
        assert status == "CollectiveTimeoutError", res[r]
        assert "[2]" in msg and "rank 2 completed #1 all_reduce" in msg, msg
        assert f"rank {r} completed #1 all_reduce and waits in #2 barrier" in msg, msg


@pytest.mark.timeout(90)
def test_a_stopped_peer_does_not_hold_a_timed_out_rank_forever():
    times: dict[str, float] = {}

    def stop_then_resume(procs):
        def run():
            time.sleep(0.5)
            os.kill(procs[1].pid, signal.SIGSTOP)
            times["stopped"] = time.time()
            time.sleep(20)
            os.kill(procs[1].pid, signal.SIGCONT)

        threading.Thread(target=run, daemon=True).start()

    res = _run(3, "w_stopped_peer", timeout=4.0, on_started=stop_then_resume)
    status, msg, t = res[0]
    assert status == "CollectiveTimeoutError", res[0]
    # Its own timeout, then at most one more for the drain, not the 20 s until rank 1 resumes.
    assert t - times["stopped"] < 2 * 4.0 + 3, (t - times["stopped"], msg)
    assert res[1][0] in ("CollectiveTimeoutError", "PeerFailureError"), res[1]


# ---------------------------------------------------------------------------------------------------
# Who may join: the rendezvous admits only ranks that prove they belong to the job


def w_late(rank, n, ports, job, timeout, q, delay):
    """Rank 0 listens at once; the others join `delay` seconds later (after the strangers came)."""
    if rank:
        time.sleep(delay)
    pg = _connect(rank, n, ports[0], timeout)
    x = np.full(10, rank + 1, np.float32)
    pg.all_reduce(x)
    return float(x[0])


def _wait_listening(port: int) -> None:
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError("rank 0 never listened")


def _probe(port: int, send: bytes, proof: bool = False) -> bytes:
    """Connect as a stranger, send `send` (and, after a challenge, a made-up proof), return all it hears."""
    heard = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(send)
        if proof:
            heard += _recv_exact(c, 32)
            c.sendall(os.urandom(32))
        try:
            while chunk := c.recv(4096):
                heard += chunk
        except OSError:  # a timeout or a reset: either way nothing more was said
            pass
    return heard


@pytest.mark.timeout(60)
def test_strangers_at_the_rendezvous_learn_nothing_and_do_not_fail_the_job():
    port = _free_port()
    heard: dict[str, bytes] = {}
    silent: list[socket.socket] = []

    def strangers() -> None:
        _wait_listening(port)
        # More silent sockets than the job's timeout allows when they are served one by one.
        silent.extend(socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12))
        probes = {
            "garbage": (b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100), False),
            "hello without the secret": (_hello(1, 2, False), False),
            "hello with a wrong proof": (_hello(1, 2, True), True),
            "hello for another world size": (_hello(1, 3, False), False),
        }
        threads = [
            threading.Thread(target=lambda k=k, v=v: heard.__setitem__(k, _probe(port, *v)))
            for k, v in probes.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t = threading.Thread(target=strangers)
    t.start()
    try:
        res = _ok(_run(2, "w_late", 3.0, timeout=8, ports=[port]))
    finally:
        t.join()
    assert res == [3.0, 3.0]
    for s in silent:
        s.settimeout(0.5)
        try:
            assert s.recv(4096) == b"", "a silent socket was told something"
        except TimeoutError:
            pass
        s.close()
    # A stranger with a secret-capable hello gets rank 0's random challenge, nothing else.
    assert len(heard.pop("hello with a wrong proof")) == 32
    assert heard == dict.fromkeys(heard, b""), heard


@pytest.mark.timeout(60)
def test_without_a_secret_same_user_processes_join_and_other_users_are_refused():
    port = _free_port()
    stranger: dict[str, bytes] = {}

    def other_user() -> None:
        _wait_listening(port)
        if os.geteuid() != 0:
            return
        # A process of another user (uid 65534) sends a perfect hello claiming rank 1.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child only talks to the socket and leaves
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(w, b"+" + _probe(port, _hello(1, 2, False)))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        out = b""
        while chunk := os.read(r, 4096):
            out += chunk
        os.close(r)
        stranger["heard"] = out
        stranger["rc"] = os.waitpid(pid, 0)[1].to_bytes(2, "little")

    t = threading.Thread(target=other_user)
    t.start()
    try:
        assert _ok(_run(2, "w_late", 3.0, timeout=10, secret=None, ports=[port])) == [3.0, 3.0]
    finally:
        t.join()
    if os.geteuid() == 0:
        assert stranger == {"heard": b"+", "rc": b"\0\0"}, stranger


@pytest.mark.timeout(30)
def test_a_rank_with_another_secret_is_not_admitted_and_both_time_out_naming_each_other():
    port = _free_port()
    errors: dict[int, BaseException] = {}

    def rank(r: int, key: bytes) -> None:
        try:
            ShmBackend.connect(r, 2, "127.0.0.1", port, timeout=3, secret=key)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[r] = e

    ts = [threading.Thread(target=rank, args=(r, secrets.token_bytes(32))) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert isinstance(errors[0], CollectiveTimeoutError) and "[1]" in str(errors[0]), errors
    assert isinstance(errors[1], CollectiveTimeoutError) and "[0]" in str(errors[1]), errors
    assert "AXONML_JOB_SECRET" in str(errors[1])
    with pytest.raises(ValueError, match="at least 16"):
        ShmBackend.connect(0, 1, "127.0.0.1", port, timeout=3, secret=b"short")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_interrupts_the_rendezvous(rank):
    code = (
        "from axonml_distributed._core import ShmBackend\n"
        f"ShmBackend.connect({rank}, 2, '127.0.0.1', {_free_port()}, timeout=60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)  # importing and starting to wait
    t = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert time.time() - t < 10


def w_groups(rank, n, ports, job, timeout, q):
    """Create, use and drop a subgroup of every rank many times."""
    from axonml_distributed import World

    world = World(_connect(rank, n, ports[0], timeout).backend())
    got = []
    for i in range(100):
        g = world.new_group([0, 1])
        x = np.full(70_000, rank + i, np.float32)  # past the one-shot size: the group's staging is used
        g.all_reduce(x)
        got.append(float(x[-1]))
        del g
    return got


@pytest.mark.timeout(120)
def test_creating_and_dropping_a_subgroup_100_times_works():
    res = _ok(_run(2, "w_groups", timeout=20, limit=110))
    assert res[0] == res[1] == [float(2 * i + 1) for i in range(100)]


@pytest.mark.timeout(60)
def test_a_job_started_by_hand_authenticates_with_the_secret_in_its_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["AXONML_JOB_SECRET"] = secrets.token_hex(32)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("RESULT 3.0 0.5" in o for o in outs), outs
    bad = dict(env, RANK="0", WORLD_SIZE="1", AXONML_JOB_SECRET="not hex")
    out = subprocess.run([sys.executable, str(script)], env=bad, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "AXONML_JOB_SECRET must be hex" in out.stderr, out.stderr


@pytest.mark.timeout(30)
def test_a_member_started_with_another_world_size_is_told_why_and_rank_0_names_it_at_its_timeout():
    port, key = _free_port(), secrets.token_bytes(32)
    errors: dict[int, BaseException] = {}

    def rank(r: int, n: int) -> None:
        try:
            ShmBackend.connect(r, n, "127.0.0.1", port, timeout=3, secret=key)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[r] = e

    ts = [threading.Thread(target=rank, args=args) for args in [(0, 2), (1, 3)]]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert isinstance(errors[1], ValueError), errors
    assert "rank 1 was started with world_size 3, but rank 0 has 2" in str(errors[1])
    assert isinstance(errors[0], CollectiveTimeoutError) and "[1]" in str(errors[0]), errors
    assert "world_size 3" in str(errors[0])


def w_two_tags(rank, n, ports, job, timeout, q):
    """Two isends above the eager limit with two tags, received in the other order."""
    pg = _connect(rank, n, ports[0], timeout)
    size = 1 << 18
    if rank == 0:
        works = [pg.send(np.full(size, float(tag), np.float32), 1, tag, async_op=True) for tag in (1, 2)]
    else:
        bufs = {tag: np.zeros(size, np.float32) for tag in (2, 1)}
        works = [pg.recv(bufs[tag], 0, tag, async_op=True) for tag in (2, 1)]
    for w in works:
        w.wait()
    return rank == 0 or all(bool((bufs[t] == t).all()) for t in (1, 2))


@pytest.mark.timeout(90)
def test_isends_with_two_tags_received_in_the_other_order_complete_in_the_shm_world():
    assert _ok(_run(2, "w_two_tags", timeout=30)) == [True, True]
