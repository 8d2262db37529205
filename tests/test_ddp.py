"""DistributedDataParallel: N ranks x batch B must train exactly like one process on batch N*B, whatever
the bucketing; one all-reduce per bucket; no_sync accumulates locally."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonml_distributed import spawn
from axonml_distributed._core import ProcessGroup, ThreadBackend, assign_buckets
from axonml_distributed.ddp import DDP
from ddp_models import (
    D_IN,
    D_OUT,
    HUGE_MB,
    MLP,
    TINY_MB,
    Bag,
    CountingGroup,
    check_training,
    mse_grad,
    train_ddp,
    train_single,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_n_ranks_train_like_one_process_on_the_whole_batch(world: int, dtype: type) -> None:
    batch = 6
    results = spawn(train_ddp, world, batch, dtype)
    check_training(results, train_single(world * batch, dtype), dtype)


@pytest.mark.parametrize("inplace", [True, False], ids=["grads-written", "grads-replaced"])
@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
@pytest.mark.parametrize("cap", [TINY_MB, 0.0003, HUGE_MB], ids=["bucket-per-param", "mixed", "one-bucket"])
def test_bucketing_and_gradient_modes_do_not_change_the_result(cap: float, view: bool, inplace: bool) -> None:
    options = {"bucket_cap_mb": cap, "gradient_as_bucket_view": view, "inplace": inplace}
    results = spawn(functools.partial(train_ddp, **options), 2, 4, np.float64)
    check_training(results, train_single(8, np.float64), np.float64)


@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
@pytest.mark.parametrize("inplace", [True, False], ids=["grads-written", "grads-replaced"])
def test_no_sync_accumulates_then_averages_the_total(inplace: bool, view: bool) -> None:
    micro = 3
    train = functools.partial(train_ddp, inplace=inplace, gradient_as_bucket_view=view)
    results = spawn(train, 2, 3, np.float64, micro)
    check_training(results, train_single(6, np.float64, micro), np.float64)


def test_no_sync_keeps_gradients_local_and_issues_no_collective() -> None:
    def rank_fn(pg: Any) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        group = CountingGroup(pg)
        model = MLP(0)
        ddp = DDP(model, group)
        group.calls.clear()  # the constructor's broadcast
        x = np.full((2, D_IN), pg.rank() + 1.0)
        with ddp.no_sync():
            model.backward(mse_grad(ddp(x), np.zeros((2, D_OUT))))
            ddp.sync_gradients()
        inside = [p.grad.copy() for p in model.parameters()]
        silent = len(group.calls)
        ddp.sync_gradients()
        return inside, [p.grad.copy() for p in model.parameters()], silent

    (local0, synced0, silent0), (local1, synced1, _) = spawn(rank_fn, 2)
    assert silent0 == 0
    assert not np.array_equal(local0[0], local1[0])
    for a, b, s0, s1 in zip(local0, local1, synced0, synced1, strict=True):
        np.testing.assert_allclose(s0, (a + b) / 2, rtol=1e-12)
        np.testing.assert_array_equal(s0, s1)


def test_one_all_reduce_per_bucket_plus_one_tiny_flag_vector() -> None:
    def rank_fn(pg: Any) -> list[tuple[str, Any, int]]:
        group = CountingGroup(pg)
        model = MLP(0)
        ddp = DDP(model, group, bucket_cap_mb=TINY_MB)
        group.calls.clear()  # the constructor's broadcast
        model.backward(mse_grad(ddp(np.ones((2, D_IN))), np.zeros((2, D_OUT))))  # no buffers: no collective
        ddp.sync_gradients()
        return group.calls

    calls = spawn(rank_fn, 2)[0]
    sizes = [p.data.size for p in MLP(0).parameters()]
    assert [c[0] for c in calls] == ["all_reduce"] * 5
    assert calls[0][2] == 4  # one uint8 flag per parameter
    assert [c[2] for c in calls[1:]] == sizes[::-1]  # buckets in reverse parameter order


def test_bucket_layout_follows_reverse_order_cap_and_dtype() -> None:
    def layout(cap: float) -> list[list[int]]:
        return DDP(MLP(0), ProcessGroup(ThreadBackend.single()), bucket_cap_mb=cap).bucket_assignment()

    assert layout(TINY_MB) == [[3], [2], [1], [0]]
    assert layout(HUGE_MB) == [[3, 2, 1, 0]]
    _, b1, w2, b2 = (p.data.nbytes for p in MLP(0).parameters())
    assert layout((b2 + w2) / 2**20) == [[3, 2], [1], [0]]
    assert layout((b2 + w2 + b1) / 2**20) == [[3, 2, 1], [0]]
    assert assign_buckets([8, 4, 8, 4], [np.dtype("f8"), np.dtype("f4")] * 2, 1 << 20) == [[3, 1], [2, 0]]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 100), st.sampled_from(["f2", "f4", "f8"])), max_size=30),
    st.integers(1, 400),
)
def test_assign_buckets_properties(params: list[tuple[int, str]], cap: int) -> None:
    dtypes = [np.dtype(d) for _, d in params]
    nbytes = [n * dt.itemsize for (n, _), dt in zip(params, dtypes, strict=True)]
    buckets = assign_buckets(nbytes, dtypes, cap)
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    assert [b[0] for b in buckets] == sorted((b[0] for b in buckets), reverse=True)
    for b in buckets:
        assert b == sorted(b, reverse=True)
        assert len({dtypes[i] for i in b}) == 1
        assert len(b) == 1 or sum(nbytes[i] for i in b) <= cap


def test_mixed_dtypes_average_in_their_own_buckets() -> None:
    def rank_fn(pg: Any) -> tuple[list[list[int]], list[np.ndarray]]:
        bag = Bag(np.zeros(3), np.zeros(2, np.float32), np.zeros((2, 2)), np.zeros(1, np.float32))
        for p in bag.params:
            p.grad = np.full(p.data.shape, pg.rank() + 1.0, p.data.dtype)
        ddp = DDP(bag, pg)
        ddp.sync_gradients()
        return ddp.bucket_assignment(), [p.grad for p in bag.params]

    for layout, grads in spawn(rank_fn, 2):
        assert layout == [[3, 1], [2, 0]]
        for g, p_dtype in zip(grads, ["f8", "f4", "f8", "f4"], strict=True):
            assert g.dtype == np.dtype(p_dtype)
            np.testing.assert_array_equal(g, 1.5)
