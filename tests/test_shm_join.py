"""Joining the shared-memory world: the rendezvous admits only ranks that prove they belong to the job
(strangers learn nothing and do not fail it), a job started by the launcher or by hand, a port in use, a
member started with another world size, Ctrl-C during the rendezvous.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from axonml_distributed import (
    CollectiveTimeoutError,
)
from axonml_distributed._core import ShmBackend
from shm_run import (
    connect,
    free_port,
    hello,
    ok,
    recv_exact,
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


def _probe(port: int, send: bytes, proof: bool = False) -> bytes:
    """Connect as a stranger, send `send` (and, after a challenge, a made-up proof), return all it hears."""
    heard = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(send)
        if proof:
            heard += recv_exact(c, 32)
            c.sendall(os.urandom(32))
        try:
            while chunk := c.recv(4096):
                heard += chunk
        except OSError:  # a timeout or a reset: either way nothing more was said
            pass
    return heard


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
            "garbage": (b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100), False),
            "hello without the secret": (hello(1, 2, False), False),
            "hello with a wrong proof": (hello(1, 2, True), True),
            "hello for another world size": (hello(1, 3, False), False),
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
    # A stranger with a secret-capable hello gets rank 0's random challenge, nothing else.
    assert len(heard.pop("hello with a wrong proof")) == 32
    assert heard == dict.fromkeys(heard, b""), heard


@pytest.mark.timeout(60)
def test_without_a_secret_same_user_processes_join_and_other_users_are_refused():
    port = free_port()
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
                os.write(w, b"+" + _probe(port, hello(1, 2, False)))
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
        assert ok(run_world(2, w_late, 3.0, timeout=10, secret=None, ports=[port])) == [3.0, 3.0]
    finally:
        t.join()
    if os.geteuid() == 0:
        assert stranger == {"heard": b"+", "rc": b"\0\0"}, stranger


@pytest.mark.timeout(30)
def test_a_rank_with_another_secret_is_not_admitted_and_both_time_out_naming_each_other():
    port = free_port()
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
