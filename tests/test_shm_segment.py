"""The shared-memory segment's security and hygiene: a pre-created name, a symlink, a foreign owner or mode,
a bad header are refused; nothing is left in /dev/shm after a job, a crash during start-up leaves only the
name the launcher removes, and the stale-segment cleanup removes only our dead jobs' segments.
"""

from __future__ import annotations

import datetime
import errno
import hmac
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from axonml_distributed import (
    ReduceOp,
)
from axonml_distributed._core import ShmBackend
from shm_run import (
    PREFIX,
    SHM,
    DictStore,
    connect,
    free_port,
    hello,
    mac,
    ok,
    recv_exact,
    request,
    run_world,
    segments_unchanged,
    this_host,
)

no_leak = pytest.fixture(autouse=True)(segments_unchanged)


def w_simple(rank, n, ports, job, timeout, q):
    pg = connect(rank, n, ports[0], timeout, job)
    # Once every rank has joined, the segment has no name left to leak.
    assert job is None or not os.path.exists(f"{SHM}/{PREFIX}{job}")
    x = np.full(10, rank + 1, np.float32)
    pg.all_reduce(x)
    return float(x[0])


@pytest.mark.timeout(60)
def test_a_stale_segment_of_a_killed_job_does_not_break_the_next_job():
    stale = f"{SHM}/{PREFIX}{secrets.token_hex(16)}"
    with open(stale, "wb") as f:
        f.write(b"\0" * 8192)
    os.chmod(stale, 0o600)
    try:
        assert ok(run_world(2, w_simple, job=secrets.token_hex(16))) == [3.0, 3.0]
    finally:
        os.unlink(stale)


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
            ShmBackend.connect(0, 1, "127.0.0.1", free_port(), timeout=5, job_id=job)
        assert e.value.errno == errno.EEXIST
        assert not (tmp_path / "target").exists()
    finally:
        os.unlink(path)


def _fake_rank0(store: DictStore, name: str, nonce: bytes, key: bytes, answers: list) -> None:
    """Speak rank 0's side of the rendezvous in `store` (with the job secret `key`), handing out `name`,
    and record whether the rank's proof verified against an independent HMAC, and what the rank reports."""
    unsigned = hello(0, 2, proof=b"", host=this_host())  # its flag says a proof follows
    rank0 = unsigned + mac(key, b"axonml rendezvous rank 0", unsigned)
    store.set("axonml/rank0", rank0)
    store.wait(["axonml/knock/1"], datetime.timedelta(seconds=10))
    knock = store.get("axonml/knock/1")
    answers.append(hmac.compare_digest(knock[-32:], mac(key, b"axonml rendezvous knock", knock[:-32], rank0)))
    body = f"{name} {nonce.hex()} 2".encode()
    verdict = b"AXONVD03" + rank0[-64:-32] + b"\x01" + struct.pack("<H", len(body)) + body
    tag = mac(key, b"axonml rendezvous verdict", rank0, knock, verdict)
    store.set("axonml/verdict", verdict + struct.pack("<H", 1) + tag)
    # The rank tells rank 0 why it cannot attach.
    store.wait(["axonml/failed"], datetime.timedelta(seconds=10))
    answers.append(store.get("axonml/failed").decode())


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
        store, answers = DictStore(), []
        t = threading.Thread(target=_fake_rank0, args=(store, name, b"n" * 16, key, answers))
        t.start()
        expect = {"mode": "mode 644", "magic": "magic", "truncated": "bytes long"}[problem]
        with pytest.raises(OSError, match=expect) as e:
            ShmBackend.join(store, 1, 2, timeout=5, secret=key)
        # A real errno, not 0: PermissionError for a mode others can use, EBADMSG for bad contents.
        want = {"mode": errno.EACCES, "magic": errno.EBADMSG, "truncated": errno.EBADMSG}[problem]
        assert e.value.errno == want, e.value
        assert problem != "mode" or isinstance(e.value, PermissionError)
        t.join()
        assert answers[0] is True, "the rank's proof verifies against an independent HMAC"
        assert answers[1].startswith("rank 1 could not use what rank 0 handed out") and expect in answers[1]
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.timeout(30)
def test_a_single_rank_world_works_and_leaves_nothing():
    pg = connect(0, 1, free_port(), 5)
    a = pg.empty((3, 4), np.int32)
    a[:] = 7
    pg.all_reduce(a)
    assert (a == 7).all()
    x = np.arange(5, dtype=np.float32)
    pg.broadcast(x, 0)
    assert pg.backend().name() == "shm"
    assert ReduceOp.SUM is not None


def _knock_as_rank1(port: int) -> None:
    """Rank 1 of a job without a secret, through rank 0's TCP store: it knocks, then stays silent."""
    deadline = time.time() + 20
    while True:
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            assert time.time() < deadline, "rank 0 never listened"
            time.sleep(0.02)
    with c:
        c.sendall(request(3, "axonml/knocks", (1).to_bytes(8, "little", signed=True)))
        head = recv_exact(c, 3)
        slot = int.from_bytes(recv_exact(c, struct.unpack("<H", head[1:])[0]), "little", signed=True)
        c.sendall(request(1, f"axonml/knock/{slot}", hello(1, 2, host=this_host())))
        recv_exact(c, 3)
        time.sleep(15)


@pytest.mark.timeout(30)
def test_a_rank0_killed_during_start_up_leaves_the_name_the_launcher_removes():
    from axonml_distributed.shm import segment_name

    job = secrets.token_hex(16)
    code = (
        "from axonml_distributed._core import ShmBackend\n"
        f"ShmBackend.connect(0, 2, '127.0.0.1', {free_port()}, timeout=20, job_id='{job}')\n"
    )
    port = int(code.split("'127.0.0.1', ")[1].split(",")[0])
    proc = subprocess.Popen([sys.executable, "-c", code])
    path = SHM + segment_name(job)
    # Rank 1 knocks (the job has no secret), so rank 0 creates the segment; it never attaches.
    knocker = threading.Thread(target=_knock_as_rank1, args=(port,), daemon=True)
    knocker.start()

    def header() -> tuple:
        try:
            with open(path, "rb") as f:
                return struct.unpack("<8sIIII", f.read(24))
        except (OSError, struct.error):
            return ()

    try:
        # Rank 0 creates the job's segment, then writes its header, while it waits for rank 1 to attach.
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
def test_cleanup_removes_only_our_stale_segments_and_host_proofs():
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

    def proof(ended: bool, age: float = 3600) -> str:
        """A host proof (`hosts.layout`) never removed, as a process killed while finding hosts leaves
        it: made by a process that has `ended`, or by this one."""
        make = "from axonml_distributed.hosts.layout import _Proof; print(_Proof.path(_Proof.create().name))"
        if ended:
            made = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, check=True)
            path = made.stdout.strip()
        else:
            from axonml_distributed.hosts.layout import _Proof

            path = str(_Proof.path(_Proof.create().name))
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    def headerless(content: bytes, age: float = 3600) -> str:
        """A segment's name whose creator was killed before it wrote the header: empty or zeros."""
        path = f"{SHM}/{PREFIX}{secrets.token_hex(16)}"
        with open(path, "wb") as f:
            f.write(content)
        os.chmod(path, 0o600)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    stale = [segment(dead.pid), proof(ended=True), headerless(b""), headerless(bytes(8192))]
    keep = [segment(os.getpid()), segment(dead.pid, magic=b"NOTOURS!"), segment(dead.pid, age=1)]
    keep += [headerless(b"", age=1), headerless(b"\1" + bytes(100))]
    keep += [proof(ended=False), proof(ended=True, age=1)]
    try:
        removed = cleanup_stale_segments(min_age=60)
        # A subset: anything stale an earlier test of the run left is this sweep's to remove too.
        assert {"/" + os.path.basename(p) for p in stale} <= set(removed), removed
        assert not any(os.path.exists(p) for p in stale)
        assert all(os.path.exists(p) for p in keep)
    finally:
        for p in [*stale, *keep]:
            if os.path.exists(p):
                os.unlink(p)
