"""Sends and receives in the flight recorder and the timeline (rust/flight.rs, recorded by the engine where
it checks their peer): each rank's records and totals against the messages the test exchanged, in the
thread world, the shared-memory world and torch's point to point over the "axonml" backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed import trace
from shm_run import connect, free_port, ok, run_world
from threads_run import outcomes

pytestmark = pytest.mark.timeout(60)

# The messages of `_exchange`: (sender, receiver, tag, dtype, elements, how the receiver takes it).
MESSAGES: list[tuple[int, int, int, str, int, str]] = [
    (0, 1, 3, "float32", 4, "recv"),
    (1, 0, 0, "float64", 1000, "recv"),
    (0, 1, 7, "int32", 5, "recv_any"),
    (1, 0, 2, "float32", 1 << 16, "recv"),
]


def _exchange(pg: ad.ProcessGroup) -> None:
    """Each message of MESSAGES, the sender's send asynchronous (an isend) every other time."""
    me = pg.rank()
    for i, (src, dst, tag, dtype, elems, how) in enumerate(MESSAGES):
        buf = np.full(elems, i, dtype)
        if me == src:
            work = pg.send(buf, dst, tag, async_op=i % 2 == 0)
            if work is not None:
                work.wait()
        elif me == dst and how == "recv":
            pg.recv(buf, src, tag)
        elif me == dst:
            assert pg.recv_any(buf, tag) == src
    pg.barrier()


def _expected(rank: int) -> list[tuple[str, int, int, str, int, str]]:
    """This rank's sends and receives, in order: (kind, peer, tag, dtype, elements, call text)."""
    out = []
    for src, dst, tag, dtype, elems, how in MESSAGES:
        if rank == src:
            out.append(("send", dst, tag, dtype, elems, f"send({elems} x {dtype} to rank {dst}, tag {tag})"))
        elif rank == dst:
            peer = f"any source: rank {src}" if how == "recv_any" else f"rank {src}"
            out.append(("recv", src, tag, dtype, elems, f"recv({elems} x {dtype} from {peer}, tag {tag})"))
    return out


def _mine(pg: ad.ProcessGroup) -> dict[str, Any]:
    """This rank's dump, of its groups in `pg`'s world only: the newest of the process ("w<n>:...", n
    counting the worlds the process made), as a group of an earlier test's world may still be alive."""
    dump = trace.flight_record()["ranks"][str(pg.rank())]
    newest = max(int(name.split(":")[0][1:]) for name in dump["pg_config"])
    dump["pg_config"] = {k: v for k, v in dump["pg_config"].items() if k.startswith(f"w{newest}:")}
    dump["entries"] = [e for e in dump["entries"] if e["process_group"][0] in dump["pg_config"]]
    return dump


def _recorded(pg: ad.ProcessGroup) -> tuple[dict[str, Any], dict[str, Any]]:
    """`_exchange`, then this rank's dump and stats."""
    _exchange(pg)
    mine = _mine(pg)
    pg.barrier()  # every rank read its record before any leaves
    return mine, pg.stats()


def _check(rank: int, dump: dict[str, Any], stats: dict[str, Any]) -> None:
    want = _expected(rank)
    p2p = [e for e in dump["entries"] if e["is_p2p"]]
    got = [(e["kind"], e["peer"], e["tag"], e["dtype"], e["count"], e["call"]) for e in p2p]
    assert got == want, got
    assert [e["p2p_seq_id"] for e in p2p] == list(range(1, len(want) + 1))
    for e, (kind, peer, *_rest) in zip(p2p, want, strict=True):
        assert e["state"] == "completed" and e["time_created_ns"] <= e["time_discovered_completed_ns"], e
        # torch's names, by group ranks (here the global ones).
        arrow = f"{rank}->{peer}" if kind == "send" else f"{rank}<-{peer}"
        assert e["profiling_name"] == f"axonml:{kind} {arrow}", e
    # The barrier after them is the group's first collective, recorded as before.
    (barrier,) = [e for e in dump["entries"] if not e["is_p2p"]]
    assert (barrier["kind"], barrier["collective_seq_id"]) == ("barrier", 1), barrier
    size = {"float32": 4, "float64": 8, "int32": 4}
    for kind in ("send", "recv"):
        mine = [w for w in want if w[0] == kind]
        nbytes = sum(size[w[3]] * w[4] for w in mine)
        assert (stats[kind]["calls"], stats[kind]["bytes"], stats[kind]["failed"]) == (len(mine), nbytes, 0)


def test_sends_and_receives_are_recorded_with_their_peers_and_bytes_threads() -> None:
    for rank, (dump, stats) in enumerate(ad.spawn(_recorded, 2)):
        _check(rank, dump, stats)


def w_recorded(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> Any:
    return _recorded(connect(rank, n, ports[0], timeout))


@pytest.mark.timeout(120)
def test_sends_and_receives_are_recorded_with_their_peers_and_bytes_shm() -> None:
    for rank, (dump, stats) in enumerate(ok(run_world(2, w_recorded, timeout=30))):
        _check(rank, dump, stats)


def _check_timeline(path: Path) -> None:
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for rank in (0, 1):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "p2p"]
        assert {names[(rank, e["tid"])] for e in spans} == {f"p2p w{n}:0,1#1" for n in _worlds(names, rank)}
        got = Counter((e["name"], e["args"]["peer"], e["args"]["tag"], e["args"]["bytes"]) for e in spans)
        size = {"float32": 4, "float64": 8, "int32": 4}
        want = Counter(
            (k, peer, tag, size[dtype] * elems) for k, peer, tag, dtype, elems, _ in _expected(rank)
        )
        assert got == want, got
        assert all(e["args"]["state"] == "completed" for e in spans)


def _worlds(names: dict[tuple[int, int], str], rank: int) -> set[str]:
    """The world ordinals of `rank`'s group tracks ("group w3:0,1#1" -> "3")."""
    return {
        n.split(":")[0].split(" w")[1] for (r, _), n in names.items() if r == rank and n.startswith("group")
    }


def test_sends_and_receives_are_on_the_timeline_threads(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    with ad.timeline(path):
        ad.spawn(_exchange, 2)
    _check_timeline(path)


def w_timeline(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any, path: str) -> str:
    pg = connect(rank, n, ports[0], timeout)
    with ad.timeline(path):
        _exchange(pg)
    return "done"


@pytest.mark.timeout(120)
def test_sends_and_receives_are_on_the_timeline_shm(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    assert ok(run_world(2, w_timeline, str(path), timeout=30)) == ["done", "done"]
    _check_timeline(path)


@pytest.mark.timeout(180)
def test_torch_s_batch_isend_irecv_over_axonml_is_recorded(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    job = Path(__file__).parent / "torch_jobs" / "flight_p2p.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(job), str(tmp_path)]
    keep = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    run = subprocess.run(
        cmd, env={**keep, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=150
    )
    assert run.returncode == 0, run.stdout + run.stderr
    content = trace.load(tmp_path)
    for rank in (0, 1):
        other = 1 - rank
        entries = content["ranks"][str(rank)]["entries"]
        got = sorted(
            (e["kind"], e["peer"], e["tag"], e["dtype"], e["count"], e["state"])
            for e in entries
            if e["is_p2p"]
        )
        # The ring's receive from the previous rank and send to the next (here both the other rank), then
        # rank 0's isend of 7 float64 with tag 3 to rank 1.
        want = [("recv", other, 0, "float32", 5, "completed"), ("send", other, 0, "float32", 5, "completed")]
        want.append(
            ("send", 1, 3, "float64", 7, "completed")
            if rank == 0
            else ("recv", 0, 3, "float64", 7, "completed")
        )
        assert got == sorted(want), got


def test_a_receive_that_failed_is_what_the_analysis_names() -> None:
    def fn(pg: ad.ProcessGroup) -> dict[str, Any]:
        pg.all_reduce(np.ones(2, np.float32))
        if pg.rank() == 1:
            # Rank 0 never sends: the receive times out, or finds rank 0 gone.
            with pytest.raises(ad.DistributedError):
                pg.recv(np.empty(6, np.int64), 0, tag=8)
        return _mine(pg)

    dumps = outcomes(2, fn, timeout=0.3)
    analysis = trace.analyze(trace.merge([{"world_size": 2, "ranks": {str(d["rank"]): d for d in dumps}}]))
    (group,) = analysis.groups
    assert group.pending_p2p == {1: ["recv(6 x int64 from rank 0, tag 8) failed"]}, group
    assert analysis.summary() == f"group {group.name}: rank 1's recv(6 x int64 from rank 0, tag 8) failed"
    assert "  rank 1: not completed: recv(6 x int64 from rank 0, tag 8) failed" in analysis.lines()
