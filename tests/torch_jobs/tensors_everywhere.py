"""CPU torch tensors through every collective of a group and every comm helper, against torch-computed
references; the same check for the thread world (`check` under `spawn`), the shm world (``shm`` in argv[1],
under ``python -m axonml_distributed.run``) and MPI (``mpi``, under ``mpiexec -n N python -m mpi4py``).

In place means in place: the tensor passed is the one that changes. ``*_tensor`` and the returning helpers
give tensors back. Then `new_group` builds the same subgroup on every backend. Prints "tensors OK on N
ranks" on the first rank.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import axonml_distributed as ad


def _of(rank: int, n: int = 6, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    # Small integers: every reduction of them is exact, so results compare with ==.
    return (torch.arange(n) + 10 * rank).to(dtype)


def _same(got: Any, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), (what, type(got))
    assert got.dtype == want.dtype and torch.equal(got, want), (what, got, want)


def _group_ops(pg: Any) -> None:
    """The group's own methods, in place and returning, blocking and async."""
    ranks, me = pg.ranks(), pg.rank()
    i = pg.group_rank(me)
    every = torch.stack([_of(r) for r in ranks])
    want = {
        "sum": every.sum(0),
        "avg": every.sum(0) / len(ranks),
        "max": every.max(0).values,
        "min": every.min(0).values,
        "product": every.prod(0),
    }
    for name, op in [
        ("sum", ad.ReduceOp.SUM),
        ("avg", ad.ReduceOp.AVG),
        ("avg", "avg"),
        ("avg", "AVERAGE"),
        ("max", "max"),
        ("min", ad.ReduceOp.MIN),
        ("product", ad.ReduceOp.PRODUCT),
    ]:
        t = _of(me)
        assert pg.all_reduce(t, op) is None
        _same(t, want[name], f"all_reduce {op}")
        _same(pg.all_reduce_tensor(_of(me), op), want[name], f"all_reduce_tensor {op}")
    param = torch.nn.Parameter(_of(me))  # requires grad: used through its memory all the same
    pg.all_reduce(param, ad.ReduceOp.AVG)
    _same(param.detach(), want["avg"], "all_reduce of a Parameter")
    work = pg.all_reduce(t := _of(me), ad.ReduceOp.SUM, async_op=True)
    work.wait()
    _same(t, want["sum"], "async all_reduce")
    _same(pg.all_reduce_tensor(_of(me), "sum", async_op=True).wait(), want["sum"], "async all_reduce_tensor")

    src = ranks[-1]
    pg.broadcast(t := _of(me), src)
    _same(t, _of(src), "broadcast")
    _same(pg.broadcast_tensor(_of(me)), _of(ranks[0]), "broadcast_tensor")

    recv = torch.empty(len(ranks) * 6, dtype=torch.float64)
    pg.all_gather(_of(me), recv)
    _same(recv, every.reshape(-1), "all_gather")
    _same(pg.all_gather_tensor(_of(me)), every, "all_gather_tensor")

    chunks = torch.stack([_of(r, 4 * len(ranks)) for r in ranks])
    total = chunks.sum(0)
    out = torch.empty(4, dtype=torch.float64)
    pg.reduce_scatter(_of(me, 4 * len(ranks)), out, ad.ReduceOp.SUM)
    _same(out, total[4 * i : 4 * i + 4], "reduce_scatter")
    _same(
        pg.reduce_scatter_tensor(_of(me, 4 * len(ranks)), "avg"),
        (total / len(ranks))[4 * i : 4 * i + 4],
        "reduce_scatter_tensor",
    )

    dst = ranks[0]
    gathered = torch.empty(len(ranks) * 6, dtype=torch.float64) if me == dst else None
    pg.gather(_of(me), gathered, dst)
    if gathered is not None:
        _same(gathered, every.reshape(-1), "gather")
    scattered = torch.empty(6, dtype=torch.float64)
    pg.scatter(every.reshape(-1).clone() if me == dst else None, scattered, dst)
    _same(scattered, _of(me), "scatter")
    pg.reduce(t := _of(me), dst, ad.ReduceOp.SUM)
    _same(t, want["sum"] if me == dst else _of(me), "reduce")

    if len(ranks) > 1:
        peer = ranks[(i + 1) % len(ranks)]
        left = ranks[(i - 1) % len(ranks)]
        if i % 2 == 0:
            pg.send(_of(me), peer, 3)
            pg.recv(got := torch.empty(6, dtype=torch.float64), left, 3)
        else:
            pg.recv(got := torch.empty(6, dtype=torch.float64), left, 3)
            pg.send(_of(me), peer, 3)
        _same(got, _of(left), "send/recv")
    pg.barrier()


def _helpers(pg: Any) -> None:
    """The comm helpers, on the default group (None) as a torch script calls them."""
    ranks, me = pg.ranks(), pg.rank()
    n, i = len(ranks), pg.group_rank(me)
    every = torch.stack([_of(r) for r in ranks])
    for helper, want in [
        (ad.all_reduce_sum, every.sum(0)),
        (ad.all_reduce_mean, every.sum(0) / n),
        (ad.all_reduce_max, every.max(0).values),
        (ad.all_reduce_min, every.min(0).values),
        (ad.all_reduce_product, every.prod(0)),
        (ad.sync_gradient, every.sum(0) / n),
    ]:
        assert helper(t := _of(me)) is None
        _same(t, want, helper.__name__)
    ad.all_reduce_sum(t := _of(me), async_op=True).wait()
    _same(t, every.sum(0), "async all_reduce_sum")
    ad.broadcast(t := _of(me))
    _same(t, _of(ranks[0]), "broadcast")
    ad.broadcast_from(t := _of(me), ranks[-1])
    _same(t, _of(ranks[-1]), "broadcast_from")
    _same(ad.all_gather(_of(me)), every, "all_gather")
    chunks = torch.stack([_of(r, 2 * n) for r in ranks]).sum(0)
    _same(ad.reduce_scatter_sum(_of(me, 2 * n)), chunks[2 * i : 2 * i + 2], "reduce_scatter_sum")
    _same(ad.reduce_scatter_mean(_of(me, 2 * n)), (chunks / n)[2 * i : 2 * i + 2], "reduce_scatter_mean")
    whole = torch.arange(4.0 * n).reshape(2, 2 * n)
    part = ad.scatter_tensor(whole, 1)
    _same(part, whole[:, 2 * i : 2 * i + 2], "scatter_tensor")
    _same(ad.gather_tensor(part, 1), whole, "gather_tensor")
    grads = [_of(me, 3), _of(me, 4, torch.float32).reshape(2, 2)]
    ad.sync_gradients(grads)
    _same(grads[0], torch.stack([_of(r, 3) for r in ranks]).mean(0), "sync_gradients float64")
    _same(grads[1], torch.stack([_of(r, 4, torch.float32) for r in ranks]).mean(0).reshape(2, 2), "float32")
    assert ad.get_rank() == i and ad.get_world_size() == n


def _subgroup(pg: Any) -> None:
    """`new_group(ranks)`: the same call on every backend, every rank calling it; ranks are global."""
    ranks, me = pg.ranks(), pg.rank()
    evens = ranks[::2]
    sub = ad.new_group(evens)
    assert sub.ranks() == evens and sub.contains(me) == (me in evens)
    if me in evens:
        sub.all_reduce(t := _of(me), ad.ReduceOp.SUM)
        _same(t, torch.stack([_of(r) for r in evens]).sum(0), "new_group all_reduce")
        ad.broadcast(t := _of(me), sub)
        _same(t, _of(evens[0]), "broadcast on the subgroup")
    odds = ranks[1::2]
    if odds:  # called on the evens' group, by every rank, member of it or not: the same group
        other = ad.new_group(odds, sub)
        assert other.ranks() == odds
        if me in odds:
            other.all_reduce(t := _of(me), "sum")
            _same(t, torch.stack([_of(r) for r in odds]).sum(0), "new_group from another group")
    explicit = ad.new_group(list(reversed(ranks)), pg)  # sorted, as every group's ranks are
    assert explicit.ranks() == ranks
    explicit.all_reduce(t := _of(me), "avg")
    _same(t, torch.stack([_of(r) for r in ranks]).mean(0), "new_group over the whole group")
    pg.barrier()


def check(pg: Any) -> None:
    _group_ops(pg)
    _helpers(pg)
    _subgroup(pg)


def main() -> None:
    pg = ad.init_process_group(sys.argv[1], timeout=60)
    check(pg)
    if pg.rank() == pg.ranks()[0]:
        print(f"tensors OK on {pg.size()} ranks", flush=True)
    ad.destroy_process_group()


if __name__ == "__main__":
    main()
