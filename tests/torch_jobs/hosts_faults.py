"""A torchrun job for tests/test_hosts_torch.py: faults across 2 simulated hosts x 2 ranks over "axonml",
with a group timeout of 10 s. ``hosts_faults.py MODE``:

- ``raise``: rank 2 (on h1) raises after a first all_reduce; the others keep all_reducing.
- ``loop``: every rank all_reduces until something fails (the test kills a host or cuts a link once
  every rank has printed ``looping``).
- ``interrupt``: as ``loop``, with all_reduces of 32 MB (each long, through both levels); rank 2 prints
  ``rank 2 pid P`` (its pid on its host) and the test sends it SIGINT (Ctrl-C): its KeyboardInterrupt
  is reported, then left to end the process as a user's would.
- ``mismatch-size`` / ``mismatch-kind``: rank 2 calls an all_reduce of another size / a broadcast while
  the others all_reduce; each rank then says whether its buffer changed. ``mismatch-size`` goes on with
  the other collectives (`SIZE_CASES`), rank 2's sizes off by one where each rank's own buffers fit, and
  prints ``rank R case C raised <type>: <message>`` and ``rank R case C unchanged: <bool>`` for each.

A rank whose call fails prints ``rank R raised <type>: <message>`` (one line) and ``rank R named
<the error's ranks>``, and exits 1; one that is still running after 60 s prints ``rank R never raised``
and exits 2.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from output import say  # the jobs' directory is on sys.path: they run as scripts

N = 300_003  # above the two-level cut
mode = sys.argv[1]
dist.init_process_group("axonml", timeout=datetime.timedelta(seconds=10))
rank = dist.get_rank()


def report(e: BaseException, started: float) -> None:
    first = str(e).replace("\n", " | ")
    elapsed = time.monotonic() - started
    say(f"rank {rank} raised {type(e).__name__}: {first}\nrank {rank} failed after {elapsed:.1f} s")
    say(f"rank {rank} named {list(getattr(e, 'ranks', []))}")


def size_cases() -> None:
    """Each collective with rank 2's element count (or a split size) one off, every rank's own buffers
    consistent: all must raise before any buffer changes (the group stays usable after a mismatch)."""
    world, n, odd = dist.get_world_size(), 1001, rank == 2
    mine = n + odd
    cases = {
        "broadcast": lambda: ([torch.arange(mine, dtype=torch.float32)], lambda b: dist.broadcast(b[0], 0)),
        "all_gather_into_tensor": lambda: (
            [torch.full((world * mine,), -7.0), torch.ones(mine)],
            lambda b: dist.all_gather_into_tensor(b[0], b[1]),
        ),
        "reduce_scatter_tensor": lambda: (
            [torch.full((mine,), -7.0), torch.ones(world * mine)],
            lambda b: dist.reduce_scatter_tensor(b[0], b[1]),
        ),
        "reduce": lambda: ([torch.ones(mine)], lambda b: dist.reduce(b[0], dst=1)),
        "gather": lambda: (
            [torch.ones(mine), *([torch.full((mine,), -7.0) for _ in range(world)] if rank == 1 else [])],
            lambda b: dist.gather(b[0], b[1:] or None, dst=1),
        ),
        "scatter": lambda: (
            [torch.full((mine,), -7.0), *([torch.ones(mine) for _ in range(world)] if rank == 2 else [])],
            lambda b: dist.scatter(b[0], b[1:] or None, src=2),
        ),
        "all_to_all": lambda: (
            [*(torch.ones(mine) for _ in range(world)), *(torch.full((mine,), -7.0) for _ in range(world))],
            lambda b: dist.all_to_all(b[world:], b[:world]),
        ),
        # Uneven splits, as all_to_all_single allows, but rank 2 sends rank 0 one element more than rank
        # 0 expects from it.
        "all_to_all_single": lambda: (
            [torch.ones(sum(sends())), torch.full((sum(receives()),), -7.0)],
            lambda b: dist.all_to_all_single(b[1], b[0], receives(), sends()),
        ),
    }
    for name, make in cases.items():
        buffers, call = make()
        before = [b.clone() for b in buffers]
        try:
            call(buffers)
            say(f"rank {rank} case {name} never raised")
        except Exception as e:  # noqa: BLE001 (every failure is reported)
            say(f"rank {rank} case {name} raised {type(e).__name__}: {str(e).replace(chr(10), ' | ')}")
        unchanged = all(torch.equal(b, a) for b, a in zip(buffers, before, strict=True))
        say(f"rank {rank} case {name} unchanged: {unchanged}")


def sends() -> list[int]:
    return [rank + p + 1 + (rank == 2 and p == 0) for p in range(dist.get_world_size())]


def receives() -> list[int]:
    return [s + rank + 1 for s in range(dist.get_world_size())]


t = torch.ones(N)
dist.all_reduce(t)
assert torch.equal(t, torch.full((N,), 4.0)), t
started = time.monotonic()
if mode == "raise" and rank == 2:
    raise RuntimeError("deliberate failure on rank 2")
if mode.startswith("mismatch"):
    mine = torch.arange(N + (rank == 2), dtype=torch.float32)
    before = mine.clone()
    try:
        if rank == 2 and mode == "mismatch-kind":
            dist.broadcast(mine, src=0)
        else:
            dist.all_reduce(mine)
        say(f"rank {rank} never raised")
    except Exception as e:  # noqa: BLE001 (every failure is reported)
        report(e, started)
    say(f"rank {rank} buffer unchanged: {torch.equal(mine, before)}")
    if mode == "mismatch-size":
        size_cases()
    sys.exit(1)
if mode == "interrupt":
    t = torch.ones(8_000_000)
    if rank == 2:
        say(f"rank {rank} pid {os.getpid()}")
say(f"rank {rank} looping")
try:
    while time.monotonic() - started < 60:
        dist.all_reduce(t)
        t.fill_(1.0)
except KeyboardInterrupt as e:
    report(e, started)
    raise
except Exception as e:  # noqa: BLE001
    report(e, started)
    sys.exit(1)
say(f"rank {rank} never raised")
sys.exit(2)
