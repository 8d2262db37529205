"""A torchrun job for tests/test_hosts_torch.py: what groups across 2 simulated hosts x 2 ranks tell (their
flight records, `stats()`, refusals and errors), in one run (each run costs seconds), group timeout 20 s.
In order:

- ``calls``: on the default group a small (flat, one gloo call) all_reduce of 10 float32, a two-level one
  of `ELEMS` float64 (shards between hosts), a broadcast of 6 int32 from rank 1, a send from rank 0 to
  rank 2 (tag 5) and a barrier, then ``rank R stats <json>`` (the group's ``stats()``).
- ``flight``: inside each host, on a group of its two ranks, a broadcast from the second and a message
  from the second to the first (tag 7); an all_reduce on a group of this rank alone; a send from rank 1
  to rank 3 (tag 9), received from any source: ``FLIGHT R <json>`` (its flight record: the entries of its
  host's world, of its group of one and the calls gloo carried), with no later call on the default group.
- ``monitored``: the default group's ``monitored_barrier`` (20 s), every rank present: ``rank R monitored
  never raised``.
- ``strided``: all_to_all_single with a strided output on rank 3 alone, then a strided input on rank 1
  alone: ``rank R strided <which> raised <type>: <message>`` (or ``never raised``) and ``rank R strided
  <which> unchanged: <bool>`` (its output's storage); then a contiguous all_to_all_single, ``rank R
  all_to_all_single right: <bool>``.
- ``again``: `destroy_process_group`, then the records of calls gloo carried left in the process (``LEFT
  R <json>``); a second init in the same process and its all_reduce, then its records (``AGAIN R
  <json>``), each as (world's ordinal, ranks, kinds).
- ``subgroup`` (in the second init): ``new_group([2, 3])`` (host 1's ranks, timeout 3 s) and
  ``new_group([3, 2], sort_ranks=False)``; rank 2 all_reduces on the first alone and times out, then rank
  3 all_reduces on it (its world aborted by rank 2): each prints ``rank R subgroup raised <type>:
  <message>`` and ``rank R subgroup facts <json>`` (the error's rank, ranks, group), and ``rank R subgroup
  flight <json>`` (its flight record). Then each calls ``monitored_barrier`` with a zero timeout on both
  groups (it times out at once, without the native group) and prints ``rank R zero <which> raised ...``
  and ``rank R zero <which> facts ...``. It comes last: it leaves host 1's subgroup aborted.

Every rank then waits for the others in the store (the agent on h0 serves it) and exits 0.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from output import say  # the jobs' directory is on sys.path: they run as scripts

from axonml_distributed import _core, trace

ELEMS = 40_000  # above the test's 64 KiB cut: both levels
TIMEOUT = datetime.timedelta(seconds=20)


def calls(rank: int) -> None:
    dist.all_reduce(torch.ones(10))  # below the two-level cut: one gloo call
    dist.all_reduce(torch.ones(ELEMS, dtype=torch.float64))  # two levels: shards between hosts
    dist.broadcast(torch.ones(6, dtype=torch.int32), src=1)
    if rank == 0:
        dist.send(torch.ones(3), dst=2, tag=5)
    elif rank == 2:
        dist.recv(torch.empty(3), src=0, tag=5)
    dist.barrier()  # gloo ends a call's record from its future's callback: the calls above are settled
    try:
        say(f"rank {rank} stats {json.dumps(dist.group.WORLD.stats())}")
    except Exception as e:  # noqa: BLE001 (reported whatever it is)
        say(f"rank {rank} stats raised {type(e).__name__}: {e}")


def flight(rank: int) -> None:
    # The host's world numbers its ranks 0 and 1; the records carry the job's.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    first = rank - rank % 2
    t = torch.ones(3)
    dist.broadcast(t, src=first + 1, group=pairs[rank // 2])
    if rank == first:
        dist.recv(t, src=first + 1, tag=7, group=pairs[rank // 2])
    else:
        dist.send(t, dst=first, tag=7, group=pairs[rank // 2])
    # A group of this rank alone (a world of one rank): its record is this rank's.
    alone, _ = dist.new_subgroups(group_size=1)
    dist.all_reduce(torch.ones(2), group=alone)
    # Across hosts with no call after it on the group before the record is printed: each ends in its own
    # wait; rank 3 receives from any source and names its sender.
    if rank == 1:
        dist.send(torch.ones(2), dst=3, tag=9)
    elif rank == 3:
        assert dist.recv(torch.empty(2), tag=9) == 1
    say(f"FLIGHT {rank} {json.dumps(trace.flight_record())}")


def strided(rank: int, world: int) -> None:
    for which, odd in (("output", 3), ("input", 1)):
        base = torch.full((2 * world,), -7.0)
        out = base[::2] if which == "output" and rank == odd else base[:world]
        send = torch.arange(2 * world, dtype=torch.float32)
        inp = send[::2] if which == "input" and rank == odd else send[:world]
        try:
            dist.all_to_all_single(out, inp)
            say(f"rank {rank} strided {which} never raised")
        except Exception as e:  # noqa: BLE001 (reported whatever it is)
            first = str(e).replace("\n", " | ")
            say(f"rank {rank} strided {which} raised {type(e).__name__}: {first}")
        say(f"rank {rank} strided {which} unchanged: {bool((base == -7.0).all())}")
    # Rank s sends rank p the value 10 s + p: rank p receives 10 s + p from each s.
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 10 * rank)
    right = torch.equal(out, torch.arange(world, dtype=torch.float32) * 10 + rank)
    say(f"rank {rank} all_to_all_single right: {right}")


def again(rank: int) -> None:
    """The job's records of calls gloo carried go with its groups; a second job's are its own."""
    dist.destroy_process_group()
    gc.collect()  # a group held in a cycle goes here (none did: its records went with destroy)
    say(f"LEFT {rank} {json.dumps(_gloo_records())}")
    dist.init_process_group("axonml", timeout=TIMEOUT)
    dist.all_reduce(torch.ones(5))  # not 4: the subgroup's all_reduce, later, is the record's only 4
    say(f"AGAIN {rank} {json.dumps(_gloo_records())}")


def _gloo_records() -> list[tuple[int, list[int], list[str]]]:
    """This process's records of the calls gloo carried: (world's ordinal, ranks, kinds)."""
    return [
        (r["world_ordinal"], r["ranks"], [e["kind"] for e in r["entries"]])
        for r in _core.flight_records()
        if r["world"] == "hosts"
    ]


def subgroup(rank: int, store: dist.Store) -> None:
    sub = dist.new_group([2, 3], timeout=datetime.timedelta(seconds=3))
    reversed_sub = dist.new_group([3, 2], timeout=datetime.timedelta(seconds=3), sort_ranks=False)
    if rank < 2:
        return
    if rank == 3:
        store.wait(["groups/timed-out"], datetime.timedelta(seconds=60))
    reported(rank, "subgroup", lambda: dist.all_reduce(torch.ones(4), group=sub))
    if rank == 2:
        store.set("groups/timed-out", "1")
    say(f"rank {rank} subgroup flight {json.dumps(trace.flight_record())}")
    zero = datetime.timedelta(0)
    reported(rank, "zero sorted", lambda: sub.monitored_barrier(zero))
    reported(rank, "zero reversed", lambda: reversed_sub.monitored_barrier(zero))


def reported(rank: int, what: str, call: Callable[[], object]) -> None:
    """``rank R <what> raised <type>: <message>`` and ``rank R <what> facts <json>`` (the error's rank,
    ranks, group), or ``rank R <what> never raised``."""
    try:
        call()
        say(f"rank {rank} {what} never raised")
    except Exception as e:  # noqa: BLE001 (reported whatever it is)
        first = str(e).replace("\n", " | ")
        say(f"rank {rank} {what} raised {type(e).__name__}: {first}")
        facts = {"rank": getattr(e, "rank", None), "ranks": list(getattr(e, "ranks", []))}
        say(f"rank {rank} {what} facts {json.dumps({**facts, 'group': getattr(e, 'group', None)})}")


def main() -> int:
    dist.init_process_group("axonml", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    calls(rank)
    flight(rank)
    # Every rank comes: the barrier completes (gloo's monitored_barrier returns no work).
    reported(rank, "monitored", lambda: dist.group.WORLD.monitored_barrier(TIMEOUT))
    strided(rank, world)
    again(rank)
    store = dist.distributed_c10d._get_default_store()  # the second init's
    subgroup(rank, store)
    store.set(f"groups/done/{rank}", "1")
    store.wait([f"groups/done/{r}" for r in range(world)], datetime.timedelta(seconds=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
