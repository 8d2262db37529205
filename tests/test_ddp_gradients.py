"""Where DDP keeps gradients: views into the buckets or separate arrays, replaced or None gradients, tied
parameters bucketed once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axonml_distributed import spawn
from axonml_distributed._core import ProcessGroup, ThreadBackend
from axonml_distributed.ddp import DDP
from ddp_models import (
    Bag,
    Param,
    address,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_gradient_storage_modes(view: bool) -> None:
    def rank_fn(pg: Any) -> None:
        bag = Bag(np.zeros(3), np.zeros((2, 2)), np.zeros(5))
        for p in bag.params:
            p.grad = np.full(p.data.shape, float(pg.rank()))
        own = [p.grad for p in bag.params]
        DDP(bag, pg, gradient_as_bucket_view=view).sync_gradients()
        grads = [p.grad for p in bag.params]
        for g in grads:
            np.testing.assert_array_equal(g, 0.5)
        if view:
            # One flat bucket, parameters laid out last to first, each gradient a view into it.
            assert all(g is not o for g, o in zip(grads, own, strict=True))
            for later, earlier in itertools.pairwise(grads[::-1]):
                assert address(later) + later.nbytes == address(earlier)
        else:
            assert all(g is o for g, o in zip(grads, own, strict=True))  # averaged in place

    spawn(rank_fn, 2)


def test_a_replaced_gradient_is_noticed_and_the_view_reinstalled() -> None:
    def rank_fn(pg: Any) -> None:
        bag = Bag(np.zeros(4), np.zeros(2))
        for p in bag.params:
            p.grad = np.zeros(p.data.shape)
        ddp = DDP(bag, pg)
        views = [p.grad for p in bag.params]
        bag.params[0].grad = np.full(4, pg.rank() * 2.0)  # replaced, not written into
        assert bag.params[1].grad is not None
        bag.params[1].grad += pg.rank() * 4.0  # written into the view
        ddp.sync_gradients()
        np.testing.assert_array_equal(bag.params[0].grad, 1.0)
        np.testing.assert_array_equal(bag.params[1].grad, 2.0)
        assert [p.grad is v for p, v in zip(bag.params, views, strict=True)] == [True, True]

    spawn(rank_fn, 2)


@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_none_gradients(view: bool) -> None:
    def rank_fn(pg: Any) -> list[list[np.ndarray | None]]:
        rank = pg.rank()
        bag = Bag(np.zeros(2), np.zeros(2), np.zeros(2))
        ddp = DDP(bag, pg, gradient_as_bucket_view=view)
        seen = []
        # Step 1: param 0 everywhere, param 1 on rank 1 only (zeros on rank 0), param 2 nowhere.
        bag.params[0].grad = np.full(2, rank + 1.0)
        bag.params[1].grad = np.full(2, 4.0) if rank == 1 else None
        ddp.sync_gradients()
        seen.append([p.grad if p.grad is None else p.grad.copy() for p in bag.params])
        # Step 2: everything dropped; the buckets still hold step 1's averages, which must not leak back.
        for p in bag.params:
            p.grad = None
        bag.params[1].grad = np.full(2, 6.0) if rank == 0 else None
        ddp.sync_gradients()
        seen.append([p.grad if p.grad is None else p.grad.copy() for p in bag.params])
        return seen

    for step1, step2 in spawn(rank_fn, 2):
        np.testing.assert_array_equal(step1[0], 1.5)
        np.testing.assert_array_equal(step1[1], 2.0)
        assert step1[2] is None
        assert step2[0] is None and step2[2] is None
        np.testing.assert_array_equal(step2[1], 3.0)


def test_tied_parameters_are_bucketed_once() -> None:
    shared = Param(np.zeros(2))
    shared.grad = np.ones(2)

    class Tied:
        def parameters(self) -> Iterator[Param]:
            return iter([shared, shared])

    ddp = DDP(Tied(), ProcessGroup(ThreadBackend.single()))
    assert ddp.bucket_assignment() == [[0]]
    ddp.sync_gradients()
    np.testing.assert_array_equal(shared.grad, 1.0)
