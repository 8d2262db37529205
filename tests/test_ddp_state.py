"""DDP's parameters and buffers follow the first rank (constructor, sync_parameters, subgroups, buffers on
or off); its builders, accessors and argument checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axonml_distributed import spawn
from axonml_distributed._core import ProcessGroup, ThreadBackend
from axonml_distributed.ddp import DDP, DistributedDataParallel
from ddp_models import (
    D_IN,
    MLP,
    Bag,
    Param,
    address,
)

pytestmark = pytest.mark.timeout(120)


def test_sync_parameters_overwrites_in_place_from_the_first_rank() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = MLP(seed=pg.rank())
        before = [p.data for p in model.parameters()]
        DDP(model, pg).sync_parameters()
        assert all(p.data is b for p, b in zip(model.parameters(), before, strict=True))
        return [p.data for p in model.parameters()]

    for params in spawn(rank_fn, 3):
        for got, want in zip(params, MLP(seed=0).parameters(), strict=True):
            np.testing.assert_array_equal(got, want.data)


def test_a_subgroup_syncs_from_its_own_first_rank_and_averages_over_its_members() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray] | None:
        if pg.rank() == 0:
            return None  # not a member: takes part in nothing
        sub = ProcessGroup.with_ranks(pg.backend(), [1, 2])
        model = MLP(seed=pg.rank())
        ddp = DDP(model, sub)
        ddp.sync_parameters()
        for p in model.parameters():
            p.grad = np.full(p.data.shape, float(pg.rank()))
        ddp.sync_gradients()
        return [p.data for p in model.parameters()] + [p.grad for p in model.parameters()]

    _, first, second = spawn(rank_fn, 3)
    assert first is not None and second is not None
    for got, want in zip(first[:4], MLP(seed=1).parameters(), strict=True):
        np.testing.assert_array_equal(got, want.data)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    for grad in first[4:]:
        np.testing.assert_array_equal(grad, 1.5)


class Buffered(MLP):
    """An MLP with buffers of several kinds: a plain array, an object with .data, a bool mask, and a
    non-contiguous (transposed) array."""

    def __init__(self, rank: int) -> None:
        super().__init__(0)
        self.mean = np.full(3, float(rank))
        self.count = Param(np.array([rank], np.int64))
        self.mask = np.array([rank % 2 == 0, True])
        self.table = np.full((3, 2), float(rank)).T

    def buffers(self) -> Iterator[Any]:
        return iter([self.mean, self.count, self.mask, self.table])

    def snapshot(self) -> list[np.ndarray]:
        return [self.mean.copy(), self.count.data.copy(), self.mask.copy(), self.table.copy()]

    def scramble(self, rank: int) -> None:
        self.mean[:] = rank
        self.count.data[:] = rank
        self.mask[0] = rank % 2 == 0
        self.table[:] = rank


def assert_buffers(snapshot: list[np.ndarray], rank: int) -> None:
    np.testing.assert_array_equal(snapshot[0], float(rank))
    np.testing.assert_array_equal(snapshot[1], rank)
    np.testing.assert_array_equal(snapshot[2], [rank % 2 == 0, True])
    np.testing.assert_array_equal(snapshot[3], float(rank))


@pytest.mark.parametrize("how", ["constructor", "builder"])
def test_broadcast_buffers_off_leaves_buffers_alone(how: str) -> None:
    def rank_fn(pg: Any) -> None:
        model = Buffered(pg.rank())
        if how == "constructor":
            ddp = DDP(model, pg, broadcast_buffers=False)
        else:  # the builder comes after the constructor, whose broadcast init_sync=False skips
            ddp = DDP(model, pg, init_sync=False)
            assert ddp.broadcast_buffers(False) is ddp
        ddp.sync_parameters()
        ddp(np.ones((1, D_IN)))
        assert_buffers(model.snapshot(), pg.rank())

    spawn(rank_fn, 2)


def test_broadcast_buffers_on_syncs_at_sync_parameters_and_synced_training_forwards() -> None:
    def rank_fn(pg: Any) -> None:
        rank, x = pg.rank(), np.ones((1, D_IN))
        model = Buffered(rank)
        ddp = DDP(model, pg)
        ddp.sync_parameters()
        assert_buffers(model.snapshot(), 0)
        model.scramble(rank)
        ddp.eval()(x)  # evaluation forwards leave buffers alone
        assert_buffers(model.snapshot(), rank)
        ddp.train()
        with ddp.no_sync():  # so do forwards whose gradients stay local
            ddp(x)
        assert_buffers(model.snapshot(), rank)
        ddp(x)
        assert_buffers(model.snapshot(), 0)

    spawn(rank_fn, 2)


def test_the_constructor_broadcasts_from_the_first_rank() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = Buffered(pg.rank())
        for p in model.parameters():
            p.data[...] = pg.rank()
        DDP(model, pg)  # no sync_parameters() call
        return [p.data for p in model.parameters()] + model.snapshot()

    for arrays in spawn(rank_fn, 2):
        for array in arrays[:4]:
            np.testing.assert_array_equal(array, 0)
        assert_buffers(arrays[4:], 0)


def test_builders_chain_and_switch_gradient_storage() -> None:
    bag = Bag(np.zeros(3), np.zeros(2))
    for p in bag.params:
        p.grad = np.ones(p.data.shape)
    ddp = DDP(bag, ProcessGroup(ThreadBackend.single()))
    views = [p.grad for p in bag.params]
    assert address(views[1]) + views[1].nbytes == address(views[0])  # installed as bucket views
    assert ddp.broadcast_buffers(True).gradient_as_bucket_view(False) is ddp
    copies = [p.grad for p in bag.params]
    assert all(c is not v and not np.shares_memory(c, v) for c, v in zip(copies, views, strict=True))
    ddp.sync_gradients()
    assert all(p.grad is c for p, c in zip(bag.params, copies, strict=True))
    ddp.gradient_as_bucket_view(True)
    assert all(address(p.grad) == address(v) for p, v in zip(bag.params, views, strict=True))


def test_delegation_and_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    pg = ProcessGroup(ThreadBackend.single())
    model = MLP(0)
    ddp = DistributedDataParallel(model, pg)
    assert DDP is DistributedDataParallel
    assert ddp.module is model and ddp.process_group() is pg
    assert list(ddp.parameters()) == list(model.parameters())
    x = np.ones((2, D_IN))
    np.testing.assert_array_equal(ddp(x), model.forward(x))
    np.testing.assert_array_equal(ddp.forward(x), model.forward(x))

    calls: list[str] = []

    class Callable(Bag):
        training = False

        def __call__(self, x: int) -> int:
            return x + 1

        def train(self) -> None:
            calls.append("train")

        def eval(self) -> None:
            calls.append("eval")

    wrapped = DDP(Callable(np.zeros(1)), pg)
    assert not wrapped.is_training() and wrapped(1) == 2
    assert wrapped.train() is wrapped and wrapped.is_training()
    assert wrapped.eval() is wrapped and not wrapped.is_training()
    assert calls == ["train", "eval"]

    monkeypatch.setattr("axonml_distributed.ddp.get_default_group", lambda: pg)
    assert DDP(model).process_group() is pg


def test_bad_arguments() -> None:
    pg = ProcessGroup(ThreadBackend.single())
    for cap in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            DDP(MLP(0), pg, bucket_cap_mb=cap)
    bag = Bag(np.zeros(3))
    ddp = DDP(bag, pg)
    bag.params[0].grad = np.zeros(4)
    with pytest.raises(ValueError, match="gradient shape"):
        ddp.sync_gradients()
