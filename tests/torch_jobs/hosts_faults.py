"""A torchrun job for tests/test_hosts_torch.py: faults across 2 simulated hosts x 2 ranks over "axonml",
with a group timeout of 10 s. ``hosts_faults.py MODE``:

- ``raise``: rank 2 (on h1) raises after a first all_reduce; the others keep all_reducing.
- ``loop``: every rank all_reduces until something fails (the test kills a host or cuts a link once
  every rank has printed ``looping``).
- ``mismatch-size`` / ``mismatch-kind``: rank 2 calls an all_reduce of another size / a broadcast while
  the others all_reduce; each rank then says whether its buffer changed.

A rank whose call fails prints ``rank R raised <type>: <message>`` (one line) and exits 1; one that is
still running after 60 s prints ``rank R never raised`` and exits 2.
"""

from __future__ import annotations

import datetime
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
    sys.exit(1)
say(f"rank {rank} looping")
try:
    while time.monotonic() - started < 60:
        dist.all_reduce(t)
        t.fill_(1.0)
except Exception as e:  # noqa: BLE001
    report(e, started)
    sys.exit(1)
say(f"rank {rank} never raised")
sys.exit(2)
