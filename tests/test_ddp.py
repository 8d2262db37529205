"""DistributedDataParallel: N ranks x batch B must train exactly like one process on batch N*B."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonml_distributed import spawn
from axonml_distributed._core import ProcessGroup, ReduceOp
from axonml_distributed.ddp import DDP, DistributedDataParallel, assign_buckets

pytestmark = pytest.mark.timeout(120)

D_IN, HIDDEN, D_OUT = 5, 7, 3
STEPS, LR = 20, 0.1
TINY_MB = 1e-9  # smaller than any parameter: one bucket each
HUGE_MB = 1000.0  # everything in one bucket per dtype
TOL: dict[type, tuple[float, float]] = {np.float64: (1e-5, 1e-10), np.float32: (1e-4, 1e-6)}  # rtol, atol


class Param:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.grad: np.ndarray | None = None


class MLP:
    """x -> tanh(x W1 + b1) W2 + b2 with a hand-written backward that accumulates into .grad.

    ``inplace`` models write into the existing gradient arrays; otherwise they replace .grad with new arrays
    each backward (and zero_grad sets None), which DDP must notice in bucket-view mode.
    """

    def __init__(self, seed: int, dtype: type = np.float64, inplace: bool = True) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = Param(rng.normal(0, D_IN**-0.5, (D_IN, HIDDEN)).astype(dtype))
        self.b1 = Param(rng.normal(0, 0.1, HIDDEN).astype(dtype))
        self.w2 = Param(rng.normal(0, HIDDEN**-0.5, (HIDDEN, D_OUT)).astype(dtype))
        self.b2 = Param(rng.normal(0, 0.1, D_OUT).astype(dtype))
        self.inplace = inplace
        self.training = True

    def parameters(self) -> Iterator[Param]:
        return iter([self.w1, self.b1, self.w2, self.b2])

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x
        self._h = np.tanh(x @ self.w1.data + self.b1.data)
        return self._h @ self.w2.data + self.b2.data

    def backward(self, d_out: np.ndarray) -> None:
        d_h = (d_out @ self.w2.data.T) * (1 - self._h**2)
        grads = [self._x.T @ d_h, d_h.sum(0), self._h.T @ d_out, d_out.sum(0)]
        for p, g in zip(self.parameters(), grads, strict=True):
            if p.grad is None:
                p.grad = g
            elif self.inplace:
                p.grad += g
            else:
                p.grad = p.grad + g

    def zero_grad(self) -> None:
        for p in self.parameters():
            if self.inplace and p.grad is not None:
                p.grad.fill(0)
            else:
                p.grad = None

    def sgd(self) -> None:
        for p in self.parameters():
            assert p.grad is not None
            p.data -= LR * p.grad


def batches(n_rows: int, dtype: type, steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(n_rows, D_IN))
        out.append((x.astype(dtype), np.sin(x[:, :D_OUT] * 2).astype(dtype)))
    return out


def mse_grad(out: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (out - y) / len(y)  # d/d_out of mean over the batch of 0.5 * |out - y|^2


def train_single(n_rows: int, dtype: type, micro: int = 1) -> list[np.ndarray]:
    """The reference: one process, seed 0 (rank 0's), the whole batch; ``micro`` batches per step."""
    model = MLP(0, dtype)
    data = batches(n_rows, dtype, STEPS * micro)
    for step in range(STEPS):
        model.zero_grad()
        for x, y in data[step * micro : (step + 1) * micro]:
            model.backward(mse_grad(model.forward(x), y))
        model.sgd()
    return [p.data for p in model.parameters()]


def train_ddp(pg: Any, batch: int, dtype: type, micro: int = 1, **options: Any) -> list[np.ndarray]:
    """One rank: its own init (synced from rank 0), its slice of each global batch, synced SGD."""
    rank, n = pg.rank(), pg.world_size()
    inplace = options.pop("inplace", True)
    model = MLP(rank, dtype, inplace)  # different on every rank: sync_parameters must fix that
    ddp = DDP(model, pg, **options)
    ddp.sync_parameters()
    data = batches(n * batch, dtype, STEPS * micro)
    rows = slice(rank * batch, (rank + 1) * batch)
    for step in range(STEPS):
        model.zero_grad()
        with ddp.no_sync():
            for x, y in data[step * micro : (step + 1) * micro - 1]:
                model.backward(mse_grad(ddp(x[rows]), y[rows]))
                ddp.sync_gradients()  # a no-op in here
        x, y = data[(step + 1) * micro - 1]
        model.backward(mse_grad(ddp(x[rows]), y[rows]))
        ddp.sync_gradients()
        model.sgd()
    return [p.data for p in model.parameters()]


def check_training(results: list[list[np.ndarray]], expected: list[np.ndarray], dtype: type) -> None:
    for rank_params in results:
        for got, want in zip(rank_params, expected, strict=True):
            assert got.dtype == dtype
            rtol, atol = TOL[dtype]
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
        for got, first in zip(rank_params, results[0], strict=True):
            np.testing.assert_array_equal(got, first)  # ranks bitwise identical


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


class CountingGroup:
    """A duck-typed group forwarding to a real one and recording the collectives DDP issues."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.calls: list[tuple[str, Any, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def all_reduce(self, buf: np.ndarray, op: Any = ReduceOp.SUM, *, async_op: bool = False) -> Any:
        self.calls.append(("all_reduce", op, buf.size))
        return self._pg.all_reduce(buf, op, async_op=async_op)

    def broadcast(self, buf: np.ndarray, src: int | None = None, *, async_op: bool = False) -> Any:
        self.calls.append(("broadcast", src, buf.size))
        return self._pg.broadcast(buf, src, async_op=async_op)


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
        return DDP(MLP(0), ProcessGroup.mock(), bucket_cap_mb=cap).bucket_assignment()

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


class Bag:
    """Parameters only: a model whose gradients the test sets by hand."""

    def __init__(self, *arrays: np.ndarray) -> None:
        self.params = [Param(a) for a in arrays]

    def parameters(self) -> Iterator[Param]:
        return iter(self.params)


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


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


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
                assert _address(later) + later.nbytes == _address(earlier)
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


def test_builders_chain_and_switch_gradient_storage() -> None:
    bag = Bag(np.zeros(3), np.zeros(2))
    for p in bag.params:
        p.grad = np.ones(p.data.shape)
    ddp = DDP(bag, ProcessGroup.mock())
    views = [p.grad for p in bag.params]
    assert _address(views[1]) + views[1].nbytes == _address(views[0])  # installed as bucket views
    assert ddp.broadcast_buffers(True).gradient_as_bucket_view(False) is ddp
    copies = [p.grad for p in bag.params]
    assert all(c is not v and not np.shares_memory(c, v) for c, v in zip(copies, views, strict=True))
    ddp.sync_gradients()
    assert all(p.grad is c for p, c in zip(bag.params, copies, strict=True))
    ddp.gradient_as_bucket_view(True)
    assert all(_address(p.grad) == _address(v) for p, v in zip(bag.params, views, strict=True))


def test_delegation_and_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    pg = ProcessGroup.mock()
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


def test_tied_parameters_are_bucketed_once() -> None:
    shared = Param(np.zeros(2))
    shared.grad = np.ones(2)

    class Tied:
        def parameters(self) -> Iterator[Param]:
            return iter([shared, shared])

    ddp = DDP(Tied(), ProcessGroup.mock())
    assert ddp.bucket_assignment() == [[0]]
    ddp.sync_gradients()
    np.testing.assert_array_equal(shared.grad, 1.0)


def test_bad_arguments() -> None:
    pg = ProcessGroup.mock()
    for cap in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            DDP(MLP(0), pg, bucket_cap_mb=cap)
    bag = Bag(np.zeros(3))
    ddp = DDP(bag, pg)
    bag.params[0].grad = np.zeros(4)
    with pytest.raises(ValueError, match="gradient shape"):
        ddp.sync_gradients()


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


def forgetful_loop(pg: Any, steps: int, sync: bool, inplace: bool, zero_first: bool) -> None:
    model = MLP(pg.rank(), inplace=inplace)
    ddp = DDP(model, pg)
    for x, y in batches(2, np.float64, steps):
        if zero_first:
            model.zero_grad()
        out = ddp(x)
        if not zero_first:
            model.zero_grad()
        model.backward(mse_grad(out, y))
        if sync:
            ddp.sync_gradients()
        model.sgd()


# zero_grad() to None before the forward leaves nothing to see at the next forward (no gradient exists,
# as after a checkpoint load); every other order is caught.
@pytest.mark.parametrize(
    ("inplace", "zero_first"),
    [(True, False), (False, False), (True, True)],
    ids=["grads-written", "grads-replaced", "grads-zeroed-before-forward"],
)
def test_a_forgotten_sync_gradients_fails_loudly_at_the_next_training_forward(
    inplace: bool, zero_first: bool
) -> None:
    spawn(forgetful_loop, 2, 3, True, inplace, zero_first)  # the loop with the sync trains
    with pytest.raises(Exception, match=r"never averaged.*ddp\.sync_gradients\(\)") as error:
        spawn(forgetful_loop, 2, 3, False, inplace, zero_first)
    assert isinstance(error.value.__cause__, RuntimeError)


def test_new_weights_between_forwards_are_no_step_without_gradients() -> None:
    # A forward, a checkpoint load, a forward: no gradient exists, so nothing was left unsynced.
    model = MLP(0, inplace=False)
    ddp = DDP(model, ProcessGroup.mock())
    x, y = batches(2, np.float64, 1)[0]
    ddp(x)
    for p in model.parameters():
        p.data = p.data + 1.0
    ddp(x)
    # With gradients (zeros) in place the new weights look like a step; sync_parameters() after the load
    # says they are not.
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.zero_grad()
    ddp(x)
    for p in model.parameters():
        p.data[...] = 0.5
    ddp.sync_parameters()
    ddp(x)
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()


@pytest.mark.parametrize("inplace", [True, False], ids=["grads-written", "grads-replaced"])
def test_forwards_with_nothing_left_to_sync_do_not_raise(inplace: bool) -> None:
    pg = ProcessGroup.mock()
    model = MLP(0, inplace=inplace)
    ddp = DDP(model, pg)
    x, y = batches(2, np.float64, 1)[0]
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.sgd()
    ddp(x)  # a forward with no backward (a metric, say), then zero_grad and the next step
    model.zero_grad()
    ddp(x)
    with ddp.no_sync():  # micro-batches whose gradients stay local on purpose
        for _ in range(2):
            model.backward(mse_grad(ddp(x), y))
    ddp.eval()
    ddp(x)  # evaluation forwards never raise
    ddp.train()
    model.backward(mse_grad(ddp(x), y))
    ddp.sync_gradients()
    model.sgd()
    model.zero_grad()
    model.backward(mse_grad(ddp(x), y))
    with pytest.raises(RuntimeError, match="sync_gradients"):
        ddp(x)  # a backward since the last forward, never synced
    with ddp.no_sync(), pytest.raises(RuntimeError, match="sync_gradients"):
        model.sgd()
        ddp(x)  # and a step on top: inside no_sync() too
