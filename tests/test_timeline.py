"""The timeline (`axonml_distributed.trace.timeline_file`): a job's every call, gradient bucket and user span
as one Chrome trace, for the thread world, the shared-memory world of processes and torch DDP over the
"axonml" backend. Each test counts the calls it makes and checks the file against that count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from ddp_models import MLP
from launcher_run import finish_launcher, start_launcher, worker_script
from shm_run import ok, run_world, w_under_timeline

pytestmark = pytest.mark.timeout(60)

# More than a flight recorder's ring holds (64 by default): the timeline must keep every call.
REDUCES = 100
ELEMS = 1000  # float32 each
GATHER = 10  # float64 per rank


def _calls(pg: Any) -> None:
    """The calls every test job makes, in order, on `pg` and on a subgroup of ranks 0 and 1."""
    x = np.ones(ELEMS, np.float32)
    for _ in range(REDUCES):
        pg.all_reduce(x)
    pg.broadcast(x, 1)
    with ad.trace_span("gather", step=1):
        sub = pg.new_group([0, 1])
        sub.all_gather(np.ones(GATHER, np.float64), np.empty(GATHER * 2, np.float64))
    pg.barrier()


# What `_calls` issues per rank and group track: (kind, bytes) counted.
WORLD_CALLS = Counter({("all_reduce", ELEMS * 4): REDUCES, ("broadcast", ELEMS * 4): 1, ("barrier", 0): 1})
SUB_CALLS = Counter({("all_gather", GATHER * 8): 1})


def _load(path: Path) -> dict[str, Any]:
    """The trace at `path`, checked to be a Chrome trace: events with their required fields."""
    trace = json.loads(path.read_text())
    assert isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["dur"] >= 0, e
    return trace


def _tracks(trace: dict[str, Any]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """The spans and phases on each (rank, track name), by the metadata's names."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    for pid, name in processes.items():
        assert name == f"rank {pid}"
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tracks: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], names[(e["pid"], e["tid"])]), []).append(e)
    return tracks


def _spans_with_phases(events: list[dict[str, Any]], phases: tuple[str, ...]) -> list[dict[str, Any]]:
    """The spans among `events` (a track's), each checked to hold its phases, in order, one after the
    other, from its start to its end (a span ends with its last phase; a call that failed early has
    only the first)."""
    spans = [e for e in events if e["cat"] != "phase"]
    inner = sorted((e for e in events if e["cat"] == "phase"), key=lambda e: e["ts"])
    eps = 0.002  # µs: timestamps are rounded to the nanosecond
    for span in spans:
        start, end = span["ts"], span["ts"] + span["dur"]
        mine = [p for p in inner if start - eps <= p["ts"] and p["ts"] + p["dur"] <= end + eps]
        mine = mine[: len(phases)]
        assert [p["name"] for p in mine] == list(phases), (span, mine)
        assert abs(mine[0]["ts"] - start) <= eps and abs(mine[-1]["ts"] + mine[-1]["dur"] - end) <= eps
        for a, b in zip(mine, mine[1:], strict=False):
            assert abs(a["ts"] + a["dur"] - b["ts"]) <= eps
    assert len(inner) == len(phases) * len(spans)
    return spans


def _group_track(tracks: dict[tuple[int, str], Any], rank: int, ranks: str, nth: int) -> list[dict[str, Any]]:
    """The events of `rank`'s track of its `nth` group over `ranks` ("0,1")."""
    found = [
        k for k in tracks if k[0] == rank and k[1].startswith("group w") and k[1].endswith(f":{ranks}#{nth}")
    ]
    assert len(found) == 1, (rank, list(tracks))
    return tracks[found[0]]


def _check_job(trace: dict[str, Any], ranks: int) -> None:
    """The trace of `_calls` on `ranks` ranks: every call on its rank's group track, with its kind, bytes,
    state and phases; the user's spans; one barrier overlapping on every rank."""
    tracks = _tracks(trace)
    barriers = []
    for rank in range(ranks):
        for group, nth, want in (("0,1", 1, WORLD_CALLS), ("0,1", 2, SUB_CALLS)):
            spans = _spans_with_phases(
                _group_track(tracks, rank, group, nth), ("waiting for peers", "moving data")
            )
            assert Counter((s["name"], s["args"]["bytes"]) for s in spans) == want, rank
            assert all(s["args"]["kind"] == s["name"] and s["args"]["state"] == "completed" for s in spans)
            # Sequence numbers 1..n on each group, in order of time.
            seqs = [s["args"]["seq"] for s in sorted(spans, key=lambda s: s["ts"])]
            assert seqs == list(range(1, len(spans) + 1)), seqs
            barriers += [s for s in spans if s["name"] == "barrier"]
        user = tracks[(rank, "user")]
        assert [(s["name"], s["args"]) for s in user] == [("gather", {"step": 1})]
    # No rank leaves a barrier before every rank entered it: the spans overlap (clocks aligned to 1 ms).
    assert len(barriers) == ranks
    latest_start = max(b["ts"] for b in barriers)
    earliest_end = min(b["ts"] + b["dur"] for b in barriers)
    assert latest_start <= earliest_end + 1000, barriers


def test_thread_world_timeline_holds_every_call_of_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    with ad.timeline(path):
        ad.spawn(_calls, 2)
    _check_job(_load(path), 2)


ENV_JOB = """
import sys
import axonml_distributed as ad
sys.path.insert(0, {tests!r})
from test_timeline import _calls
ad.spawn(_calls, 2)
"""


def test_the_environment_s_timeline_is_written_at_exit_without_the_flight_recorder_s_ring(
    tmp_path: Path,
) -> None:
    """AXONML_TIMELINE: from the import to the exit. The timeline keeps every call even when the flight
    recorder keeps none (AXONML_FLIGHT_RECORDER_ENTRIES=0)."""
    path = tmp_path / "timeline.json"
    env = {
        **os.environ,
        "PYTHONPATH": _package_path(),
        "AXONML_TIMELINE": str(path),
        "AXONML_FLIGHT_RECORDER_ENTRIES": "0",
    }
    script = ENV_JOB.format(tests=str(Path(__file__).parent))
    job = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50)
    assert job.returncode == 0, job.stderr
    _check_job(_load(path), 2)


def _package_path() -> str:
    """PYTHONPATH for a subprocess that must import this copy of the package."""
    return os.pathsep.join(filter(None, [str(Path(ad.__file__).parents[1]), os.environ.get("PYTHONPATH")]))


def test_calls_outside_the_timeline_are_left_out_and_one_timeline_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"

    def one_barrier(pg: Any) -> None:
        pg.barrier()

    ad.spawn(one_barrier, 2)
    with ad.timeline(path):
        with pytest.raises(RuntimeError, match="a timeline is already on"), ad.timeline(tmp_path / "other"):
            pass
        ad.spawn(one_barrier, 2)
    ad.spawn(one_barrier, 2)
    spans = [e for e in _load(path)["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"]
    assert Counter(s["pid"] for s in spans) == {0: 1, 1: 1}
    assert not (tmp_path / "other").exists()
    # A timeline that recorded nothing leaves the file alone (a tool run with AXONML_TIMELINE set).
    before = path.read_bytes()
    with ad.timeline(path):
        pass
    assert path.read_bytes() == before


def _ddp_steps(pg: Any, steps: int) -> list[int]:
    """`steps` DDP steps of the test MLP with one bucket per parameter; returns each bucket's bytes."""
    model = MLP(seed=1)
    ddp = ad.DDP(model, pg, bucket_cap_mb=1e-9)
    rng = np.random.default_rng(pg.rank())
    for _ in range(steps):
        with ad.trace_span("step"):
            x = rng.normal(size=(4, 5))
            out = ddp(x)
            model.backward(out)
            ddp.sync_gradients()
    params = list(model.parameters())
    return [sum(params[i].data.nbytes for i in bucket) for bucket in ddp.bucket_assignment()]


def test_ddp_buckets_are_on_each_rank_s_track(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    steps = 3
    with ad.timeline(path):
        sizes = ad.spawn(_ddp_steps, 2, steps)
    tracks = _tracks(_load(path))
    for rank in range(2):
        nbytes = {f"ddp bucket {i}": size for i, size in enumerate(sizes[rank])}
        assert len(nbytes) > 1
        assert {k[1] for k in tracks if k[0] == rank and k[1].startswith("ddp")} == set(nbytes)
        spans = [
            s for name in nbytes for s in _spans_with_phases(tracks[(rank, name)], ("queued", "reducing"))
        ]
        assert Counter(s["name"] for s in spans) == {name: steps for name in nbytes}
        assert all(
            s["args"]["bytes"] == nbytes[s["name"]] and s["args"]["state"] == "completed" for s in spans
        )
        assert len(tracks[(rank, "user")]) == steps
        # Each bucket's reduction is an all_reduce of its bytes on the group's track, inside its span.
        reduces = [
            s
            for s in _group_track(tracks, rank, "0,1", 1)
            if s["cat"] == "collective" and s["name"] == "all_reduce"
        ]
        for span in spans:
            assert any(
                r["args"]["bytes"] == span["args"]["bytes"]
                and span["ts"] <= r["ts"] + 0.002
                and r["ts"] + r["dur"] <= span["ts"] + span["dur"] + 0.002
                for r in reduces
            ), span


@pytest.mark.timeout(120)
def test_shm_world_parts_are_merged_by_rank_0(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    assert ok(run_world(2, w_under_timeline, str(path), _calls, timeout=30)) == ["done", "done"]
    _check_job(_load(path), 2)
    assert list(tmp_path.iterdir()) == [path], "the parts are removed once merged"


@pytest.mark.timeout(120)
def test_shm_world_under_the_launcher_a_timeline_block_is_merged_by_rank_0(tmp_path: Path) -> None:
    """A `timeline()` block (no AXONML_TIMELINE) in workers of axonml-run: the launcher does not know its
    path, so rank 0 merges the parts."""
    script = worker_script(
        tmp_path,
        f"""
        import axonml_distributed as ad
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_timeline import _calls

        pg = ad.init_process_group("shm")
        with ad.timeline(OUT / "timeline.json"):
            _calls(pg)
        ad.destroy_process_group()
        """,
    )
    out, err = finish_launcher(start_launcher("--nproc-per-node", "2", script, tmp_path))
    _check_job(_load(tmp_path / "timeline.json"), 2)
    assert not list(tmp_path.glob("timeline.json.rank*")), (out, err)


TORCH_DDP = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("axonml")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9)
for step in range({steps}):
    ddp(torch.randn(3, 8)).sum().backward()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_torch_ddp_over_axonml_under_the_launcher(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    steps = 2
    script = tmp_path / "job.py"
    script.write_text(TORCH_DDP.format(steps=steps))
    path = tmp_path / "timeline.json"
    env = {
        **os.environ,
        "PYTHONPATH": _package_path(),
        "OMP_NUM_THREADS": "1",
        "AXONML_TIMELINE": str(path),
    }
    job = subprocess.run(
        [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert job.returncode == 0, (job.stdout, job.stderr)
    assert f"timeline of ranks 0, 1 in {path}" in job.stderr + job.stdout
    tracks = _tracks(_load(path))
    import torch

    sizes = [
        p.numel() * 4
        for p in torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).parameters()
    ]
    for rank in range(2):
        groups = [k for k in tracks if k[0] == rank and k[1].startswith("group ")]
        spans = [
            s for k in groups for s in _spans_with_phases(tracks[k], ("waiting for peers", "moving data"))
        ]
        # torch DDP: a broadcast of the parameters, then per step one all_reduce per bucket (a parameter
        # each, at this cap); a barrier at the end.
        reduced = sum(s["args"]["bytes"] for s in spans if s["name"] == "all_reduce")
        assert reduced == steps * sum(sizes), (reduced, sizes)
        assert sum(1 for s in spans if s["name"] == "barrier") >= 1
        # Each of those all_reduces is a bucket of torch's DDP, on a track of its position in backward.
        buckets = [
            s
            for k in tracks
            if k[0] == rank and k[1].startswith("ddp bucket ")
            for s in _spans_with_phases(tracks[k], ("queued", "reducing"))
        ]
        assert all(s["args"]["state"] == "completed" for s in buckets)
        assert sum(s["args"]["bytes"] for s in buckets) == steps * sum(sizes)


def test_plot_draws_a_row_per_rank_and_track(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    path, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    with ad.timeline(path):
        ad.spawn(_calls, 2)
    from axonml_distributed.trace.__main__ import main

    assert main(["plot", str(path), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(png).shape
    assert height > 100 and width > 100
    from axonml_distributed.trace.gantt import draw

    labels = draw(_load(path), tmp_path / "again.png")
    # Per rank: the user's track, then the world's group and the subgroup, in the order it made them
    # (named for the world's ordinal in this process, which other tests' worlds advanced).
    world = labels[1].split("group ")[1].split(":")[0]
    tracks = ("user", f"group {world}:0,1#1", f"group {world}:0,1#2")
    assert labels == [f"rank {r}: {track}" for r in range(2) for track in tracks]


def _reduces(pg: Any) -> None:
    for _ in range(3):
        pg.all_reduce(np.ones(4, np.float32))


def test_across_hosts_parts_and_spans_carry_the_job_s_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch's backend across hosts, a host's world numbers its ranks from 0: here the second host
    of two, job ranks 2 and 3 (a thread world of 2 stands for the host's world). Its part is the job's
    rank 2's, in a job of 4, with its spans on ranks 2 and 3, not the whole timeline of ranks 0 and 1."""
    from axonml_distributed.hosts.layout import HostLayout

    dist = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 4)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    layout = HostLayout(((0, 1), (2, 3)), 2)
    monkeypatch.setitem(sys.modules, "axonml_distributed.torch", SimpleNamespace(_hosts=layout))
    path = tmp_path / "timeline.json"
    with ad.timeline(path):
        ad.spawn(_reduces, 2)
    assert not path.exists()
    part = json.loads((tmp_path / "timeline.json.rank2").read_text())
    assert part["world_size"] == 4 and part["ranks"] == [2, 3]
    assert Counter(s["rank"] for s in part["spans"]) == {2: 3, 3: 3}


def test_a_timeline_directory_that_cannot_be_made_warns_at_import_and_records_nothing(tmp_path: Path) -> None:
    """torch imports the package through its backend entry point: a bad AXONML_TIMELINE must not make
    every ``import axonml_distributed`` (so ``import torch``) fail."""
    blocker = tmp_path / "a file"
    blocker.write_text("")
    env = {**os.environ, "PYTHONPATH": _package_path(), "AXONML_TIMELINE": str(blocker / "timeline.json")}
    script = "import axonml_distributed.trace.timeline_file as t; assert t._active is None"
    job = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50)
    assert job.returncode == 0, job.stderr
    assert "AXONML_TIMELINE" in job.stderr and "cannot be made" in job.stderr, job.stderr


def test_a_relative_path_is_written_where_it_named_when_the_timeline_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    with ad.timeline("timeline.json"):
        os.chdir("elsewhere")
        ad.spawn(_reduces, 2)
    assert (tmp_path / "timeline.json").exists()
    assert not (tmp_path / "elsewhere" / "timeline.json").exists()


class _Boom(Exception):
    pass


@pytest.mark.timeout(30)
def test_a_block_that_raises_writes_its_part_and_merges_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of 2 (a process of the shm world, as far as the timeline sees: RANK and WORLD_SIZE) whose
    block raised: rank 1's part may never come, so rank 0 merges its own at once, with a warning for the
    missing rank, and the block's exception is the one raised."""
    from axonml_distributed.trace import timeline_file

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_waiting(seconds: float) -> None:
        raise AssertionError("rank 0 waited for a part")

    monkeypatch.setattr(timeline_file.time, "sleep", no_waiting)
    path = tmp_path / "timeline.json"
    with pytest.raises(_Boom), pytest.warns(UserWarning, match=r"no part from ranks \[1\]"):
        with ad.timeline(path):
            with ad.trace_span("step"):
                pass
            raise _Boom
    tracks = _tracks(_load(path))
    assert [e["name"] for e in tracks[(0, "user")]] == ["step"]


def test_a_failure_to_write_does_not_hide_the_block_s_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from axonml_distributed.trace import timeline_file

    def broken(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(timeline_file, "write_json", broken)
    with pytest.raises(_Boom), pytest.warns(UserWarning, match="disk full"):
        with ad.timeline(tmp_path / "timeline.json"):
            ad.spawn(_reduces, 2)
            raise _Boom
    with ad.timeline(tmp_path / "next.json"):  # the failed one is off
        pass


def test_plot_without_matplotlib_says_what_to_install_as_the_other_charts_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from axonml_distributed.bench import plot
    from axonml_distributed.trace.gantt import draw

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    trace = {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {}}
    with pytest.raises(SystemExit, match=re.escape(plot.INSTALL_HINT)):
        draw(trace, tmp_path / "timeline.png")


FAILING_JOB = """
import axonml_distributed as ad
from axonml_distributed.trace import timeline_file

def no_waiting(seconds):
    raise AssertionError("rank 0 waited for a part")

timeline_file.time.sleep = no_waiting
with ad.trace_span("step"):
    pass
raise RuntimeError("the job failed")
"""


def test_the_environment_s_timeline_of_a_failed_process_merges_without_waiting(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    env = {
        **os.environ,
        "PYTHONPATH": _package_path(),
        "AXONML_TIMELINE": str(path),
        "RANK": "0",
        "WORLD_SIZE": "2",
    }
    job = subprocess.run(
        [sys.executable, "-c", FAILING_JOB], env=env, capture_output=True, text=True, timeout=50
    )
    assert job.returncode == 1 and "the job failed" in job.stderr, job.stderr
    assert "waited" not in job.stderr and "no part from ranks [1]" in job.stderr, job.stderr
    assert [e["name"] for e in _tracks(_load(path))[(0, "user")]] == ["step"]
