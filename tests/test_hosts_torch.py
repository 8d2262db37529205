"""The "axonml" torch backend across simulated hosts (2 hosts x 2 ranks under torchrun, c10d rendezvous):
every collective against torch's reference, DDP against gloo's, faults (a rank that raises on the other
host, a host killed, a link cut, a mismatch across hosts), hosts found honestly, an elastic restart, what
groups across hosts tell (flight records, stats, refusals, errors in the job's ranks).

One pair of hosts serves the module (bringing hosts up costs seconds); a test that kills a host brings
up a fresh pair for those after it. Jobs are tests/torch_jobs/hosts_*.py, run by `hosts_torchrun`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from axonml_distributed import trace
from axonml_distributed.simhosts import SimHosts
from hosts_torchrun import Agent, finish, lines, raised, said, start_torchrun, torchrun, wait_for_lines
from simhosts_fixture import MISSING, needs_simhosts, new_sim_hosts

pytestmark = needs_simhosts
torch = pytest.importorskip("torch")


class Hosts:
    """The module's simulated hosts, brought up again after a test took one down."""

    def __init__(self) -> None:
        self.sim: SimHosts | None = None

    def get(self) -> SimHosts:
        if self.sim is None:
            self.sim = new_sim_hosts().up()
        return self.sim

    def spoiled(self) -> None:
        if self.sim is not None:
            self.sim.down()
            self.sim = None


@pytest.fixture(scope="module")
def hosts_holder() -> Iterator[Hosts]:
    if MISSING is not None:
        pytest.skip(MISSING)
    holder = Hosts()
    try:
        yield holder
    finally:
        holder.spoiled()


@pytest.fixture
def hosts(hosts_holder: Hosts) -> SimHosts:
    return hosts_holder.get()


@pytest.mark.timeout(240)
def test_every_collective_and_ddp_across_hosts_against_torch(hosts: SimHosts, tmp_path: Path) -> None:
    agents = torchrun(
        hosts, "hosts_collectives.py", out_dir=tmp_path, env={"AXONML_HOSTS_SEGMENT_KIB": "64"}, timeout=200
    )
    assert [a.code for a in agents] == [0, 0], said(agents)
    done = lines(agents, r"rank (\d) of 4 on (h\d): (\d+) checks, 0 wrong$")
    assert sorted(int(m[1]) for m in done) == [0, 1, 2, 3], said(agents)
    assert all(m[2] == f"h{int(m[1]) // 2}" for m in done), said(agents)
    assert all(int(m[3]) > 180 for m in done), said(agents)  # every part ran (roots check a few more)
    assert "HostsProcessGroup" in agents[0].out, said(agents)


# ---- faults ------------------------------------------------------------------------------------------


def shm_left(hosts: SimHosts, where: list[int]) -> dict[int, list[str]]:
    """What each host's /dev/shm holds (the hosts' own, private)."""
    return {i: hosts.run(i, ["ls", "-A", "/dev/shm"], timeout=30).stdout.split() for i in where}


@pytest.mark.timeout(150)
def test_a_rank_that_raises_on_the_other_host_fails_every_rank_naming_it(
    hosts: SimHosts, tmp_path: Path
) -> None:
    agents = torchrun(hosts, "hosts_faults.py", "raise", out_dir=tmp_path, timeout=120)
    text = said(agents)
    assert all(a.code not in (0, None) for a in agents), text
    assert "never raised" not in text, text
    failures = raised(agents)
    assert sorted(failures) == [0, 1, 3], text
    assert all(kind == "PeerFailureError" for kind, _ in failures.values()), text
    # Every rank names rank 2 and its error: rank 3 from its host's abort, the ranks on h0 from the
    # job's failure note (gloo itself tells them only of a closed socket); they also say which ranks
    # the other host holds.
    for _, message in failures.values():
        assert "RuntimeError in rank 2: deliberate failure on rank 2" in message, text
    for rank in (0, 1):
        assert "[[2, 3]]" in failures[rank][1], text
    # gloo names rank 2's host by its address; the note says which of its ranks failed.
    named = {int(m[1]): m[2] for m in lines(agents, r"rank (\d) named (.*)$")}
    assert named == {0: "[2]", 1: "[2]", 3: "[2]"}, text
    assert "RuntimeError: deliberate failure on rank 2" in agents[1].out, text
    assert shm_left(hosts, [0, 1]) == {0: [], 1: []}


@pytest.mark.timeout(150)
def test_a_host_killed_during_all_reduces_fails_the_survivors_naming_its_ranks(
    hosts_holder: Hosts, tmp_path: Path
) -> None:
    hosts = hosts_holder.get()
    try:
        agents = start_torchrun(hosts, "hosts_faults.py", "loop", out_dir=tmp_path)
        wait_for_lines(tmp_path, "looping", 4, agents)
        hosts.kill(1)
        done = finish(agents[:1], tmp_path, timeout=100)
        left = shm_left(hosts, [0])
    finally:
        hosts_holder.spoiled()  # the tests after this one get fresh hosts
    text = said(done)
    assert done[0].code not in (0, None), text
    assert "never raised" not in text, text
    failures = raised(done)
    assert sorted(failures) == [0, 1], text
    for kind, message in failures.values():
        assert kind in ("PeerFailureError", "CollectiveTimeoutError"), text
        assert "the other hosts hold ranks [[2, 3]]" in message, text  # the missing host's ranks
    # gloo names only the address of a peer killed without a word: the errors name that host's ranks.
    named = {int(m[1]): m[2] for m in lines(done, r"rank (\d) named (.*)$")}
    assert named == {0: "[2, 3]", 1: "[2, 3]"}, text
    assert left == {0: []}


@pytest.mark.timeout(150)
def test_ctrl_c_on_one_rank_interrupts_it_and_fails_every_other_rank_naming_it(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """SIGINT to rank 2 (on h1) while every rank is in long two-level all_reduces: rank 2 raises
    KeyboardInterrupt, every other rank our error naming rank 2, none hangs (the job's own limit is
    60 s: it then says "never raised"); no segment is left on either host."""
    agents = start_torchrun(hosts, "hosts_faults.py", "interrupt", out_dir=tmp_path)
    wait_for_lines(tmp_path, "looping", 4, agents)
    found = re.search(r"rank 2 pid (\d+)", (tmp_path / "h1.out").read_text())
    assert found is not None, (tmp_path / "h1.out").read_text()
    hosts.run(1, ["kill", "-INT", found[1]], timeout=30)
    done = finish(agents, tmp_path, timeout=100)
    text = said(done)
    assert "never raised" not in text, text
    failures = raised(done)
    assert sorted(failures) == [0, 1, 2, 3], text
    assert failures[2][0] == "KeyboardInterrupt", text
    named = {int(m[1]): m[2] for m in lines(done, r"rank (\d) named (.*)$")}
    for rank in (0, 1, 3):
        assert failures[rank][0] in ("PeerFailureError", "CollectiveTimeoutError"), text
        assert "KeyboardInterrupt in rank 2" in failures[rank][1], text
        assert named[rank] == "[2]", text
    assert shm_left(hosts, [0, 1]) == {0: [], 1: []}


@pytest.mark.timeout(150)
def test_a_cut_link_fails_every_rank_with_a_timeout_naming_the_other_hosts_ranks(
    hosts: SimHosts, tmp_path: Path
) -> None:
    agents = start_torchrun(hosts, "hosts_faults.py", "loop", out_dir=tmp_path)
    wait_for_lines(tmp_path, "looping", 4, agents)
    hosts.link(1, False)
    try:
        # Every rank reports within the group's timeout (10 s; the job's own limit is 60 s: it then
        # says "never raised"). The link stays cut until all four have: h0's agent, which serves the
        # store, exits once its workers failed, and h1's agent stops its workers as soon as it hears.
        wait_for_lines(tmp_path, "failed after", 4, agents)
    finally:
        hosts.link(1, True)
    done = finish(agents, tmp_path, timeout=100)
    text = said(done)
    assert "never raised" not in text, text
    failures = raised(done)
    assert sorted(failures) == [0, 1, 2, 3], text
    for rank, (kind, message) in failures.items():
        # A rank whose own gloo leg timed out raises the timeout; its host peer, stopped by that rank's
        # abort of the host's world first, may raise PeerFailureError quoting it (whichever came first).
        assert kind in ("CollectiveTimeoutError", "PeerFailureError"), text
        other = "[[2, 3]]" if rank < 2 else "[[0, 1]]"
        assert f"the other hosts hold ranks {other}" in message, text
    assert shm_left(hosts, [0, 1]) == {0: [], 1: []}


@pytest.mark.timeout(200)
def test_a_mismatch_across_hosts_fails_every_rank_before_any_buffer_changes(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """Rank 2 all_reduces one element more than the others, or broadcasts while they all_reduce; both
    jobs run at once on the same hosts. The first job then goes through the other collectives with rank
    2's sizes off by one."""
    dirs = {mode: tmp_path / mode for mode in ("mismatch-size", "mismatch-kind")}
    started = {}
    for mode, out_dir in dirs.items():
        out_dir.mkdir()
        started[mode] = start_torchrun(hosts, "hosts_faults.py", mode, out_dir=out_dir)
    done = {mode: finish(started[mode], dirs[mode], timeout=150) for mode in dirs}
    for agents in done.values():
        text = said(agents)
        assert "never raised" not in text, text
        assert sorted(int(m[1]) for m in lines(agents, r"rank (\d) buffer unchanged: True$")) == [0, 1, 2, 3]
        assert sorted(raised(agents)) == [0, 1, 2, 3], text
    size = raised(done["mismatch-size"])
    for kind, message in size.values():
        assert kind == "CollectiveMismatchError", said(done["mismatch-size"])
        assert "rank 2 called all_reduce(SUM, 300004 x float32" in message, message
        assert "rank 0 called all_reduce(SUM, 300003 x float32" in message, message
    kinds = raised(done["mismatch-kind"])
    for kind, message in kinds.values():
        assert kind == "CollectiveMismatchError", said(done["mismatch-kind"])
        assert "rank 2 called broadcast(300004 x float32, root 0)" in message, message
        assert "rank 3 called all_reduce(SUM, 300003 x float32" in message, message
    # The other collectives, rank 2's element count one off (all_to_all_single: one split size), each
    # rank's own buffers consistent: each refused on every rank, nothing changed, the group still usable.
    agents = done["mismatch-size"]
    cases = {
        (int(m[1]), m[2]): (m[3], m[4]) for m in lines(agents, r"rank (\d) case (\w+) raised (\w+): (.*)$")
    }
    kept = {(int(m[1]), m[2]): m[3] for m in lines(agents, r"rank (\d) case (\w+) unchanged: (\w+)$")}
    for name in SIZE_CASES:
        for rank in range(4):
            kind, message = cases.get((rank, name), ("never raised", ""))
            assert kind == "CollectiveMismatchError", f"{name} on rank {rank}: {kind}: {message}"
            assert kept[rank, name] == "True", f"{name} on rank {rank}"
            if name != "all_to_all_single":  # the op first where there is one
                for who, count in ((2, 1002), (3, 1001)):
                    pattern = rf"rank {who} called {SIZE_CASES[name]}\((SUM, )?{count} x float32"
                    assert re.search(pattern, message), message
            else:  # the splits: rank 2 sends 4 elements to rank 0, which expects 3 from it
                assert "rank 2 sends 4 element(s) to rank 0, which expects 3" in message, message
    assert shm_left(hosts, [0, 1]) == {0: [], 1: []}


# The mismatch job's cases after all_reduce (tests/torch_jobs/hosts_faults.py) and gloo's call each
# reaches, as the error names it.
SIZE_CASES = {
    "broadcast": "broadcast",
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "all_to_all": "alltoall",
    "all_to_all_single": "all_to_all_single",
}


# ---- hosts found honestly ----------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_hosts_claiming_one_identity_are_split_by_the_proof_and_share_no_memory(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """AXONML_HOST_ID alike on both hosts: the candidates' proof (a /dev/shm object of the lowest rank
    that the others read back) splits them; each host then holds one segment of its own, which only
    its own ranks map (the same object on both of them, on their host's /dev/shm), and all_reduce is
    right. destroy_process_group then ends every thread the group started (gloo's and its lane): a gloo
    group left to the interpreter's exit could abort the process as it finished ("terminate called
    without an active exception", SIGABRT after the job's last line)."""
    agents = torchrun(
        hosts, "hosts_identity.py", out_dir=tmp_path, env={"AXONML_HOST_ID": "one-host"}, timeout=120
    )
    text = said(agents)
    assert [a.code for a in agents] == [0, 0], text
    facts = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"rank (\d) facts (.*)$")}
    assert sorted(facts) == [0, 1, 2, 3], text
    for seen in facts.values():
        assert seen["hosts"] == [[0, 1], [2, 3]], text
    devices = {rank: seen["shm_device"] for rank, seen in facts.items()}
    assert devices[0] == devices[1] != devices[2] == devices[3], text  # each host its own /dev/shm
    maps = {rank: set(seen["maps"]) for rank, seen in facts.items()}
    assert maps[0] == maps[1] and maps[2] == maps[3] and len(maps[0]) == len(maps[2]) == 1, text
    for rank, mapped in maps.items():
        assert all(m.split()[0] == devices[rank] for m in mapped), text  # never the other host's
    for seen in facts.values():  # nothing of the other host's (the segment itself is unlinked)
        assert seen["listing"] == [], text
    assert sorted(int(m[1]) for m in lines(agents, r"rank (\d) all_reduce right$")) == [0, 1, 2, 3], text
    threads = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"rank (\d) threads (.*)$")}
    assert sorted(threads) == [0, 1, 2, 3], text
    for seen in threads.values():
        assert "pt_gloo_runloop" in seen["during"] and seen["after"] == seen["before"], text
    assert shm_left(hosts, [0, 1]) == {0: [], 1: []}


# ---- elastic restart ---------------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_a_worker_that_fails_once_is_restarted_and_the_job_reforms(hosts: SimHosts, tmp_path: Path) -> None:
    """torchrun --nnodes 1:2 --max-restarts 1 on both hosts, as torchrun runs by default: the agents
    share one store across rounds, whose keys stay. On torch 2.15 gloo alone fails there (its second
    round dials the first round's dead ports: connectFullMesh, connection refused) unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; "axonml" needs no such setting, since each init's keys,
    gloo's groups between hosts included, are under a prefix of its own (with it set, it works too)."""
    agents = torchrun(
        hosts,
        "hosts_elastic.py",
        "axonml",
        out_dir=tmp_path,
        nnodes="1:2",
        torchrun_args=("--max-restarts", "1"),
        timeout=170,
    )
    text = said(agents)
    assert [a.code for a in agents] == [0, 0], text
    assert "RuntimeError: rank 2 fails once" in agents[1].out, text
    done = lines(agents, r"rank (\d) of 4: all_reduce right$")
    assert sorted(int(m[1]) for m in done) == [0, 1, 2, 3], text


# ---- what groups across hosts tell -------------------------------------------------------------------

GROUPS_ELEMS = 40_000  # tests/torch_jobs/hosts_groups.py's two-level all_reduce (float64)


@dataclass
class GroupsRun:
    """The run of tests/torch_jobs/hosts_groups.py that the tests below read (one run: each costs seconds):
    what its agents said, and what each host's /dev/shm held after it."""

    agents: list[Agent]
    shm: dict[int, list[str]]


@pytest.fixture(scope="module")
def groups_run(hosts_holder: Hosts, tmp_path_factory: pytest.TempPathFactory) -> GroupsRun:
    hosts = hosts_holder.get()
    out_dir = tmp_path_factory.mktemp("hosts_groups")
    agents = torchrun(hosts, "hosts_groups.py", out_dir=out_dir, timeout=170)
    return GroupsRun(agents, shm_left(hosts, [0, 1]))


def _group(dump: dict[str, Any], ranks: str) -> str:
    (name,) = [n for n, c in dump["pg_config"].items() if c["ranks"] == ranks]
    return name


@pytest.mark.timeout(240)  # the first of the tests below runs the job
def test_gloo_s_calls_across_hosts_are_in_each_rank_s_record(groups_run: GroupsRun) -> None:
    """The calls gloo carries across hosts in the flight recorder (`torch.gloo_calls`, recorded by
    `torch.hosts.HostsProcessGroup`): each rank's record, beside calls inside each host and on a group of
    one rank, checked against the calls it made; and what is left of it after `destroy_process_group` and
    a second init in the same process."""
    agents = groups_run.agents
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
        # Rank 1's send has no later call on the group before the record is printed: it ended in its wait,
        # as rank 3's receive from any source, which names its sender.
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
    assert shards == GROUPS_ELEMS
    assert trace.analyze(content).summary() == "every rank completed every recorded call"
    # The job's records of gloo's calls went with its groups; a second job's are its own.
    left = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"LEFT (\d) (.*)$")}
    assert left == {r: [] for r in range(4)}, said(agents)
    agains = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"AGAIN (\d) (.*)$")}
    assert sorted(agains) == [0, 1, 2, 3], said(agents)
    for rank, again in agains.items():
        # The world's group and, made with it, the group of this rank's peers on the other host.
        assert [(ranks, kinds) for _, ranks, kinds in again] == [
            ([0, 1, 2, 3], ["all_reduce"]),
            ([rank % 2, rank % 2 + 2], []),
        ], again
        assert len({ordinal for ordinal, _, _ in again}) == 1, again


@pytest.mark.timeout(240)
def test_groups_across_hosts_count_their_calls_refuse_strided_all_to_all_and_name_job_ranks(
    groups_run: GroupsRun,
) -> None:
    """The job's run (`groups_run`): the default group's `stats()`; all_to_all_single with
    a strided output (gloo would write it wrongly) or input (gloo refuses it on that rank alone, the
    others waiting) on one rank refused on every rank before anything moves; a subgroup of host 1's
    ranks whose timeout and peer failure name the job's ranks 2 and 3, not the host's 0 and 1."""
    agents = groups_run.agents
    text = said(agents)
    assert [a.code for a in agents] == [0, 0], text
    assert len(lines(agents, r"rank \d monitored never raised$")) == 4, text

    # stats(): the shape of the native groups' (tests/test_flight_recorder.py), counted from the calls.
    got = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"rank (\d) stats (.*)$")}
    assert sorted(got) == [0, 1, 2, 3], text
    for stats in got.values():
        for kind in ("all_reduce", "broadcast"):
            assert set(stats[kind]) == {"calls", "failed", "bytes", "wait_s", "move_s", "routes"}, stats
            assert stats[kind]["failed"] == 0 and stats[kind]["routes"] == {"gloo": stats[kind]["calls"]}
        assert (stats["broadcast"]["calls"], stats["broadcast"]["bytes"]) == (1, 6 * 4), stats
        assert stats["all_reduce"]["calls"] >= 2, stats  # the flat one, and one per shard between hosts
    # Each host's ranks carry one shard each of the two-level all_reduce across hosts, beside the flat one.
    for host in ((0, 1), (2, 3)):
        assert sum(got[r]["all_reduce"]["bytes"] for r in host) == 2 * 10 * 4 + GROUPS_ELEMS * 8, got

    # Strided all_to_all_single on one rank: refused on every rank, nothing written, the group usable.
    for which, odd in (("output", 3), ("input", 1)):
        for rank in range(4):
            found = lines(agents, rf"rank {rank} strided {which} (raised (\w+): (.*)|never raised)$")
            assert found and found[0][2] == "ValueError", f"{which} on rank {rank}: {found and found[0][0]}"
            assert "Tensors must be contiguous" in found[0][3] and f"rank(s) [{odd}]" in found[0][3], text
            assert lines(agents, rf"rank {rank} strided {which} unchanged: True$"), text
    assert len(lines(agents, r"rank \d all_to_all_single right: True$")) == 4, text

    # The subgroup [2, 3] on host 1: its errors in the job's ranks.
    raised = {int(m[1]): (m[2], m[3]) for m in lines(agents, r"rank (\d) subgroup raised (\w+): (.*)$")}
    facts = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"rank (\d) subgroup facts (.*)$")}
    assert sorted(raised) == [2, 3], text
    assert raised[2][0] == "CollectiveTimeoutError" and raised[3][0] == "PeerFailureError", text
    assert facts[2] == {"rank": 2, "ranks": [3], "group": [2, 3]}, text
    assert facts[3] == {"rank": 3, "ranks": [2], "group": [2, 3]}, text
    for rank, other in ((2, 3), (3, 2)):
        message = raised[rank][1]
        assert message.startswith(f"rank {rank}: ") and f"inside this host (rank(s) [{other}];" in message, (
            text
        )
        assert "host ranks to global ranks: 0 = 2, 1 = 3" in message, text
    # A zero-timeout monitored_barrier on either order of the subgroup: timed out at once (torch's group
    # makes that error itself), naming the job's ranks too.
    for which in ("sorted", "reversed"):
        zero = {
            int(m[1]): (m[2], m[3]) for m in lines(agents, rf"rank (\d) zero {which} raised (\w+): (.*)$")
        }
        zero_facts = {
            int(m[1]): json.loads(m[2]) for m in lines(agents, rf"rank (\d) zero {which} facts (.*)$")
        }
        assert sorted(zero) == [2, 3] and {kind for kind, _ in zero.values()} == {"CollectiveTimeoutError"}, (
            text
        )
        for rank, other in ((2, 3), (3, 2)):
            assert zero_facts[rank] == {"rank": rank, "ranks": [other], "group": [2, 3]}, text
            assert zero[rank][1].startswith(f"rank {rank}: monitored_barrier failed inside this host"), text
    # Its flight record too (`trace.record.to_job_ranks`): rank 2's all_reduce, in a group over 2 and 3.
    dumps = {int(m[1]): json.loads(m[2]) for m in lines(agents, r"rank (\d) subgroup flight (.*)$")}
    dump = dumps[2]["ranks"]["2"]
    pairs = {n for n, c in dump["pg_config"].items() if c["ranks"] == "[2, 3]"}
    assert [e for e in dump["entries"] if e["process_group"][0] in pairs and e["count"] == 4], dump
    assert groups_run.shm == {0: [], 1: []}
