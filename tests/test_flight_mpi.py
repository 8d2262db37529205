"""The MPI group's calls in the engine's flight recorder (`_core.FlightRecorder`, recorded by
`axonml_distributed.mpi`): an `mpiexec` job's dumps and stats (tests/mpi_jobs/flight.py) against the calls
the job makes, and what `trace analyze` says of a job whose rank 1 went astray."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from axonml_distributed import trace
from mpi_run import needs_mpi, passes, remove_segments_of_aborted_jobs

_segments = pytest.fixture(autouse=True)(remove_segments_of_aborted_jobs)

# The collectives of tests/mpi_jobs/flight.py on 2 ranks, in order: (kind, dtype, count, bytes).
COLLECTIVES = [
    ("all_reduce", "float32", 4, 16),
    ("all_reduce", "float64", 1000, 8000),
    ("broadcast", "float32", 4, 16),
    ("all_gather", "float32", 4, 16),
]
BARRIER = ("barrier", None, 0, 0)
# Its sends and receives: (sender, receiver, tag, dtype, count, call of the receiver).
MESSAGES = [
    (0, 1, 2, "int32", 5, "recv(5 x int32 from rank 0, tag 2)"),
    (0, 1, 4, "float64", 3, "recv(3 x float64 from any source: rank 0, tag 4)"),
]


def _job(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = passes(2, "flight.py", str(tmp_path), mode, env=env)
    assert out.count(f"flight {mode} OK") == 2, out
    return trace.load(tmp_path)


def _stats(tmp_path: Path, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"stats{rank}.json").read_text())


@needs_mpi
@pytest.mark.timeout(240)
def test_an_mpi_job_s_record_and_stats_are_the_calls_it_made(tmp_path: Path) -> None:
    content = _job(tmp_path, "plain")
    assert set(content["ranks"]) == {"0", "1"}
    for rank in (0, 1):
        dump = content["ranks"][str(rank)]
        assert dump["world"] == "mpi"
        (group,) = dump["pg_config"]
        assert group.endswith(":0,1#1"), dump["pg_config"]
        collectives = [e for e in dump["entries"] if not e["is_p2p"]]
        got = [(e["kind"], e["dtype"], e["count"], e["collective_seq_id"], e["state"]) for e in collectives]
        want = [(k, t, c, seq, "completed") for seq, (k, t, c, _) in enumerate([*COLLECTIVES, BARRIER], 1)]
        assert got == want, got
        assert all(e["route"] == "mpi" and e["process_group"][0] == group for e in dump["entries"])
        p2p = [
            (e["kind"], e["peer"], e["tag"], e["count"], e["call"]) for e in dump["entries"] if e["is_p2p"]
        ]
        if rank == 0:
            want_p2p = [
                ("send", 1, tag, c, f"send({c} x {t} to rank 1, tag {tag})")
                for _, _, tag, t, c, _ in MESSAGES
            ]
        else:
            want_p2p = [("recv", 0, tag, c, call) for _, _, tag, _, c, call in MESSAGES]
        assert p2p == want_p2p, p2p
        stats = _stats(tmp_path, rank)
        want_stats: dict[str, tuple[int, int]] = {}
        for kind, _, _, nbytes in [*COLLECTIVES, BARRIER]:
            calls, total = want_stats.get(kind, (0, 0))
            want_stats[kind] = (calls + 1, total + nbytes)
        sizes = {"int32": 4, "float64": 8}
        want_stats["send" if rank == 0 else "recv"] = (
            len(MESSAGES),
            sum(sizes[t] * c for _, _, _, t, c, _ in MESSAGES),
        )
        assert {k: (s["calls"], s["bytes"]) for k, s in stats.items()} == want_stats, stats
        for kind, s in stats.items():
            assert s["failed"] == 0 and s["routes"] == {"mpi": s["calls"]}, (kind, s)
    assert trace.analyze(content).summary() == "every rank completed every recorded call"


@needs_mpi
@pytest.mark.timeout(240)
def test_a_mismatched_mpi_job_s_analysis_names_the_rank_and_call(tmp_path: Path) -> None:
    analysis = trace.analyze(_job(tmp_path, "mismatch"))
    (group,) = analysis.groups
    assert (group.diverged_at, group.diverging_ranks) == (len(COLLECTIVES) + 1, [1]), group
    assert group.calls_at_divergence == {
        0: "all_reduce(#5, 4 x float32, op=SUM)",
        1: "broadcast(#5, 4 x float32, root=0)",
    }
    assert "ranks diverged at #5: rank 1 called it differently" in analysis.summary()


@needs_mpi
@pytest.mark.timeout(240)
def test_an_mpi_job_s_timeline_holds_its_calls(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    _job(tmp_path, "plain", env={"AXONML_TIMELINE": str(path)})
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = Counter(
        (e["pid"], tracks[(e["pid"], e["tid"])].split(" ")[0], e["name"], e["args"]["bytes"])
        for e in events
        if e["ph"] == "X" and e["cat"] != "phase"
    )
    want: Counter[tuple[int, str, str, int]] = Counter()
    for rank in (0, 1):
        for kind, _, _, nbytes in [*COLLECTIVES, BARRIER]:
            want[(rank, "group", kind, nbytes)] += 1
        for _, _, _, dtype, count, _ in MESSAGES:
            want[
                (rank, "p2p", "send" if rank == 0 else "recv", {"int32": 4, "float64": 8}[dtype] * count)
            ] += 1
    assert spans == want, spans
