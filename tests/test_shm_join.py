"""Joining the shared-memory world: the rendezvous admits only ranks that prove they belong to the job
(strangers learn nothing and do not fail it), a job started by the launcher or by hand, a port in use, a
member started with another world size or secret, a store that never answers, Ctrl-C during the
rendezvous.
"""

from __future__ import annotations

import os
import re
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
    CollectiveTimeoutError,
    DistributedError,
)
from axonml_distributed._core import ShmBackend
from shm_run import (
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
)

no_leak = pytest.fixture(autouse=True)(segments_unchanged)


@pytest.mark.timeout(30)
def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(OSError, match="MASTER_PORT"):
            ShmBackend.connect(0, 2, "127.0.0.1", s.getsockname()[1], timeout=2)


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


@pytest.mark.timeout(60)
def test_a_job_started_by_hand_authenticates_with_the_secret_in_its_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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


def w_late(rank, n, ports, job, timeout, q, delay):
    """Rank 0 listens at once; the others join `delay` seconds later (after the strangers came)."""
    if rank:
        time.sleep(delay)
    pg = connect(rank, n, ports[0], timeout)
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


def _probe(port: int, send: bytes) -> bytes:
    """Connect as a stranger, send `send`, return all it hears."""
    heard = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(send)
        try:
            while chunk := c.recv(4096):
                heard += chunk
        except OSError:  # a timeout or a reset: either way nothing more was said
            pass
    return heard


def _knock(port: int, knock: bytes) -> None:
    """Speak rank 0's store as a process of this user that does not know the job's secret: take a knock
    slot and fill it with `knock`."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(request(3, "axonml/knocks", (1).to_bytes(8, "little", signed=True)))
        head = recv_exact(c, 3)
        slot = int.from_bytes(recv_exact(c, struct.unpack("<H", head[1:])[0]), "little", signed=True)
        c.sendall(request(1, f"axonml/knock/{slot}", knock))
        recv_exact(c, 3)


@pytest.mark.timeout(60)
def test_strangers_at_the_rendezvous_learn_nothing_and_do_not_fail_the_job():
    port = free_port()
    heard: dict[str, bytes] = {}
    silent: list[socket.socket] = []

    def strangers() -> None:
        _wait_listening(port)
        # More silent sockets than the job's timeout allows when they are served one by one.
        silent.extend(socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12))
        probes = {
            "garbage": b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100),
            "an unknown request": request(9, "axonml/rank0"),
            "a request with trailing bytes": request(2, "axonml/rank0", b"x"),
        }
        threads = [
            threading.Thread(target=lambda k=k, v=v: heard.__setitem__(k, _probe(port, v)))
            for k, v in probes.items()
        ]
        # Knocks without the secret, with a made-up proof, or for another world size: noted, ignored.
        knocks = [hello(1, 2), hello(1, 2, os.urandom(32)), hello(1, 3, os.urandom(32))]
        threads += [threading.Thread(target=_knock, args=(port, k)) for k in knocks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t = threading.Thread(target=strangers)
    t.start()
    try:
        res = ok(run_world(2, w_late, 3.0, timeout=8, ports=[port]))
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
    assert heard == dict.fromkeys(heard, b""), heard


def _as_nobody(port: int, send: bytes) -> bytes:
    """What a process of another user (uid 65534) hears after sending `send` to rank 0's store."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only talks to the socket and leaves
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, b"+" + _probe(port, send))
            code = 0
        except BaseException as e:  # noqa: BLE001 - told to the parent
            os.write(w, repr(e).encode())
        finally:
            os._exit(code)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0, out
    return out


@pytest.mark.timeout(60)
def test_without_a_secret_same_user_processes_join_and_other_users_are_refused():
    port = free_port()
    stranger: dict[str, bytes] = {}

    def other_user() -> None:
        _wait_listening(port)
        if os.geteuid() == 0:
            stranger["heard"] = _as_nobody(port, request(2, "axonml/rank0"))

    t = threading.Thread(target=other_user)
    t.start()
    try:
        assert ok(run_world(2, w_late, 3.0, timeout=10, secret=None, ports=[port])) == [3.0, 3.0]
    finally:
        t.join()
    if os.geteuid() == 0:
        assert stranger == {"heard": b"+"}, stranger


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs another user")
def test_with_a_secret_another_user_passes_the_store_door_only_with_a_pass_made_with_it():
    """A rank of another user or network namespace (no socket owner to check) reaches rank 0's store
    with the job secret (a pass checked against an independent HMAC); without it, it hears nothing."""
    port, key = free_port(), secrets.token_bytes(32)
    heard: dict[str, bytes] = {}

    def other_user() -> None:
        _wait_listening(port)
        get = request(2, "axonml/rank0")
        for name, k in [("pass", key), ("wrong pass", os.urandom(32))]:
            nonce = os.urandom(32)
            body = nonce + mac(k, b"axonml rendezvous store door", nonce)
            heard[name] = _as_nobody(port, struct.pack("<BH", 6, len(body)) + body + get)

    t = threading.Thread(target=other_user)
    t.start()
    try:
        with pytest.raises(CollectiveTimeoutError):
            ShmBackend.connect(0, 2, "127.0.0.1", port, timeout=6, secret=key)
    finally:
        t.join()
    # The reply: status 1, length, rank 0's hello.
    assert heard["pass"][:2] == b"+\x01" and heard["pass"][4:12] == b"AXONHI03", heard
    assert heard["wrong pass"] == b"+", heard


def _two_ranks(join: Any, keys: list[bytes | None]) -> dict[int, BaseException]:
    """`join(rank, key)` on two threads, rank r with keys[r]: what each raised."""
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            join(r, keys[r])
        except BaseException as e:  # noqa: BLE001 - asserted by the callers
            errors[r] = e

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


# What a rank with another job secret than rank 0's hears, through any store.
REFUSED = (
    "rank 1: rank 0 does not prove that it knows this rank's AXONML_JOB_SECRET: the ranks were started "
    "with different job secrets (or with and without one), or the store is shared with another job"
)
# What rank 0 says of it when its timeout comes.
NOTED = "a process claiming rank 1 does not prove that it knows rank 0's AXONML_JOB_SECRET"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("other", ["another", "none"])
@pytest.mark.parametrize("path", ["launcher", "store"])
def test_a_rank_with_another_secret_is_refused_and_rank_0_times_out_naming_it(path, other):
    """The same refusal on both paths: rank 0's TCP store (the launcher's) and the job's own store."""
    port, store = free_port(), DictStore()
    if path == "launcher":

        def join(r: int, key: bytes | None) -> None:
            ShmBackend.connect(r, 2, "127.0.0.1", port, timeout=3, secret=key)
    else:

        def join(r: int, key: bytes | None) -> None:
            ShmBackend.join(store, r, 2, timeout=3, secret=key)

    errors = _two_ranks(
        join, [secrets.token_bytes(32), secrets.token_bytes(32) if other == "another" else None]
    )
    assert type(errors[1]) is DistributedError and str(errors[1]) == REFUSED, errors
    assert isinstance(errors[0], CollectiveTimeoutError) and "[1]" in str(errors[0]), errors
    assert NOTED in str(errors[0])


@pytest.mark.timeout(30)
def test_a_short_secret_is_refused_the_same_way_on_both_paths_before_anything_is_touched():
    message = "AXONML_JOB_SECRET has 5 bytes (10 hex digits); it must have at least 16 (32 hex digits)"
    store = DictStore()
    with pytest.raises(ValueError, match=re.escape(message)):
        ShmBackend.connect(0, 1, "127.0.0.1", free_port(), timeout=3, secret=b"short")
    with pytest.raises(ValueError, match=re.escape(message)):
        ShmBackend.join(store, 0, 1, timeout=3, secret=b"short")
    assert store.add("n", 0) == 0 and not store.check(["axonml/rank0"])


class _Silent:
    """A store that holds nothing and never sees a key arrive."""

    def set(self, key: str, value: bytes) -> None:
        pass

    def get(self, key: str) -> bytes:
        raise KeyError(key)

    def check(self, keys: list[str]) -> bool:
        return False

    def wait(self, keys: list[str], timeout: Any) -> None:
        time.sleep(timeout.total_seconds())
        raise TimeoutError(keys)

    def add(self, key: str, value: int) -> int:
        return 0

    def delete_key(self, key: str) -> bool:
        return False


@pytest.mark.timeout(30)
def test_a_store_that_never_answers_times_out_naming_what_each_rank_waited_for():
    errors = _two_ranks(lambda r, key: ShmBackend.join(_Silent(), r, 2, timeout=1, secret=key), [None, None])
    assert isinstance(errors[1], CollectiveTimeoutError), errors
    assert "the job's store (_Silent) (waiting for rank 0's hello, key \"axonml/rank0\")" in str(errors[1])
    assert "rank(s) [0]" in str(errors[1])
    assert isinstance(errors[0], CollectiveTimeoutError), errors
    assert "the job's store (_Silent) (waiting for the other ranks' knocks)" in str(errors[0])
    assert "rank(s) [1]" in str(errors[0])


@pytest.mark.timeout(30)
def test_a_rank_0_that_accepts_and_never_answers_times_out_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(
            CollectiveTimeoutError,
            match=r"waiting for a reply from the TCP store of rank 0 at 127\.0\.0\.1:.*rank\(s\) \[0\]",
        ):
            ShmBackend.connect(1, 2, "127.0.0.1", s.getsockname()[1], timeout=1)


@pytest.mark.timeout(30)
def test_a_member_started_with_another_world_size_is_told_why_and_rank_0_names_it_at_its_timeout():
    port, key = free_port(), secrets.token_bytes(32)
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_interrupts_the_rendezvous(rank):
    code = (
        "from axonml_distributed._core import ShmBackend\n"
        f"ShmBackend.connect({rank}, 2, '127.0.0.1', {free_port()}, timeout=60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)  # importing and starting to wait
    t = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert time.time() - t < 10
