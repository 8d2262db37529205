"""The flight recorder (rust/flight.rs, `axonml_distributed.trace`): every rank's last calls per group and
its totals (`ProcessGroup.stats`), the records failed jobs leave under axonml-run and what their analysis
says, and the progress report timeouts and peer failures carry."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed import trace
from launcher_run import finish_launcher, start_launcher, worker_script
from shm_run import connect, ok, run_world
from threads_run import outcomes

pytestmark = pytest.mark.timeout(60)

# The calls the stats tests make, in order: (kind, elements, how to call it on `pg` with array `x`).
# all_reduce of 4 float32 goes one-shot, of 1 MiB does not.
CALLS: list[tuple[str, int, Any]] = [
    ("all_reduce", 4, lambda pg, x: pg.all_reduce(x)),
    ("all_reduce", 4, lambda pg, x: pg.all_reduce(x)),
    ("broadcast", 4, lambda pg, x: pg.broadcast(x, 0)),
    ("all_reduce", 1 << 18, lambda pg, x: pg.all_reduce(x)),
    ("barrier", 0, lambda pg, x: pg.barrier()),
    ("all_reduce", 4, lambda pg, x: pg.all_reduce(x)),
    ("broadcast", 1 << 18, lambda pg, x: pg.broadcast(x, 1)),
]


def _make_calls(pg: ad.ProcessGroup) -> dict[str, Any]:
    for _, elems, call in CALLS:
        call(pg, np.ones(max(elems, 1), np.float32))
    return pg.stats()


def _expected_stats() -> dict[str, tuple[int, int]]:
    """Per kind: calls and bytes, from the list of calls made (barriers move nothing)."""
    want: dict[str, tuple[int, int]] = {}
    for kind, elems, _ in CALLS:
        calls, nbytes = want.get(kind, (0, 0))
        want[kind] = (calls + 1, nbytes + 4 * elems)
    return want


def _check_stats(stats: dict[str, Any]) -> None:
    want = _expected_stats()
    assert {k: (s["calls"], s["bytes"]) for k, s in stats.items()} == want, stats
    for kind, s in stats.items():
        assert s["failed"] == 0, (kind, s)
        # Every completed call took one route.
        assert sum(s["routes"].values()) == s["calls"], (kind, s)
        assert s["wait_s"] >= 0 and s["move_s"] >= 0, (kind, s)
    assert stats["all_reduce"]["routes"]["oneshot"] == 3, stats["all_reduce"]
    assert stats["barrier"]["routes"] == {"none": 1}, stats["barrier"]


def test_stats_count_the_calls_made_threads() -> None:
    for stats in ad.spawn(_make_calls, 2):
        _check_stats(stats)


def w_stats(rank: int, n: int, ports: list[int], job: Any, timeout: float, q: Any) -> dict[str, Any]:
    return _make_calls(connect(rank, n, ports[0], timeout))


@pytest.mark.timeout(120)
def test_stats_count_the_calls_made_shm() -> None:
    for stats in ok(run_world(2, w_stats, timeout=30)):
        _check_stats(stats)


def test_stats_of_a_group_are_its_own_and_a_failed_call_counts_as_failed() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = pg.new_group([0, 1])
        sub.all_reduce(np.ones(3, np.float32))
        try:
            pg.all_reduce(np.ones(3 + pg.rank(), np.float32))  # a mismatch on every rank
        except ad.CollectiveMismatchError:
            pass
        return pg.stats(), sub.stats()

    for world, sub in outcomes(2, fn):
        assert world == {
            "all_reduce": {"calls": 1, "failed": 1, "bytes": 0, "wait_s": 0.0, "move_s": 0.0, "routes": {}}
        }, world
        assert (sub["all_reduce"]["calls"], sub["all_reduce"]["bytes"]) == (1, 12), sub


def test_each_rank_records_its_calls_per_group_in_order() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        x = np.ones(6, np.float64)
        pg.all_reduce(x, ad.ReduceOp.MAX)
        sub = pg.new_group([0, 1])
        pg.broadcast(x, 1)
        sub.all_gather(x, np.empty(12, np.float64))
        pg.barrier()
        mine = trace.flight_record()["ranks"][str(pg.rank())]
        pg.barrier()  # every rank read its record before any group goes
        return mine

    for rank, dump in enumerate(outcomes(2, fn)):
        assert dump["rank"] == rank
        # Named for the world's ordinal in this process (which other tests' worlds advanced) and ranks.
        world = dump["entries"][0]["process_group"][0].split(":")[0]
        first, second = f"{world}:0,1#1", f"{world}:0,1#2"
        assert set(dump["pg_config"]) == {first, second}, dump["pg_config"]
        assert dump["pg_config"][first]["desc"] == "default_pg"
        got = [
            (e["process_group"][0], e["collective_seq_id"], e["profiling_name"], e["state"])
            for e in dump["entries"]
        ]
        assert got == [
            (first, 1, "axonml:all_reduce", "completed"),
            (first, 2, "axonml:broadcast", "completed"),
            (second, 1, "axonml:all_gather", "completed"),
            (first, 3, "axonml:barrier", "completed"),
        ], got
        assert [e["record_id"] for e in dump["entries"]] == [0, 1, 2, 3]
        reduce, bcast, gather, _ = dump["entries"]
        assert (reduce["op"], reduce["input_dtypes"], reduce["input_sizes"]) == ("MAX", ["Double"], [[6]])
        assert (bcast["root"], gather["output_sizes"]) == (1, [[12]])
        for e in dump["entries"]:
            assert (
                e["time_created_ns"] <= e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"]
            )


def test_the_ring_keeps_the_last_calls_the_environment_asks_for(tmp_path: Path) -> None:
    # The size is read once per process: a fresh one.
    script = textwrap.dedent(
        """
        import json, sys
        import numpy as np
        import axonml_distributed as ad
        from axonml_distributed import trace

        def fn(pg):
            for _ in range(10):
                pg.all_reduce(np.ones(2, np.float32))
            pg.barrier()
            got = trace.flight_record()["ranks"][str(pg.rank())]["entries"]
            pg.barrier()
            return [(e["collective_seq_id"], e["record_id"]) for e in got]

        print(json.dumps(ad.spawn(fn, 2)))
        """
    )
    env = dict(os.environ, AXONML_FLIGHT_RECORDER_ENTRIES="4")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for entries in json.loads(run.stdout):
        # Calls 1-11 were recorded (the second barrier is in flight); the ring holds the 4 before it.
        assert [tuple(e) for e in entries] == [(8, 7), (9, 8), (10, 9), (11, 10)], entries


def _message(pg: ad.ProcessGroup, src: int, buf: np.ndarray, any_source: bool = False) -> None:
    """`buf` from rank `src` to the other of two ranks (received from any source if `any_source`)."""
    if pg.rank() == src:
        pg.send(buf, 1 - src)
    elif any_source:
        assert pg.recv_any(buf) == src
    else:
        pg.recv(buf, src)


def test_torch_analyzer_matches_our_dumps() -> None:
    pytest.importorskip("torch")
    from torch.distributed.flight_recorder.components.builder import build_db

    def fn(pg: ad.ProcessGroup) -> Any:
        x = np.ones(8, np.float32)
        # Sends and receives between collectives: torch numbers them apart (p2p_seq_id 1, 2, 3) from the
        # collectives (collective_seq_id 1, 2, 3), so each of them has the number of a collective beside it.
        pg.all_reduce(x)
        _message(pg, 0, np.ones(3, np.float64))
        pg.broadcast(x, 0)
        _message(pg, 1, np.ones(5, np.int32))
        _message(pg, 0, np.ones(2, np.float32), any_source=True)
        pg.all_gather(x, np.empty(16, np.float32))
        pg.barrier()
        mine = trace.flight_record()["ranks"][str(pg.rank())]
        pg.barrier()
        return mine

    dumps = outcomes(2, fn)
    for dump in dumps:
        got = [(e["profiling_name"], e["collective_seq_id"], e["is_p2p"]) for e in dump["entries"]]
        me, peer = dump["rank"], 1 - dump["rank"]
        to, of = f"axonml:send {me}->{peer}", f"axonml:recv {me}<-{peer}"
        assert got == [
            ("axonml:all_reduce", 1, False),
            (to if me == 0 else of, 1, True),  # a send or receive: the group's last collective's number
            ("axonml:broadcast", 2, False),
            (to if me == 1 else of, 2, True),
            (to if me == 0 else of, 2, True),
            ("axonml:all_gather", 3, False),
            ("axonml:barrier", 4, False),
        ], got
        p2p = [e["p2p_seq_id"] for e in dump["entries"] if e["is_p2p"]]
        assert p2p == [trace.record.P2P_SEQ_BASE + n for n in (1, 2, 3)], p2p
    # torch's loader unpickles files named <prefix><rank>; its matcher takes the loaded dumps as they are.
    details = {f"rank{d['rank']}": copy.deepcopy(d) for d in dumps}
    args = argparse.Namespace(
        verbose=False, just_print_entries=False, allow_incomplete_ranks=False, mismatch_cap=10
    )
    db = build_db(details, args, trace.record.TORCH_VERSION)
    # Every call matched across both ranks (as seen from rank 0, whose records torch walks first).
    got = [(c.collective_name, c.input_sizes, c.pass_check, c.collective_state) for c in db.collectives]
    assert got == [
        ("axonml:all_reduce", [[8]], True, "completed"),
        ("axonml:send 0->1", [[3]], True, "completed"),
        ("axonml:broadcast", [[8]], True, "completed"),
        ("axonml:recv 0<-1", [[5]], True, "completed"),
        ("axonml:send 0->1", [[2]], True, "completed"),
        ("axonml:all_gather", [[8]], True, "completed"),
        ("axonml:barrier", [[0]], True, "completed"),
    ], got
    # Each is one call on each rank.
    assert sorted(Counter(c.collective_id for c in db.ncclcalls).values()) == [2] * len(got)


def test_a_timeout_and_an_abort_say_where_each_rank_is() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        pg.all_reduce(np.ones(3, np.float32))
        if pg.rank() == 1:
            time.sleep(1.0)  # rank 0 times out meanwhile and aborts the world
        pg.barrier()

    timeout, aborted = outcomes(2, fn, timeout=0.3)
    assert isinstance(timeout, ad.CollectiveTimeoutError), timeout
    assert isinstance(aborted, ad.PeerFailureError), aborted
    # The message ends with it; the `progress` fact holds it alone.
    progress = aborted.progress or ""
    assert progress.startswith("where each rank is: rank 0 completed #1 all_reduce and "), aborted
    assert "rank 1 completed #1 all_reduce" in progress and str(aborted).endswith("; " + progress), aborted


def test_a_peer_failure_says_where_each_rank_is() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        pg.all_reduce(np.ones(3, np.float32))
        if pg.rank() == 1:
            return None  # leaves the world
        pg.all_reduce(np.ones(3, np.float32))

    err = outcomes(2, fn)[0]
    assert isinstance(err, ad.PeerFailureError), err
    assert "peer rank 1 died during all_reduce(#2" in str(err), err
    assert (
        "; where each rank is: rank 0 completed #1 all_reduce and waits in #2 all_reduce, rank 1 completed #1"
        in str(err)
    ), err


# Failed jobs under axonml-run: rank 1 of 3 goes astray at the third call (an all_reduce on the others).
FAULTY = """
import numpy as np
import axonml_distributed as ad

MODE = sys.argv[2]
pg = ad.init_process_group("shm", timeout=2.0)
x = np.ones(8, np.float32)
pg.all_reduce(x)
pg.barrier()
if RANK == 1 and MODE == "mismatch":
    pg.broadcast(x, 0)
elif RANK == 1 and MODE == "timeout":
    time.sleep(4)  # the others time out meanwhile; this rank then finds the world aborted
    pg.all_reduce(x)
elif RANK == 1 and MODE == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    pg.all_reduce(x)
"""


def _failed_job(tmp_path: Path, mode: str) -> tuple[str, trace.Analysis, dict[str, Any]]:
    script = worker_script(tmp_path, FAULTY)
    launcher = start_launcher("--nproc-per-node", "3", "--failure-grace-period", "15", script, tmp_path, mode)
    _, err = finish_launcher(launcher)
    assert launcher.returncode == 1, err
    found = re.search(r"^axonml-run: flight record of ranks [0-9, ]+ in (\S+): ", err, re.M)
    assert found, err
    path = Path(found[1])
    try:
        content = trace.load(path)
    finally:
        path.unlink()
    return err, trace.analyze(content), content


@pytest.mark.timeout(90)
def test_a_mismatched_job_leaves_a_record_naming_the_rank_and_call(tmp_path: Path) -> None:
    err, analysis, content = _failed_job(tmp_path, "mismatch")
    assert set(content["ranks"]) == {"0", "1", "2"}
    (group,) = analysis.groups
    assert (group.diverged_at, group.diverging_ranks) == (3, [1]), group
    assert group.calls_at_divergence[1] == "broadcast(#3, 8 x float32, root=0)"
    assert group.calls_at_divergence[0] == "all_reduce(#3, 8 x float32, op=SUM)"
    assert "ranks diverged at #3: rank 1 called it differently" in err, err


@pytest.mark.timeout(90)
def test_a_timed_out_job_leaves_a_record_naming_the_rank_and_call(tmp_path: Path) -> None:
    _, analysis, content = _failed_job(tmp_path, "timeout")
    (group,) = analysis.groups
    assert group.diverged_at is None, group
    assert (group.stuck_at, group.never_entered, group.no_record) == (3, [1], []), group
    assert group.stuck_call == "all_reduce(#3, 8 x float32, op=SUM)"
    assert "Timed out" in analysis.errors[0], analysis.errors


@pytest.mark.timeout(90)
def test_a_job_with_a_killed_rank_leaves_a_record_naming_the_rank_and_call(tmp_path: Path) -> None:
    _, analysis, content = _failed_job(tmp_path, "killed")
    assert set(content["ranks"]) == {"0", "2"} and content["world_size"] == 3
    (group,) = analysis.groups
    assert (group.stuck_at, group.no_record) == (3, [1]), group
    assert group.stuck_call == "all_reduce(#3, 8 x float32, op=SUM)"
    assert "peer rank 1 died" in analysis.errors[0], analysis.errors


def test_analyze_reads_a_directory_of_dumps(tmp_path: Path) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        pg.all_reduce(np.ones(2, np.float32))
        pg.barrier()
        pg.barrier()
        if pg.rank() == 0:
            trace.dump_flight_recorder(tmp_path / "job.json")
        pg.barrier()

    outcomes(2, fn)
    (tmp_path / "other.txt").write_text("not a record")
    run = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.trace", "analyze", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "rank 0: completed #3 barrier(#3)" in run.stdout, run.stdout
    # Rank 0 dumps once it has left barrier #3: rank 1 has entered it (so completed #2), and may or may
    # not have recorded #3's end yet.
    assert re.search(
        r"rank 1: completed (#3 barrier\(#3\)|#2 barrier\(#2\), then barrier\(#3\))", run.stdout
    ), run.stdout
