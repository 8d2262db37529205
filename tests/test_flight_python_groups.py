"""The records of calls that Python drives or maps, in one process: `_core.FlightRecorder` (the MPI group's
and gloo's recorder) given what the core does not know or cannot hold, gloo's sends and receives ended by
their own `wait()` (`torch.gloo_calls`), and a torch job's records given the job's ranks
(`trace.record.to_job_ranks`), checked against the calls made here."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types
from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from axonml_distributed import _core
from axonml_distributed.hosts.layout import HostLayout
from axonml_distributed.trace.record import to_job_ranks

pytestmark = pytest.mark.timeout(60)
torch = pytest.importorskip("torch")
dist = torch.distributed


def _record(recorder_ranks: list[int], world: str = "hosts") -> dict[str, Any]:
    """The newest native record of a group over `recorder_ranks` in `world`."""
    return [r for r in _core.flight_records() if r["world"] == world and r["ranks"] == recorder_ranks][-1]


def test_a_dtype_the_core_does_not_know_is_recorded_as_none() -> None:
    recorder = _core.FlightRecorder("hosts", 0, 2, [0, 1])
    for dtype in (torch.float8_e4m3fn, torch.complex32):
        recorder.p2p(True, 1, 4, str(dtype), 3).end(True, "gloo")
        recorder.collective("all_reduce", 1, str(dtype), 5).end(True, "gloo")
    entries = _record([0, 1])["entries"]
    assert [(e["kind"], e["dtype"], e["count"], e["bytes"]) for e in entries] == 2 * [
        ("send", None, 3, 0),
        ("all_reduce", None, 5, 0),
    ], entries
    assert entries[0]["call"] == "send(3 elements to rank 1, tag 4)"


def test_a_collective_whose_sizes_overflow_is_refused() -> None:
    recorder = _core.FlightRecorder("mpi", 0, 4, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="too large"):
        recorder.collective("all_gather", 1, "float32", 2**63)
    # Within range: this member's input is its part, its output the group's.
    recorder.collective("all_gather", 1, "float32", 2**61).end(True, "mpi")
    (entry,) = _record([0, 1, 2, 3], "mpi")["entries"]
    assert (entry["input_elems"], entry["output_elems"]) == (2**61, 2**63)


def test_caller_stacks_survive_a_finalizer_that_records_while_they_are_read() -> None:
    """A frame read while the stack is taken may run the collector, whose finalizers may record a call
    on this thread: the recorder must not be locked then (it deadlocked). The finalizers make garbage
    again, so the collector runs at every allocation (Python 3.11 collects inside the allocation)."""
    job = textwrap.dedent(
        """
        import gc
        from axonml_distributed import _core
        recorder = _core.FlightRecorder("mpi", 0, 2, [0, 1])
        inside = []

        class Garbage:
            def __init__(self):
                self.me = self
            def __del__(self):
                Garbage()
                if not inside:
                    inside.append(1)
                    recorder.p2p(False, 1, 9, "float32", 1).end(True, "mpi")
                    inside.pop()

        def deep(n):
            if n == 0:
                for i in range(200):
                    Garbage()
                    recorder.p2p(True, 1, 0, "float32", 1).end(True, "mpi")
                return
            deep(n - 1)

        gc.set_threshold(1)
        deep(10)
        gc.set_threshold(700)
        stats = recorder.stats()
        print(stats["send"]["calls"], stats["recv"]["calls"] > 0)
        """
    )
    env = {"AXONML_FLIGHT_RECORDER_STACKS": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", job], env=env, capture_output=True, text=True, timeout=40)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["200", "True"], run.stdout


class _GlooP2p:
    """gloo's work of a send or receive as torch's ProcessGroupGloo makes it: no future, completed only by
    its `wait()`; a receive's sender is `source` (a group rank), a send has none."""

    def __init__(self, source: int | None, error: Exception | None = None) -> None:
        self._source, self._error, self._done = source, error, False

    def get_future(self) -> Any:
        raise RuntimeError("Future not supported")

    def wait(self, timeout: Any = None) -> bool:
        self._done = True
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done

    def _source_rank(self) -> int:
        if self._source is None:
            raise RuntimeError("sourceRank() may only be called on work objects that correspond to a recv")
        return self._source


def test_gloo_s_sends_and_receives_end_when_waited_for_with_their_sender() -> None:
    from axonml_distributed.torch import gloo_calls

    calls = gloo_calls.GlooCalls(0, 8, [0, 5, 6], None)
    t = torch.ones(3)
    works = [
        calls.run(calls.forwarded("send", [[t], 1, 4], [t], None), lambda: _GlooP2p(None)),
        calls.run(calls.forwarded("recv_anysource", [[t], 6], [t], None), lambda: _GlooP2p(2)),
        calls.run(calls.forwarded("recv", [[t], 1, 5], [t], None), lambda: _GlooP2p(1, RuntimeError("gone"))),
    ]
    assert [e["state"] for e in _record([0, 5, 6])["entries"]] == 3 * ["scheduled"]
    works[0].wait()
    assert works[1].wait() is True
    with pytest.raises(RuntimeError, match="gone"):
        works[2].wait()
    got = [(e["kind"], e["peer"], e["state"], e["route"]) for e in _record([0, 5, 6])["entries"]]
    # No later call on the group: each ended by its own wait, the receive from any source with its sender.
    assert got == [
        ("send", 5, "completed", "gloo"),
        ("recv", 6, "completed", "gloo"),
        ("recv", 5, "failed", "gloo"),
    ], got
    # The failed receive's exception holds its frames, a cycle through the work and so the recorder:
    # collect it now, so no later test finds this fake job's group in its dump.
    del calls, works
    gc.collect()
    assert not [r for r in _core.flight_records() if r["ranks"] == [0, 5, 6]]


def test_gloo_s_records_name_torch_s_op_in_either_of_its_forms() -> None:
    """torch hands a ReduceOp (a call's options) or its bare RedOpType (the shards' op between hosts);
    both are recorded as the op, PREMUL_SUM as SUM with its factor as the prescale."""
    from axonml_distributed.torch.gloo_calls import GlooCalls

    calls = GlooCalls(0, 4, [0, 1, 2, 3], [0, 2])
    calls.cross_shard(torch.ones(3), dist.ReduceOp.MAX).end(True, "gloo")
    calls.collective("all_reduce", [torch.ones(2)], 2, op=dist.ReduceOp(dist.ReduceOp.MIN)).end(True, "gloo")
    premul = dist._make_nccl_premul_sum(2.0)
    calls.collective("all_reduce", [torch.ones(2)], 2, op=premul).end(True, "gloo")
    assert [e["op"] for e in _record([0, 2])["entries"]] == ["MAX"]
    entries = _record([0, 1, 2, 3])["entries"]
    assert [e["op"] for e in entries] == ["MIN", "SUM"]
    assert "prescale=2," in entries[1]["call"], entries[1]["call"]
    del calls
    gc.collect()


def _hosts_records() -> list[tuple[int, list[int], list[str]]]:
    """The native records of the calls gloo carries: (world's ordinal, ranks, kinds recorded)."""
    return [
        (r["world_ordinal"], r["ranks"], [e["kind"] for e in r["entries"]])
        for r in _core.flight_records()
        if r["world"] == "hosts"
    ]


def test_a_job_s_gloo_records_go_with_its_group_and_a_later_job_s_groups_are_its_own() -> None:
    """As a torch job over hosts makes them (`torch.hosts.HostsProcessGroup`): the world's group, then a
    subgroup; `destroy_process_group` lets go of both; a second init in the process does the same."""
    from axonml_distributed.torch.gloo_calls import GlooCalls

    def job(kind: str) -> tuple[GlooCalls, GlooCalls]:
        world, sub = GlooCalls(1, 4, [0, 1, 2, 3], None), GlooCalls(1, 4, [1, 3], None)
        world.collective(kind, [torch.ones(2)], 2).end(True, "gloo")
        sub.collective(kind, [torch.ones(2)], 2).end(True, "gloo")
        return world, sub

    first = job("all_reduce")
    (ordinal, *_), _ = _hosts_records()
    assert _hosts_records() == [(ordinal, [0, 1, 2, 3], ["all_reduce"]), (ordinal, [1, 3], ["all_reduce"])]
    del first  # destroyed
    gc.collect()
    assert _hosts_records() == []
    second = job("broadcast")
    # The second job's groups: a world of their own (named by its ordinal), holding its calls only.
    assert _hosts_records() == [
        (ordinal + 1, [0, 1, 2, 3], ["broadcast"]),
        (ordinal + 1, [1, 3], ["broadcast"]),
    ]
    del second
    gc.collect()
    assert _hosts_records() == []


def _host_world_records() -> list[dict[str, Any]]:
    """The native records of a new thread world of 2 ranks (a broadcast from rank 1, a message from rank 1
    to rank 0, a barrier), and of a world of one rank (torch's one-member groups) with an all_reduce."""
    before = {r["world_ordinal"] for r in _core.flight_records()}

    def job(pg: ad.ProcessGroup) -> list[dict[str, Any]]:
        x = np.ones(4, np.float32)
        pg.broadcast(x, 1)
        if pg.rank() == 1:
            pg.send(x, 0, 7)
        else:
            pg.recv(x, 1, 7)
        pg.barrier()
        records = _core.flight_records() if pg.rank() == 0 else []
        pg.barrier()  # rank 1's recorder lives until rank 0 read it
        return records

    records = ad.spawn(job, 2)[0]
    single = ad.ProcessGroup(_core.ThreadBackend.single(10.0))
    single.all_reduce(np.ones(2, np.float32))
    records += [r for r in _core.flight_records() if r["world_size"] == 1]
    return [r for r in records if r["world_ordinal"] not in before]


def test_a_torch_job_s_records_carry_the_job_s_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 of a job over hosts (0, 1) and (2, 3): its host's world numbers 2 and 3 as 0 and 1."""
    records = _host_world_records()
    fake_dist = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 4
    )
    layout = HostLayout(((0, 1), (2, 3)), 3)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake_dist)
    monkeypatch.setitem(sys.modules, "axonml_distributed.torch", types.SimpleNamespace(_hosts=layout))
    assert to_job_ranks(records) == 4
    single = [r for r in records if r["world_size"] == 1]
    assert [(r["rank"], r["ranks"]) for r in single] == [(3, [3])], single
    host = sorted((r for r in records if r["world_size"] == 2), key=lambda r: r["rank"])
    assert [(r["rank"], r["ranks"]) for r in host] == [(2, [2, 3]), (3, [2, 3])]
    for record in host:
        got = [(e["kind"], e["root"], e.get("peer"), e["call"]) for e in record["entries"]][:2]
        message = ("send", None, 2, "send(4 x float32 to rank 2, tag 7)")
        if record["rank"] == 2:
            message = ("recv", None, 3, "recv(4 x float32 from rank 3, tag 7)")
        assert got == [("broadcast", 3, None, "broadcast(#1, 4 x float32, root=3)"), message], got
    # On one host only the world of one rank is another's: it is this process's rank.
    records = _host_world_records()
    layout = HostLayout(((0, 1, 2, 3),), 2)
    monkeypatch.setitem(sys.modules, "axonml_distributed.torch", types.SimpleNamespace(_hosts=layout))
    assert to_job_ranks(records) is None
    assert sorted(r["rank"] for r in records) == [0, 1, 2]
