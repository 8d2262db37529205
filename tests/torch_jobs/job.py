"""Jobs for tests/test_torch_backend.py, over the "axonml" torch.distributed backend.

``job.py MODES OUT [INIT]``: MODES (comma-separated) pick what to run, one after another in the same
processes, each with an init and a destroy of its own; OUT is a directory each rank writes each mode's
``<mode>-rank<r>.pt`` results (or its exception) to. Under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set) it runs as one rank with env://; with INIT (a tcp:// or file:// URL) it starts its
ranks with torch.multiprocessing.spawn.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# No import of ours: torch loads "axonml" through the package's entry point, as for any user script.

TIMEOUT = datetime.timedelta(seconds=30)
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.int16,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.complex128,
]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def allowed(op: str, dtype: torch.dtype) -> bool:
    """The core's op/dtype table, and torch's own for complex (it passes SUM and AVG on as floats)."""
    if dtype.is_complex:
        return op in ("SUM", "AVG")
    if dtype.is_floating_point:
        return op not in ("BAND", "BOR", "BXOR")
    return op != "AVG"


def data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input: small values, so products stay finite in every dtype (integer-valued
    complex parts, so sums are exact whatever torch's complex kernels do)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re, im = torch.randint(-4, 5, (2, n), generator=g, dtype=torch.float64)
        return torch.complex(re, im).to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(1 if dtype in UNSIGNED else -3, 4, (n,), generator=g).to(dtype)


def collectives(rank: int, world: int) -> dict[str, Any]:
    """Every collective and dtype; the test compares with references built from `data`."""
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        for op in filter(lambda op: allowed(op, dtype), OPS):
            t = data(rank, 33, dtype, seed=OPS.index(op))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"all_reduce/{dtype}/{op}"] = t
        b = data(rank, 5, dtype)
        dist.broadcast(b, src=world - 1)
        out[f"broadcast/{dtype}"] = b
        gathered = [torch.zeros(4, dtype=dtype) for _ in range(world)]
        dist.all_gather(gathered, data(rank, 4, dtype))
        out[f"all_gather/{dtype}"] = gathered
    x = data(rank, 6, torch.float32)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    out["premul_sum"] = x
    # PREMUL_SUM on reduce: off the destination the input stays as it was.
    y = data(rank, 6, torch.float64)
    dist.reduce(y, dst=world - 1, op=dist._make_nccl_premul_sum(0.25))
    out["premul_sum_reduce"] = y
    big = torch.zeros(world * 4)
    dist.all_gather_into_tensor(big, data(rank, 4, torch.float32))
    out["all_gather_into_tensor"] = big
    rs = torch.zeros(3)
    dist.reduce_scatter(rs, [data(rank, 3, torch.float32, seed=10 + j) for j in range(world)])
    out["reduce_scatter"] = rs
    rst = torch.zeros(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(rst, data(rank, 3 * world, torch.float64), op=dist.ReduceOp.MAX)
    out["reduce_scatter_tensor"] = rst
    g = [torch.zeros(2, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(data(rank, 2, torch.int64), g, dst=0)
    out["gather"] = g
    sc = torch.zeros(2, dtype=torch.int32)
    dist.scatter(sc, [data(j, 2, torch.int32, seed=7) for j in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = sc
    red = data(rank, 5, torch.float16)
    dist.reduce(red, dst=world - 1)
    out["reduce"] = red
    dist.barrier()
    # Non-contiguous: a transposed view, reduced in place.
    nc = data(rank, 12, torch.float32).reshape(3, 4).t()
    dist.all_reduce(nc)
    out["non_contiguous"] = nc
    # Async: the future completes with the reduced tensor.
    fut_t = data(rank, 7, torch.float64)
    work = dist.all_reduce(fut_t, async_op=True)
    out["future"] = work.get_future().wait()[0]
    out["work_completed"] = work.is_completed()
    # An async reduction of a non-contiguous view: copied back before its future completes.
    nca = data(rank, 12, torch.float32).reshape(3, 4).t()
    out["non_contiguous_future"] = dist.all_reduce(nca, async_op=True).get_future().wait()[0].clone()
    out["non_contiguous_async"] = nca
    # Receives from any source, as torch's test_send_recv_any_source: each rank in turn receives twice
    # from every other (by recv, which returns the sender, and by irecv, whose work names it); the
    # others send it their rank. Then a tag filter: the last rank sends tags 1 and 2, rank 0 takes 2 first.
    senders = []
    for dst in range(world):
        if dst != rank:
            dist.send(torch.full((10, 10, 10), float(rank)), dst)
            dist.send(torch.full((10, 10, 10), float(rank)), dst)
            continue
        for _ in range(world - 1):
            by_recv, by_irecv = torch.full((10, 10, 10), -1.0), torch.full((10, 10, 10), -1.0)
            senders.append((dist.recv(by_recv), by_recv.unique().tolist()))
            work = dist.irecv(by_irecv)
            work.wait()
            senders.append((work._source_rank(), by_irecv.unique().tolist()))
    out["recv_anysource"] = senders
    if rank == world - 1:
        dist.send(torch.ones(2), 0, tag=1)
        dist.send(torch.full((2,), 2.0), 0, tag=2)
    elif rank == 0:
        tagged = [torch.zeros(2), torch.zeros(2)]
        out["recv_anysource_tags"] = [dist.recv(tagged[0], tag=2), dist.recv(tagged[1], tag=1), tagged]
    # Objects, through torch's own code.
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    out["all_gather_object"] = objs
    lst: list[Any] = [f"from {rank}", rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(lst, src=1)
    out["broadcast_object_list"] = lst
    # Point to point.
    peer = (rank + 1) % world
    prev = (rank - 1) % world
    recv = torch.zeros(5)
    reqs = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, recv, prev), dist.P2POp(dist.isend, data(rank, 5, torch.float32), peer)]
    )
    for r in reqs:
        r.wait()
    out["batch_isend_irecv"] = recv
    if rank == 0:
        dist.send(data(rank, 3, torch.int64), 1)
    elif rank == 1:
        got = torch.zeros(3, dtype=torch.int64)
        dist.recv(got, 0)
        out["send_recv"] = got
    # Subgroups: new_group and new_subgroups (each rank alone, then everyone).
    sub = dist.new_group([world - 1])
    if rank == world - 1:
        s = data(rank, 3, torch.float32)
        dist.all_reduce(s, group=sub)
        out["new_group_single"] = s
    everyone = dist.new_group(list(range(world)))
    e = data(rank, 3, torch.float32)
    dist.all_reduce(e, group=everyone)
    out["new_group_all"] = e
    mine, _ = dist.new_subgroups(group_size=1)
    m = data(rank, 3, torch.float32)
    dist.all_reduce(m, group=mine)
    out["new_subgroups"] = m
    # all_to_all: equal parts; uneven splits of rows (rank r sends r + j + 1 rows of 2 to rank j); lists
    # (rank r sends r + 1 elements to each); and uneven all_gather / reduce_scatter lists.
    a2a = torch.empty(world * 3)
    dist.all_to_all_single(a2a, data(rank, world * 3, torch.float32, seed=20))
    out["all_to_all_single"] = a2a
    splits = [rank + j + 1 for j in range(world)]
    a2av = torch.empty(sum(splits), 2, dtype=torch.int64)
    rows = data(rank, 2 * sum(splits), torch.int64, seed=21).view(-1, 2)
    dist.all_to_all_single(a2av, rows, splits, splits)
    out["all_to_all_single_splits"] = a2av
    lists = [torch.empty(j + 1) for j in range(world)]
    dist.all_to_all(lists, [data(rank, rank + 1, torch.float32, seed=30 + j) for j in range(world)])
    out["all_to_all"] = lists
    uneven = [torch.empty(j + 1, dtype=torch.float64) for j in range(world)]
    dist.all_gather(uneven, data(rank, rank + 1, torch.float64, seed=40))
    out["all_gather_uneven"] = uneven
    rsv = torch.empty(rank + 1)
    dist.reduce_scatter(rsv, [data(rank, j + 1, torch.float32, seed=50 + j) for j in range(world)])
    out["reduce_scatter_uneven"] = rsv
    # all_gather_coalesced: outputs[r][j] receives rank r's inputs[j] (shapes differ, one is empty;
    # torch asks for one dtype).
    ins = [
        data(rank, 3, torch.float32, seed=60),
        torch.empty(0),
        data(rank, 4, torch.float32, seed=61).view(2, 2),
    ]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    out["all_gather_coalesced"] = outs
    # Sequence numbers: equal on every member between calls, and counting calls.
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    dist.barrier()
    out["sequence_numbers"] = (
        seq,
        dist.distributed_c10d._get_default_group()._get_sequence_number_for_group(),
    )
    return out


def ddp(rank: int, world: int) -> dict[str, Any]:
    """torch DDP over "axonml" and over a gloo group of the same ranks, from the same start: batch
    norm (buffers broadcast before each forward), small buckets, and no_sync() accumulation."""
    gloo = dist.new_group(list(range(world)), backend="gloo")
    from axonml_distributed.torch import group as ours

    inline = ours.INLINE_IN_BACKWARD
    result = {}
    for name, group in [("axonml", None), ("axonml async", None), ("gloo", gloo)]:
        # "axonml async": every bucket through the lane and its future, as buckets over 1 MiB go.
        ours.INLINE_IN_BACKWARD = -1 if name == "axonml async" else inline
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(4):
            opt.zero_grad()
            if step % 2:  # one local micro-batch, then the synced one averages the accumulated sum
                with net.no_sync():
                    net(torch.randn(16, 8, generator=gen)).square().mean().backward()
            net(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
        result[name] = [t.detach().clone() for t in model.parameters()]
        # Buffers are each rank's own after its last forward (broadcast only before one), as in torch.
        result[f"{name} buffers"] = [t.detach().clone() for t in model.buffers()]
    return result


def _profiled_calls(rank: int, world: int, group: Any) -> dict[str, Any]:
    """Each collective and point-to-point form on `group`, by name: a function that calls it once."""
    peer, prev = (rank + 1) % world, (rank - 1) % world

    def t(*shape: int) -> torch.Tensor:
        return torch.ones(*shape)

    def p2p() -> None:
        ops = [dist.P2POp(dist.isend, t(2), peer, group), dist.P2POp(dist.irecv, t(2), prev, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def root_list() -> list[torch.Tensor] | None:
        return [t(3, 2) for _ in range(world)] if rank == 0 else None

    return {
        "all_reduce": lambda: dist.all_reduce(t(2, 3), group=group),
        "all_reduce async": lambda: dist.all_reduce(t(2, 3), group=group, async_op=True).wait(),
        "all_reduce future": lambda: dist.all_reduce(t(4), group=group, async_op=True).get_future().wait(),
        "all_reduce complex": lambda: dist.all_reduce(torch.ones(4, dtype=torch.complex64), group=group),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([t(2), t(3, 1)], group=group),
        "broadcast": lambda: dist.broadcast(t(4), src=world - 1, group=group),
        "reduce": lambda: dist.reduce(t(5), dst=0, group=group),
        "all_gather": lambda: dist.all_gather([t(2) for _ in range(world)], t(2), group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t(2 * world), t(2), group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(2), t(2 * world), group=group),
        "reduce_scatter": lambda: dist.reduce_scatter(t(2), [t(2) for _ in range(world)], group=group),
        "gather": lambda: dist.gather(t(3, 2), root_list(), dst=0, group=group),
        "scatter": lambda: dist.scatter(t(3, 2), root_list(), src=0, group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(t(world, 2), t(world, 2), group=group),
        "all_to_all": lambda: dist.all_to_all([t(2)] * world, [t(2)] * world, group=group),
        "barrier": lambda: dist.barrier(group=group),
        "send_recv": lambda: (
            dist.send(t(3, 2), 1, group=group) if rank == 0 else dist.recv(t(3, 2), 0, group=group)
        ),
        "isend_irecv": lambda: (
            dist.isend(t(4, 1), 1, group=group) if rank == 0 else dist.irecv(t(4, 1), 0, group=group)
        ).wait(),
        "batch_isend_irecv": p2p,
    }


def profiled(rank: int, world: int) -> dict[str, Any]:
    """Each call under torch's two profilers, on "axonml" and on a gloo group of the same ranks: the
    events whose name starts with the backend's name, as (name, count, is_async, input_shapes)."""
    gloo = dist.new_group(list(range(world)), backend="gloo")
    profilers = {
        "autograd": lambda: torch.autograd.profiler.profile(record_shapes=True),
        "torch": lambda: torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        ),
    }
    out: dict[str, Any] = {}
    for backend, group in [("axonml", None), ("gloo", gloo)]:
        for name, call in _profiled_calls(rank, world, group).items():
            for kind, profiler in profilers.items():
                with profiler() as prof:
                    call()
                events = prof.events() if kind == "torch" else prof.function_events
                out[f"{backend}/{name}/{kind}"] = [
                    (e.name, e.count, e.is_async, e.input_shapes)
                    for e in events
                    if e.name.startswith(f"{backend}:")
                ]
                dist.barrier()
    return out


def sparse_inputs(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s sparse COO inputs: torch's own cases, duplicate (uncoalesced) indices, a rank with
    no entries, dense dimensions, and each dtype of ours."""
    from torch.testing._internal.common_distributed import simple_sparse_reduce_tests

    out = {f"torch case {i}": ins[0] for i, (ins, _) in enumerate(simple_sparse_reduce_tests(rank, world))}
    g = torch.Generator().manual_seed(rank)
    for dtype in DTYPES[:9]:
        idx = torch.randint(0, 6, (2, 5 + rank), generator=g)
        out[f"duplicates {dtype}"] = torch.sparse_coo_tensor(idx, data(rank, 5 + rank, dtype), (6, 6))
    rows = torch.randint(0, 10, (1, 4 * rank), generator=g)
    out["empty on rank 0, dense dims"] = torch.sparse_coo_tensor(
        rows, torch.randn(4 * rank, 3, generator=g), (10, 3)
    )
    return out


def sparse(rank: int, world: int) -> dict[str, Any]:
    """Sparse all_reduce (blocking, async, through the future) on "axonml" and on a gloo group of the
    same ranks; what non-SUM ops and shapes that differ raise; then torch DDP with a sparse embedding."""
    gloo = dist.new_group(list(range(world)), backend="gloo")
    out: dict[str, Any] = {}
    for backend, group in [("axonml", None), ("gloo", gloo)]:
        for name, t in sparse_inputs(rank, world).items():
            if backend == "gloo" and t.dtype in (torch.float16, torch.bool):
                continue  # gloo's sparse sum has no kernel for them
            how = ["blocking", "async", "future"][len(name) % 3]
            if how == "blocking":
                dist.all_reduce(t, group=group)
            elif how == "async":
                dist.all_reduce(t, group=group, async_op=True).wait()
            else:
                t = dist.all_reduce(t, group=group, async_op=True).get_future().wait()[0]
            out[f"{backend}/{name}"] = (t.is_coalesced(), t._indices().clone(), t._values().clone())
    t = sparse_inputs(rank, world)["torch case 0"]
    for op in ["MAX", "AVG"]:
        try:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        except ValueError as e:
            out[f"error {op}"] = str(e)
    try:
        dist.all_reduce(
            torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), (3 + rank,))
        )
    except ValueError as e:
        out["error shape"] = str(e)
    after = torch.ones(1)
    dist.all_reduce(after)
    out["after errors"] = float(after)  # the world is still in step
    result = {}
    for name, group in [("axonml", None), ("gloo", gloo)]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.EmbeddingBag(50, 8, mode="sum", sparse=True), torch.nn.Linear(8, 3)
        )
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            opt.zero_grad()
            net(torch.randint(0, 50, (6, 5), generator=gen)).square().mean().backward()
            opt.step()
        result[name] = [p.detach().clone() for p in model.parameters()]
    out["ddp"] = result
    return out


def mismatch(rank: int, world: int) -> dict[str, Any]:
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)
    return {}


def dies(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 vanishes after DDP's constructor; rank 0's backward, then a collective, must fail."""
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    if rank == 1:
        os._exit(3)  # gone without a word, like a SIGKILLed rank
    try:
        net(torch.randn(3, 4)).sum().backward()
    except RuntimeError as e:
        NOTES["ddp"] = f"{type(e).__name__}: {e}"
    dist.all_reduce(torch.ones(4))
    return {}


def group_timeout(rank: int, world: int) -> dict[str, Any]:
    """torch's test_barrier_timeout_full_group: a barrier on a group of every rank with a 1 s timeout,
    in a world of 30 s, while rank 1 comes late."""
    return _late_peer(dist.new_group(timeout=datetime.timedelta(seconds=1)), rank, dist.barrier)


def group_recv_timeout(rank: int, world: int) -> dict[str, Any]:
    """A receive on a subgroup with a 1 s timeout from a rank that sends nothing in time."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    return _late_peer(group, rank, lambda group: dist.recv(torch.zeros(4), src=1, group=group))


def monitored_zero(rank: int, world: int) -> dict[str, Any]:
    """torch's test_monitored_barrier_gloo_rank_0_timeout: rank 0 alone calls a group's monitored barrier
    with a zero timeout."""
    group = dist.new_group(ranks=list(range(world)))
    if rank == 0:
        group.monitored_barrier(datetime.timedelta(seconds=0))
    return {}


def _late_peer(group: Any, rank: int, call: Any) -> dict[str, Any]:
    """Rank 0 makes `call` on `group` at once, rank 1 after 4 s; what rank 0 raised goes with how long it
    waited."""
    import time

    if rank == 1:
        time.sleep(4)
        dist.barrier(group)  # the world was aborted by rank 0's timeout by now: our PeerFailureError
        return {}
    start = time.monotonic()
    try:
        call(group)
    finally:
        NOTES["waited"] = time.monotonic() - start
    return {}


def nested(rank: int, world: int) -> dict[str, Any]:
    """A future's callback that issues and waits on another collective (as torch's PowerSGD hook
    does), and DDP with the PowerSGD hook itself; then named groups as DeviceMesh needs them."""
    t, u = torch.ones(2), torch.ones(2)
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.then(lambda f: dist.all_reduce(u, async_op=True).get_future().wait()).wait()
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    state = powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2)
    net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        net(torch.randn(8, 16, generator=gen)).square().sum().backward()
    groups = [dist.new_group([0, 1]) for _ in range(5)]  # more than the old staging pool held
    sums = []
    for g in groups:
        x = torch.ones(3)
        dist.all_reduce(x, group=g)
        sums.append(float(x[0]))
    names = [g.group_name for g in groups]
    for g in groups:
        dist.destroy_process_group(g)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    y = torch.full((2,), float(rank))
    dist.all_reduce(y, group=mesh.get_group())
    return {"nested": got[0], "sums": sums, "names": names, "mesh": y}


def raises(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 raises and its process stays alive (a non-daemon thread): rank 0 must be told at once."""
    import threading
    import time

    if rank == 1:
        threading.Thread(target=time.sleep, args=(8,)).start()  # longer than the test's bound
        error = ValueError("boom on rank 1")
        error.uncaught = True  # type: ignore[attr-defined]  # `run` records it, then lets it end the thread
        raise error
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    finally:
        NOTES["waited"] = time.monotonic() - start
    return {}


def reinit(rank: int, world: int) -> dict[str, Any]:
    """init, all_reduce, destroy, three times in the same processes over the same store."""
    sums = []
    for i in range(3):
        if i:
            dist.init_process_group("axonml", timeout=TIMEOUT)
        t = torch.full((2,), float(rank + i))
        dist.all_reduce(t)
        sums.append(float(t[0]))
        if i < 2:
            dist.destroy_process_group()
    return {"sums": sums}


def init_args(rank: int, world: int) -> dict[str, Any]:
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return {"sum": t, "backend": dist.get_backend()}


# What a job saw before it failed, saved with its error.
NOTES: dict[str, Any] = {}
MODES = {
    f.__name__: f
    for f in [collectives, ddp, mismatch, dies, nested, raises, reinit, init_args, profiled, sparse]
    + [group_timeout, group_recv_timeout, monitored_zero]
}
# The facts our errors carry as attributes (see axonml_distributed.exceptions), saved with the error.
FACTS = ("rank", "ranks", "call", "seq", "group", "calls", "waited", "pid", "exit_code", "signal")


def run(rank: int, world: int, modes: list[str], out: str, init: str | None) -> None:
    for mode in modes:
        run_one(rank, world, mode, out, init)


def run_one(rank: int, world: int, mode: str, out: str, init: str | None) -> None:
    NOTES.clear()
    path = os.path.join(out, f"{mode}-rank{rank}.pt")
    try:
        if init is None:
            dist.init_process_group("axonml", timeout=TIMEOUT)
        else:
            backend = "cpu:axonml" if init.startswith("file://") else "axonml"
            dist.init_process_group(
                backend=backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT
            )
        result = MODES[mode](dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    except Exception as e:
        result = {"error": type(e).__name__, "module": type(e).__module__, "message": str(e), **NOTES}
        result["runtime_error"] = isinstance(e, RuntimeError)
        result["facts"] = {k: getattr(e, k) for k in FACTS if hasattr(e, k)}
        if getattr(e, "uncaught", False):
            torch.save(result, path)
            raise
        traceback.print_exc()
        if dist.is_initialized():  # so that the next mode can init
            dist.destroy_process_group()
    torch.save(result, path)


def main() -> None:
    modes, out = sys.argv[1].split(","), sys.argv[2]
    if len(sys.argv) > 3:
        mp.spawn(run, args=(2, modes, out, sys.argv[3]), nprocs=2, join=True)
    else:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), modes, out, None)


if __name__ == "__main__":
    main()
