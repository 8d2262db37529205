"""A group whose members torch orders otherwise than by ascending global rank (`new_group(ranks,
sort_ranks=False)`, pytorch's test_c10d_common `test_new_group_ordered`): torch's group rank of a member is
its place in the ranks given, and every call that depends on the order follows it. Each such call runs on
an "axonml" group and on a gloo group of the same ranks in the same order, in the same job, and their
results must be identical (a reversed, a shuffled and a partial order at 4 ranks, a reversed one at 2);
what gloo lacks is checked against a reference computed here from the inputs."""

from __future__ import annotations

import io
import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist

import axonml_distributed.torch  # noqa: F401 (registers the backend)

pytestmark = pytest.mark.timeout(120)

# Per world size, the orders of the groups tried: reversed, shuffled, and a part of the world.
ORDERS = {2: [[1, 0]], 4: [[3, 2, 1, 0], [2, 0, 3, 1], [3, 1]]}


def _rank(fn: Callable[[int, int], Any], rank: int, size: int, store: str, results: Any) -> None:
    try:
        dist.init_process_group("axonml", store=dist.FileStore(store, size), rank=rank, world_size=size)
        # As bytes: a tensor put on the queue as itself is shared through a file descriptor that this
        # process serves, and it exits before the parent reads it.
        buffer = io.BytesIO()
        torch.save(fn(rank, size), buffer)
        results.put((rank, buffer.getvalue()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))
    results.close()
    results.join_thread()  # the put is sent by a thread, which os._exit would not wait for
    os._exit(0)


def ranks(size: int, fn: Callable[[int, int], Any]) -> list[Any]:
    """`fn(rank, size)` on each of `size` ranks of an "axonml" default group, forked from this process."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    directory = tempfile.mkdtemp(prefix="torch_group_order_")
    store = os.path.join(directory, "store")
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs = [context.Process(target=_rank, args=(fn, r, size, store, results)) for r in range(size)]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=90) for _ in procs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            if p.pid is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        shutil.rmtree(directory, ignore_errors=True)
    return [got[r] if isinstance(got[r], str) else torch.load(io.BytesIO(got[r])) for r in range(size)]


def x(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    """Global rank `rank`'s input (`salt` tells several apart): integer values, distinct per rank, so sums
    are exact in any order."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000 * rank + 100 * salt).view(shape)


def split(s: int, p: int) -> int:
    """How many rows group rank `s` sends group rank `p` in all_to_all (not symmetric in s and p)."""
    return 1 + (2 * s + 3 * p) % 4


def _each_call(g: Any) -> dict[str, Callable[[], Any]]:
    """Every call whose result depends on the members' order, on group `g`, by name: each returns what
    this rank got (tensors, lists of them, ranks)."""
    n, me, mine = g.size(), dist.get_rank(g), dist.get_rank()
    glob = partial(dist.get_global_rank, g)
    calls: dict[str, Callable[[], Any]] = {}

    def ranks_of() -> Any:
        return me, g.rank(), g.size(), dist.get_process_group_ranks(g)

    calls["group rank, rank, size, ranks"] = ranks_of

    for root in range(n):

        def broadcast(root: int = root) -> Any:
            t = x(mine, 3)
            dist.broadcast(t, glob(root), group=g)
            return t

        def reduce(root: int = root) -> Any:
            t = x(mine, 3)
            dist.reduce(t, glob(root), group=g)
            return t if me == root else None  # gloo leaves its scratch in the others' tensors

        def gather(root: int = root) -> Any:
            outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)] if me == root else None
            dist.gather(x(mine, 3), outs, glob(root), group=g)
            return outs

        def gather_into_tensor(root: int = root) -> Any:
            out = torch.zeros(n * 3, dtype=torch.float64) if me == root else None
            dist.gather_into_tensor(x(mine, 3), out, glob(root), group=g)
            return out

        def scatter(root: int = root) -> Any:
            out = torch.zeros(3, dtype=torch.float64)
            ins = [x(mine, 3, salt=i) for i in range(n)] if me == root else None
            dist.scatter(out, ins, glob(root), group=g)
            return out

        for call in (broadcast, reduce, gather, gather_into_tensor, scatter):
            calls[f"{call.__name__} from group rank {root}"] = call

    def all_gather() -> Any:
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(outs, x(mine, 3), group=g)
        return outs

    def all_gather_uneven() -> Any:  # gloo needs equal sizes
        outs = [torch.zeros(i + 1, dtype=torch.float64) for i in range(n)]
        dist.all_gather(outs, x(mine, me + 1), group=g)
        return outs

    def all_gather_async_future() -> Any:
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
        work = dist.all_gather(outs, x(mine, 3), group=g, async_op=True)
        assert work is not None
        return work.get_future().wait()  # the output list, as gloo's future holds it

    def gather_async_future() -> Any:
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)] if me == 0 else None
        work = dist.gather(x(mine, 3), outs, glob(0), group=g, async_op=True)
        assert work is not None
        return work.get_future().wait()

    def all_gather_coalesced() -> Any:
        outs = [[torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)] for _ in range(n)]
        dist.all_gather_coalesced(outs, [x(mine, 2), x(mine, 3, salt=1)], group=g)
        return outs

    def all_gather_into_tensor() -> Any:
        out = torch.zeros(n * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(out, x(mine, 3), group=g)
        return out

    def all_gather_into_tensor_stacked() -> Any:  # gloo takes only the flat output
        out = torch.zeros(n, 3, dtype=torch.float64)
        dist.all_gather_into_tensor(out, x(mine, 3), group=g)
        return out

    def all_gather_into_tensor_coalesced() -> Any:
        outs = [torch.zeros(n * 2, dtype=torch.float64), torch.zeros(n * 3, dtype=torch.float64)]
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], x(mine, 2), group=g)
            dist.all_gather_into_tensor(outs[1], x(mine, 3, salt=1), group=g)
        cm.wait()
        return outs

    def reduce_scatter() -> Any:
        out = torch.zeros(3, dtype=torch.float64)
        dist.reduce_scatter(out, [x(mine, 3, salt=i) for i in range(n)], group=g)
        return out

    def reduce_scatter_tensor() -> Any:
        out = torch.zeros(3, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, x(mine, n * 3), group=g)
        return out

    def reduce_scatter_tensor_coalesced() -> Any:
        outs = [torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            dist.reduce_scatter_tensor(outs[0], x(mine, n * 2), group=g)
            dist.reduce_scatter_tensor(outs[1], x(mine, n * 3, salt=1), group=g)
        cm.wait()
        return outs

    def all_to_all_single() -> Any:
        out = torch.zeros(n * 2, 2, dtype=torch.float64)
        dist.all_to_all_single(out, x(mine, n * 2, 2), group=g)
        return out

    def all_to_all_single_splits() -> Any:
        sends, receives = [split(me, p) for p in range(n)], [split(s, me) for s in range(n)]
        out = torch.zeros(sum(receives), 2, dtype=torch.float64)
        dist.all_to_all_single(out, x(mine, sum(sends), 2), receives, sends, group=g)
        return out

    def all_to_all() -> Any:
        outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
        dist.all_to_all(outs, [x(mine, 3, salt=p) for p in range(n)], group=g)
        return outs

    def all_to_all_uneven() -> Any:  # gloo needs equal sizes
        outs = [torch.zeros(split(s, me), dtype=torch.float64) for s in range(n)]
        dist.all_to_all(outs, [x(mine, split(me, p), salt=p) for p in range(n)], group=g)
        return outs

    def send_recv() -> Any:
        """A ring in group-rank order: each sends the next one, receives from the one before."""
        got = torch.zeros(3, dtype=torch.float64)
        works = [
            dist.isend(x(mine, 3), glob((me + 1) % n), group=g),
            dist.irecv(got, glob((me - 1) % n), group=g),
        ]
        for w in works:
            assert w is not None
            w.wait()
        return got

    def batch_isend_irecv() -> Any:
        """The ring the other way round, in one batch."""
        got = torch.zeros(3, dtype=torch.float64)
        ops = [
            dist.P2POp(dist.isend, x(mine, 3, salt=1), glob((me - 1) % n), group=g),
            dist.P2POp(dist.irecv, got, glob((me + 1) % n), group=g),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got

    def recv_any_source() -> Any:
        """Group rank 0 receives from any source; the last group rank alone sends: the source reported is
        its global rank."""
        if me == 0:
            t = torch.zeros(1, dtype=torch.float64)
            return dist.recv(t, group=g), t
        if me == n - 1:
            dist.send(torch.tensor([float(mine)], dtype=torch.float64), glob(0), group=g)
        return None

    def all_gather_object() -> Any:
        objects: list[Any] = [None] * n
        dist.all_gather_object(objects, ("global rank", mine), group=g)
        return objects

    for each in (
        all_gather,
        all_gather_uneven,
        all_gather_async_future,
        gather_async_future,
        all_gather_coalesced,
        all_gather_into_tensor,
        all_gather_into_tensor_stacked,
        all_gather_into_tensor_coalesced,
        reduce_scatter,
        reduce_scatter_tensor,
        reduce_scatter_tensor_coalesced,
        all_to_all_single,
        all_to_all_single_splits,
        all_to_all,
        all_to_all_uneven,
        send_recv,
        batch_isend_irecv,
        recv_any_source,
        all_gather_object,
    ):
        calls[each.__name__] = each
    return calls


def _outcome(call: Callable[[], Any]) -> Any:
    """The call's result, or its error's type and first line."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - compared across backends
        return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def in_both(rank: int, size: int) -> dict[str, Any]:
    """For each order: the calls on an "axonml" group and on a gloo group of the same ranks and order."""
    out: dict[str, Any] = {}
    for order in ORDERS[size]:
        ours = dist.new_group(order, sort_ranks=False)
        gloo = dist.new_group(order, backend="gloo", sort_ranks=False)
        if rank not in order:
            continue
        assert isinstance(ours, dist.ProcessGroup) and isinstance(gloo, dist.ProcessGroup)
        assert dist.get_backend(ours) == "axonml" and dist.get_backend(gloo) == "gloo"
        for backend, g in (("axonml", ours), ("gloo", gloo)):
            for name, call in _each_call(g).items():
                out[f"{order} {backend} {name}"] = _outcome(call)
                dist.barrier(g)  # a failed call on one rank leaves no call of another behind
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(i, j) for i, j in zip(a, b, strict=True))
    return bool(a == b)


# What gloo refuses (sizes or shapes it does not take, a call it lacks): compared with `reference` alone.
GLOO_LACKS = (
    "gather_into_tensor",
    "all_gather_uneven",
    "all_gather_into_tensor_stacked",
    "all_to_all_uneven",
)


def reference(order: list[int], rank: int, name: str) -> Any:
    """What global rank `rank` of a group of `order` gets from call `name`, from the inputs: for what gloo
    lacks, and for a few more as a check of the comparison itself."""
    n, me = len(order), order.index(rank)
    if name == "group rank, rank, size, ranks":
        return me, me, n, order
    if name.startswith("gather_into_tensor from group rank "):
        root = int(name.rsplit(" ", 1)[1])
        return torch.cat([x(r, 3) for r in order]) if me == root else None
    if name == "all_gather":
        return [x(r, 3) for r in order]
    if name == "all_gather_uneven":
        return [x(r, i + 1) for i, r in enumerate(order)]
    if name == "all_gather_into_tensor_stacked":
        return torch.stack([x(r, 3) for r in order])
    if name == "reduce_scatter":
        return sum(x(r, 3, salt=me) for r in order)
    if name == "reduce_scatter_tensor":
        return sum(x(r, n * 3)[me * 3 : me * 3 + 3] for r in order)
    if name == "all_to_all_single_splits":
        rows = []
        for s, r in enumerate(order):
            start = sum(split(s, p) for p in range(me))
            rows.append(x(r, sum(split(s, p) for p in range(n)), 2)[start : start + split(s, me)])
        return torch.cat(rows)
    if name == "all_to_all_uneven":
        return [x(r, split(s, me), salt=me) for s, r in enumerate(order)]
    if name == "recv_any_source":
        return (order[-1], torch.tensor([float(order[-1])], dtype=torch.float64)) if me == 0 else None
    return NotImplemented


@pytest.mark.parametrize("size", sorted(ORDERS))
def test_every_order_sensitive_call_follows_torchs_order_as_on_gloo(size: int) -> None:
    results = ranks(size, in_both)
    for rank, got in enumerate(results):
        assert isinstance(got, dict), got  # else the rank's traceback
        for order in ORDERS[size]:
            names = [k.split(" axonml ", 1)[1] for k in got if k.startswith(f"{order} axonml ")]
            # The group's ranks, five calls from each root, nineteen others; none on a non-member.
            assert len(names) == (1 + 5 * len(order) + 19 if rank in order else 0), (order, names)
            for name in names:
                ours, gloo = got[f"{order} axonml {name}"], got[f"{order} gloo {name}"]
                where = (order, rank, name)
                assert not (isinstance(ours, str) and ours.startswith("raised")), (where, ours)
                want = reference(order, rank, name)
                if name.startswith(GLOO_LACKS):
                    assert isinstance(gloo, str) and gloo.startswith("raised"), (where, gloo)
                    assert want is not NotImplemented, where
                else:
                    assert same(ours, gloo), (where, ours, gloo)
                if want is not NotImplemented:
                    assert same(ours, want), (where, ours, want)
