"""A torchrun job for tests/test_hosts_torch.py: every collective of the "axonml" backend across hosts
(2 hosts x 2 ranks), each against a reference computed here with torch ops from every rank's inputs
(every rank can make every rank's input: `data`), then torch DDP over "axonml" against torch DDP over a
gloo group of the same ranks.

Prints one ``WRONG <check>: <what>`` line per wrong result and ends with ``rank R of W on HOST: N checks,
M wrong`` (exit 1 if any is wrong). With AXONML_HOSTS_SEGMENT_KIB small (the test sets 64), the large
all_reduces run through several pipeline segments.
"""

from __future__ import annotations

import datetime
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from models import ToyModel  # the jobs' directory is on sys.path: they run as scripts
from output import say
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# No import of ours: torch loads "axonml" through the package's entry point, as for any user script.


FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64]
# Below the two-level cut (64 KiB) in every dtype, above it in every dtype (and not a multiple of 4).
SIZES = [1_001, 100_003]
OPS = ["SUM", "AVG", "PREMUL_SUM", "MIN", "MAX", "PRODUCT"]
FACTOR = 0.5  # PREMUL_SUM's: a power of two, so the reference is exact in every order
checks = 0
wrong: list[str] = []


def check(name: str, ok: bool, what: Callable[[], str] = lambda: "") -> None:
    global checks
    checks += 1
    if not ok:
        wrong.append(name)
        say(f"WRONG {name}: {what()}")


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    check(name, got.dtype == want.dtype and torch.equal(got, want), lambda: f"got {got[:8]} want {want[:8]}")


def data(rank: int, n: int, dtype: torch.dtype, seed: int = 0, low: int = -3, high: int = 4) -> torch.Tensor:
    """Rank `rank`'s input: small integers in any dtype, so sums, products, averages over 4 ranks and
    PREMUL_SUM's factor are exact in every dtype and every order (the reference is bitwise)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(low, high, (n,), generator=g).to(dtype)


def reference(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([t.double() for t in inputs])
    if op == "SUM":
        out = stacked.sum(0)
    elif op == "AVG":
        out = stacked.sum(0) / len(inputs)
    elif op == "PREMUL_SUM":
        out = (stacked * FACTOR).sum(0)
    elif op == "MIN":
        out = stacked.min(0).values
    elif op == "MAX":
        out = stacked.max(0).values
    else:
        out = stacked.prod(0)
    return out.to(inputs[0].dtype)


def reduce_op(op: str) -> Any:
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(FACTOR)
    return getattr(dist.ReduceOp, op)


def identical_everywhere(name: str, t: torch.Tensor, group: Any = None) -> None:
    """The result bitwise the same on every rank of `group`: gathered and compared as raw bytes."""
    raw = t.reshape(-1).view(torch.uint8)
    everyone = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, raw, group=group)
    check(f"{name} identical on every rank", all(torch.equal(e, raw) for e in everyone))


def all_reduces(rank: int, world: int) -> None:
    for dtype in FLOATS + INTS:
        for op in OPS:
            if op in ("AVG", "PREMUL_SUM") and not dtype.is_floating_point:
                continue  # torch defines neither for integers
            for n in SIZES:
                seed = OPS.index(op) * 10 + SIZES.index(n)
                # PRODUCT of 4 ranks: values in -2..2 keep float16's and bfloat16's products exact.
                low, high = (-2, 3) if op == "PRODUCT" else (-3, 4)
                inputs = [data(r, n, dtype, seed, low, high) for r in range(world)]
                name = f"all_reduce {op} {dtype} n={n}"
                t = inputs[rank].clone()
                dist.all_reduce(t, op=reduce_op(op))
                same(name, t, reference(op, inputs))
                identical_everywhere(name, t)
    # Random floats (sums that round): every rank bitwise alike and run to run (the same call again).
    for n in SIZES + [300_001]:
        g = torch.Generator().manual_seed(99 + rank)
        mine = torch.rand(n, generator=g, dtype=torch.float32) * 2 - 1
        first, again = mine.clone(), mine.clone()
        dist.all_reduce(first)
        dist.all_reduce(again)
        name = f"all_reduce random float32 n={n}"
        inputs = [
            torch.rand(n, generator=torch.Generator().manual_seed(99 + r)) * 2 - 1 for r in range(world)
        ]
        check(name, torch.allclose(first, sum(inputs), rtol=1e-5, atol=1e-6))
        check(f"{name} run to run", torch.equal(first, again))
        identical_everywhere(name, first)
    # Asynchronous, several in flight at once (DDP's way): each right.
    tensors = [data(rank, 50_000, torch.float32, 70 + i) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for i, (w, t) in enumerate(zip(works, tensors, strict=True)):
        w.wait()
        same(f"async all_reduce #{i}", t, sum(data(r, 50_000, torch.float32, 70 + i) for r in range(world)))
    # A two-level all_reduce still in flight, then a call that goes to gloo: it waits for it (program
    # order), so the broadcast sends the reduced values.
    pending = data(rank, 50_000, torch.float32, 80)
    work = dist.all_reduce(pending, async_op=True)
    dist.broadcast(pending, src=1)
    work.wait()
    same(
        "broadcast after a pending async all_reduce",
        pending,
        sum(data(r, 50_000, torch.float32, 80) for r in range(world)),
    )
    # A dtype gloo cannot carry between hosts: the same TypeError on every rank, and the group goes on.
    try:
        dist.all_reduce(torch.ones(8, dtype=torch.int16))
        check("int16 across hosts refused", False, lambda: "no error")
    except TypeError as e:
        said = str(e)
        check("int16 across hosts refused", "gloo carries no torch.int16" in said, lambda: said)


def collectives(rank: int, world: int) -> None:
    dtype = torch.float32
    for n in (7, 100_003):
        b = data(rank, n, dtype, 1)
        dist.broadcast(b, src=2)
        same(f"broadcast n={n}", b, data(2, n, dtype, 1))
        gathered = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(gathered, data(rank, n, dtype, 2))
        same(
            f"all_gather n={n}", torch.cat(gathered), torch.cat([data(r, n, dtype, 2) for r in range(world)])
        )
        into = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(into, data(rank, n, dtype, 3))
        same(f"all_gather_into_tensor n={n}", into, torch.cat([data(r, n, dtype, 3) for r in range(world)]))
        # reduce_scatter: rank r's input is world chunks; r gets the sum of everyone's chunk r.
        chunks = [[data(r * world + c, n, dtype, 4) for c in range(world)] for r in range(world)]
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, [c.clone() for c in chunks[rank]])
        same(f"reduce_scatter n={n}", out, sum(chunks[r][rank] for r in range(world)))
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.cat(chunks[rank]))
        same(f"reduce_scatter_tensor n={n}", out, sum(chunks[r][rank] for r in range(world)))
        red = data(rank, n, dtype, 5)
        dist.reduce(red, dst=3, op=dist.ReduceOp.MAX)
        if rank == 3:
            same(
                f"reduce n={n}", red, torch.stack([data(r, n, dtype, 5) for r in range(world)]).max(0).values
            )
        got = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == 1 else None
        dist.gather(data(rank, n, dtype, 6), got, dst=1)
        if got is not None:
            same(f"gather n={n}", torch.cat(got), torch.cat([data(r, n, dtype, 6) for r in range(world)]))
        scattered = torch.empty(n, dtype=dtype)
        pieces = [data(100 + r, n, dtype, 7) for r in range(world)] if rank == 2 else None
        dist.scatter(scattered, pieces, src=2)
        same(f"scatter n={n}", scattered, data(100 + rank, n, dtype, 7))
        # all_to_all: rank r sends piece p to rank p; piece (r, p) made from both.
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, [data(r_p(rank, p), n, dtype, 8) for p in range(world)])
        same(
            f"all_to_all n={n}",
            torch.cat(outs),
            torch.cat([data(r_p(s, rank), n, dtype, 8) for s in range(world)]),
        )
    # reduce_scatter, uneven (gloo allows it): rank r's output holds r + 2 elements, so entry r of every
    # rank's input list does.
    lists = [[data(r * world + c, c + 2, dtype, 10) for c in range(world)] for r in range(world)]
    out = torch.empty(rank + 2, dtype=dtype)
    dist.reduce_scatter(out, [c.clone() for c in lists[rank]])
    same("reduce_scatter uneven", out, sum(lists[r][rank] for r in range(world)))
    # all_to_all_single, uneven: rank s sends (s + p + 1) elements to rank p.
    send = [s + p + 1 for s in range(world) for p in range(world)]
    splits_out = [rank + p + 1 for p in range(world)]
    splits_in = [s + rank + 1 for s in range(world)]
    source = torch.cat([data(r_p(rank, p), splits_out[p], dtype, 9) for p in range(world)])
    sink = torch.empty(sum(splits_in), dtype=dtype)
    dist.all_to_all_single(sink, source, splits_in, splits_out)
    want = torch.cat([data(r_p(s, rank), splits_in[s], dtype, 9) for s in range(world)])
    same("all_to_all_single uneven", sink, want)
    check("all_to_all_single splits", len(send) == world * world)
    dist.barrier()
    check("barrier", True)


def r_p(sender: int, receiver: int) -> int:
    return 1000 + sender * 10 + receiver


def point_to_point(rank: int, world: int) -> None:
    """Pairs across hosts: 0 <-> 2 and 1 <-> 3 (h0 holds 0 and 1, h1 holds 2 and 3)."""
    peer = (rank + 2) % world
    n = 100_003
    for way in ("blocking", "async"):
        got = torch.empty(n)
        seed = 20 if way == "blocking" else 21
        if way == "blocking":
            if rank < 2:
                dist.send(data(rank, n, torch.float32, seed), peer)
                dist.recv(got, peer)
            else:
                dist.recv(got, peer)
                dist.send(data(rank, n, torch.float32, seed), peer)
        else:
            sent = dist.isend(data(rank, n, torch.float32, seed), peer)
            dist.irecv(got, peer).wait()
            sent.wait()
        same(f"send/recv {way}", got, data(peer, n, torch.float32, seed))
    got = torch.empty(n)
    ops = [dist.P2POp(dist.isend, data(rank, n, torch.float32, 22), peer), dist.P2POp(dist.irecv, got, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    same("batch_isend_irecv", got, data(peer, n, torch.float32, 22))
    # From any source: rank 0 hears from 2 and 3 (the other host), in whichever order they come.
    if rank == 0:
        heard = {}
        for _ in range(2):
            t = torch.empty(5)
            src = dist.recv(t)
            heard[src] = t
        check("recv from any source: senders", sorted(heard) == [2, 3], lambda: f"{sorted(heard)}")
        for src, t in heard.items():
            same(f"recv from any source {src}", t, data(src, 5, torch.float32, 23))
    elif rank >= 2:
        dist.send(data(rank, 5, torch.float32, 23), 0)
    dist.barrier()


def groups(rank: int, world: int) -> None:
    spans = {"[0, 2]": [0, 2], "[1, 2, 3]": [1, 2, 3], "[0, 1]": [0, 1], "[3, 2, 1, 0]": [3, 2, 1, 0]}
    made = {name: dist.new_group(ranks) for name, ranks in spans.items()}
    for name, ranks in spans.items():
        if rank not in ranks:
            continue
        group = made[name]
        members = sorted(ranks)
        for n in SIZES:
            inputs = {r: data(r, n, torch.float32, 30 + len(ranks)) for r in members}
            t = inputs[rank].clone()
            dist.all_reduce(t, group=group)
            same(f"new_group {name} all_reduce n={n}", t, sum(inputs[r] for r in members))
            identical_everywhere(f"new_group {name} all_reduce n={n}", t, group)
        b = data(rank, 9, torch.float32, 31)
        dist.broadcast(b, src=members[-1], group=group)
        same(f"new_group {name} broadcast", b, data(members[-1], 9, torch.float32, 31))
        gathered = [torch.empty(4) for _ in members]
        dist.all_gather(gathered, data(rank, 4, torch.float32, 32), group=group)
        order = [dist.get_global_rank(group, i) for i in range(len(members))]
        same(
            f"new_group {name} all_gather",
            torch.cat(gathered),
            torch.cat([data(r, 4, torch.float32, 32) for r in order]),
        )
    # By host (2 ranks each: [0, 1], [2, 3]) and across hosts ([0, 2], [1, 3]).
    mine, _ = dist.new_subgroups(group_size=2)
    across, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    for name, group, members in (
        ("new_subgroups", mine, [rank - rank % 2, rank - rank % 2 + 1]),
        ("new_subgroups_by_enumeration", across, [rank % 2, rank % 2 + 2]),
    ):
        for n in SIZES:
            t = data(rank, n, torch.float32, 40)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            same(
                f"{name} all_reduce n={n}",
                t,
                torch.stack([data(r, n, torch.float32, 40) for r in members]).max(0).values,
            )
    dist.barrier()


def ddp(rank: int, world: int) -> None:
    """torch's DDP over "axonml" (the default group) and over a gloo group of the same ranks on the same
    hosts: same seed, same data, a few SGD steps. Equal to float32 rounding, not bitwise: the gradient
    sums differ in order ((r0 + r1) + (r2 + r3) through the two levels, another order in gloo's ring);
    measured: not bitwise (each rank prints whether it was).
    The wide layers make buckets of about 1 MB, so they take the two-level path."""
    gloo = dist.new_group(backend="gloo")
    finals = {}
    for name, group in (("axonml", None), ("gloo", gloo)):
        torch.manual_seed(100 + rank)  # different weights on every rank: DDP broadcasts rank 0's
        model = nn.Sequential(ToyModel(), nn.Linear(5, 40_000), nn.Linear(40_000, 3))
        wrapped = DDP(model, process_group=group, bucket_cap_mb=1)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(7 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        finals[name] = [p.detach().clone() for p in model.parameters()]
    pairs = list(zip(finals["axonml"], finals["gloo"], strict=True))
    for i, (ours, theirs) in enumerate(pairs):
        diff = (ours - theirs).abs().max()
        check(
            f"ddp param {i} axonml ~ gloo",
            torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6),
            lambda diff=diff: f"max difference {diff}",
        )
    bitwise = all(torch.equal(a, b) for a, b in pairs)
    say(f"rank {rank}: ddp bitwise equal to gloo: {bitwise}")
    flat = torch.cat([p.view(-1) for p in finals["axonml"]])
    identical_everywhere("ddp parameters", flat)


def main() -> int:
    dist.init_process_group("axonml", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    pg = type(dist.group.WORLD).__name__
    say(f"rank {rank}: default group {pg}")
    for part in (all_reduces, collectives, point_to_point, groups, ddp):
        part(rank, world)
    say(f"rank {rank} of {world} on {socket.gethostname()}: {checks} checks, {len(wrong)} wrong")
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
