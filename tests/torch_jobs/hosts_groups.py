"""A torchrun job for tests/test_hosts_torch.py: what groups across 2 simulated hosts x 2 ranks tell, in
one run (each run costs seconds), group timeout 20 s. In order:

- ``stats``: a small (flat) all_reduce of 10 float32, a two-level one of `ELEMS` float64 and a broadcast
  of 6 int32 on the default group, a barrier, then ``rank R stats <json>`` (the group's ``stats()``).
- ``monitored``: the default group's ``monitored_barrier`` (20 s), every rank present: ``rank R monitored
  never raised``.
- ``strided``: all_to_all_single with a strided output on rank 3 alone, then a strided input on rank 1
  alone: ``rank R strided <which> raised <type>: <message>`` (or ``never raised``) and ``rank R strided
  <which> unchanged: <bool>`` (its output's storage); then a contiguous all_to_all_single, ``rank R
  all_to_all_single right: <bool>``.
- ``subgroup``: ``new_group([2, 3])`` (host 1's ranks, timeout 3 s) and ``new_group([3, 2],
  sort_ranks=False)``; rank 2 all_reduces on the first alone and times out, then rank 3 all_reduces on it
  (its world aborted by rank 2): each prints ``rank R subgroup raised <type>: <message>`` and ``rank R
  subgroup facts <json>`` (the error's rank, ranks, group), and ``FLIGHT R <json>`` (its flight record).
  Then each calls ``monitored_barrier`` with a zero timeout on both groups (it times out at once, without
  the native group) and prints ``rank R zero <which> raised ...`` and ``rank R zero <which> facts ...``.

Every rank then waits for the others in the store (the agent on h0 serves it) and exits 0.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from output import say  # the jobs' directory is on sys.path: they run as scripts

from axonml_distributed import trace

ELEMS = 40_000  # above the test's 64 KiB cut: both levels


def stats(rank: int) -> None:
    dist.all_reduce(torch.ones(10))
    dist.all_reduce(torch.ones(ELEMS, dtype=torch.float64))
    dist.broadcast(torch.ones(6, dtype=torch.int32), src=1)
    dist.barrier()  # gloo ends a call's record from its future's callback: the calls above are settled
    try:
        say(f"rank {rank} stats {json.dumps(dist.group.WORLD.stats())}")
    except Exception as e:  # noqa: BLE001 (reported whatever it is)
        say(f"rank {rank} stats raised {type(e).__name__}: {e}")


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
    say(f"FLIGHT {rank} {json.dumps(trace.flight_record())}")
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
    dist.init_process_group("axonml", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    stats(rank)
    # Every rank comes: the barrier completes (gloo's monitored_barrier returns no work).
    reported(rank, "monitored", lambda: dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=20)))
    strided(rank, world)
    subgroup(rank, store)
    store.set(f"groups/done/{rank}", "1")
    store.wait([f"groups/done/{r}" for r in range(world)], datetime.timedelta(seconds=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
