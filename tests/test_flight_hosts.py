"""The calls gloo carries across hosts in the flight recorder (`trace.gloo_calls`, recorded by
`torch.hosts.HostsProcessGroup`): a torchrun job over 2 simulated hosts x 2 ranks
(tests/torch_jobs/hosts_flight.py) prints each rank's record, checked here against the calls it made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from axonml_distributed import trace
from simhosts_fixture import needs_simhosts, new_sim_hosts
from test_hosts_torch import lines, said, torchrun

pytestmark = needs_simhosts
torch = pytest.importorskip("torch")

ELEMS = 40_000  # the two-level all_reduce's float64 elements (above the test's 64 KiB cut)


def _group(dump: dict[str, Any], ranks: str) -> str:
    (name,) = [n for n, c in dump["pg_config"].items() if c["ranks"] == ranks]
    return name


@pytest.mark.timeout(300)
def test_gloo_s_calls_across_hosts_are_in_each_rank_s_record(tmp_path: Path) -> None:
    hosts = new_sim_hosts().up()
    try:
        agents = torchrun(hosts, "hosts_flight.py", out_dir=tmp_path, timeout=200)
    finally:
        hosts.down()
    assert [a.code for a in agents] == [0, 0], said(agents)
    dumps = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"FLIGHT (\d) (.*)$")}
    assert sorted(dumps) == [0, 1, 2, 3], said(agents)
    # Each process's file holds its own rank only (a world of one rank numbers it 0, a host's world
    # numbers the host's ranks from 0: both are given the job's).
    assert {r: list(d["ranks"]) for r, d in dumps.items()} == {r: [str(r)] for r in range(4)}
    content = trace.merge(dumps.values())
    # Each process's records carry the job's ranks: its host world's too.
    assert sorted(content["ranks"]) == ["0", "1", "2", "3"] and content["world_size"] == 4
    shards = 0
    for rank in range(4):
        dump = content["ranks"][str(rank)]
        group = _group(dump, "[0, 1, 2, 3]")
        gloo = [e for e in dump["entries"] if e["process_group"][0] == group]
        got = [
            (e["kind"], e["dtype"], e["count"], e["root"], e["collective_seq_id"])
            for e in gloo
            if not e["is_p2p"]
        ]
        assert got == [
            ("all_reduce", "float32", 10, None, 1),
            ("broadcast", "int32", 6, 1, 2),
            ("barrier", None, 0, None, 3),
        ], got
        p2p = [(e["kind"], e["peer"], e["tag"], e["count"]) for e in gloo if e["is_p2p"]]
        # Rank 1's send has no later call on the group: it ended in its wait, as rank 3's receive from any
        # source, which names its sender.
        want = {0: ("send", 2, 5, 3), 2: ("recv", 0, 5, 3), 1: ("send", 3, 9, 2), 3: ("recv", 1, 9, 2)}
        assert p2p == [want[rank]], p2p
        assert all(e["route"] == "gloo" and e["state"] == "completed" for e in gloo), gloo
        # The shards between hosts: in the group of this rank and its peer on the other host.
        cross = [
            e for e in dump["entries"] if e["process_group"][0] == _group(dump, str([rank % 2, rank % 2 + 2]))
        ]
        assert cross and all(
            (e["kind"], e["dtype"], e["route"], e["state"]) == ("all_reduce", "float64", "gloo", "completed")
            for e in cross
        ), cross
        # Inside the host, on the group of its two ranks: roots, peers and the calls' text by the job's ranks.
        first = rank - rank % 2
        pair = [
            e
            for e in dump["entries"]
            if dump["pg_config"][e["process_group"][0]]["ranks"] == str([first, first + 1])
        ]
        mine = [(e["kind"], e["root"], e.get("peer"), e["call"]) for e in pair if e["count"] == 3]
        message = (
            ("recv", None, first + 1, f"recv(3 x float32 from rank {first + 1}, tag 7)")
            if rank == first
            else ("send", None, first, f"send(3 x float32 to rank {first}, tag 7)")
        )
        broadcast = (
            "broadcast",
            first + 1,
            None,
            f"broadcast(#1, 3 x float32, root={first + 1})",
        )
        assert mine == [broadcast, message], mine
        assert [
            (e["kind"], e["count"])
            for e in dump["entries"]
            if e["process_group"][0] == _group(dump, f"[{rank}]")
        ] == [("all_reduce", 2)]
        if rank < 2:  # host 0's ranks hold one shard each of the whole tensor
            shards += sum(e["count"] for e in cross)
    assert shards == ELEMS
    assert trace.analyze(content).summary() == "every rank completed every recorded call"
