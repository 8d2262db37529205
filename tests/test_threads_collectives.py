"""Every collective, op and dtype on the in-process world, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import axonml_distributed as ad
from reference import DTYPES, OPS, data, reduce_ref, same_bits, valid

pytestmark = pytest.mark.timeout(120)

SIZES = [0, 1, 7, 64, 1023, 3 * 4096 + 3]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_reduce_matches_rank_order_reference(world: int, dtype: type) -> None:
    cases = [(op, n) for op in OPS if valid(op, dtype) for n in SIZES]

    def rank_fn(pg: ad.ProcessGroup) -> list[np.ndarray]:
        out = []
        for op, n in cases:
            x = data(pg.rank(), n, dtype, seed=n)
            pg.all_reduce(x, op)
            out.append(x)
        return out

    results = ad.spawn(rank_fn, world, timeout=60)
    for i, (op, n) in enumerate(cases):
        want = reduce_ref([data(r, n, dtype, seed=n) for r in range(world)], op)
        for r in range(world):
            assert same_bits(results[r][i], want), f"{op} n={n} rank {r}"


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_rooted_and_gathering_collectives(world: int) -> None:
    n = 3 * 4096 + 3

    def rank_fn(pg: ad.ProcessGroup) -> dict[str, object]:
        me = pg.rank()
        root = world - 1
        b = data(me, n, np.float64)
        pg.broadcast(b, root)
        gathered = np.zeros((world, n), np.int32)
        pg.all_gather(data(me, n, np.int32), gathered)
        rs = np.zeros(n, np.float32)
        pg.reduce_scatter(data(me, world * n, np.float32), rs, ad.ReduceOp.MAX)
        red = data(me, n, np.float16)
        pg.reduce(red, root, ad.ReduceOp.SUM)
        g = np.zeros((world, 5), np.uint8) if me == root else None
        pg.gather(data(me, 5, np.uint8), g, root)
        sc = np.zeros(4, np.int64)
        pg.scatter(data(me, world * 4, np.int64) if me == root else None, sc, root)
        return {"b": b, "gathered": gathered, "rs": rs, "red": red, "g": g, "sc": sc}

    res = ad.spawn(rank_fn, world, timeout=60)
    root = world - 1
    full = [data(r, world * n, np.float32) for r in range(world)]
    for r, out in enumerate(res):
        assert same_bits(out["b"], data(root, n, np.float64))
        assert same_bits(out["gathered"], np.stack([data(j, n, np.int32) for j in range(world)]))
        assert same_bits(out["rs"], reduce_ref([f[r * n : (r + 1) * n] for f in full], ad.ReduceOp.MAX))
        if r == root:
            assert same_bits(
                out["red"], reduce_ref([data(j, n, np.float16) for j in range(world)], ad.ReduceOp.SUM)
            )
            assert same_bits(out["g"], np.stack([data(j, 5, np.uint8) for j in range(world)]))
        else:
            assert same_bits(out["red"], data(r, n, np.float16)), "non-root buffers are left unchanged"
        assert same_bits(out["sc"], data(root, world * 4, np.int64)[r * 4 : (r + 1) * 4])


def test_tensor_variants_return_new_arrays_and_leave_inputs() -> None:
    def rank_fn(pg: ad.ProcessGroup) -> tuple[np.ndarray, ...]:
        t = data(pg.rank(), 12, np.float32).reshape(4, 3)
        keep = t.copy()
        s = pg.all_reduce_tensor(t, ad.ReduceOp.SUM)
        b = pg.broadcast_tensor(t, 1)
        g = pg.all_gather_tensor(t)
        rs = pg.reduce_scatter_tensor(t, ad.ReduceOp.SUM)
        assert same_bits(t, keep)
        return s, b, g, rs

    res = ad.spawn(rank_fn, 2, timeout=60)
    inputs = [data(r, 12, np.float32).reshape(4, 3) for r in range(2)]
    total = reduce_ref(inputs, ad.ReduceOp.SUM)
    for r, (s, b, g, rs) in enumerate(res):
        assert same_bits(s, total)
        assert same_bits(b, inputs[1])
        assert g.shape == (2, 4, 3) and same_bits(g, np.stack(inputs))
        assert same_bits(rs, total[2 * r : 2 * r + 2])


def test_nan_propagates_through_min_and_max() -> None:
    def rank_fn(pg: ad.ProcessGroup) -> tuple[np.ndarray, np.ndarray]:
        x = (
            np.array([np.nan, 1.0, 2.0], np.float32)
            if pg.rank() == 0
            else np.array([1.0, np.nan, 0.5], np.float32)
        )
        y = x.copy()
        pg.all_reduce(x, ad.ReduceOp.MIN)
        pg.all_reduce(y, ad.ReduceOp.MAX)
        return x, y

    for x, y in ad.spawn(rank_fn, 2):
        assert np.isnan(x[:2]).all() and x[2] == 0.5
        assert np.isnan(y[:2]).all() and y[2] == 2.0


def test_views_with_offsets_and_multidimensional_arrays() -> None:
    def rank_fn(pg: ad.ProcessGroup) -> np.ndarray:
        base = data(pg.rank(), 4099, np.float32)
        view = base[3:]  # a contiguous view that starts 12 bytes into its buffer
        pg.all_reduce(view, ad.ReduceOp.SUM)
        assert same_bits(base[:3], data(pg.rank(), 4099, np.float32)[:3]), "bytes outside the view untouched"
        return view

    res = ad.spawn(rank_fn, 3)
    want = reduce_ref([data(r, 4099, np.float32)[3:] for r in range(3)], ad.ReduceOp.SUM)
    assert all(same_bits(v, want) for v in res)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 5),
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 10_000),
)
def test_all_reduce_property(world: int, shape: list[int], dtype: type, op: ad.ReduceOp, seed: int) -> None:
    if not valid(op, dtype):
        return
    n = int(np.prod(shape))

    def rank_fn(pg: ad.ProcessGroup) -> np.ndarray:
        x = data(pg.rank(), n, dtype, seed).reshape(shape)
        pg.all_reduce(x, op)
        return x

    want = reduce_ref([data(r, n, dtype, seed).reshape(shape) for r in range(world)], op)
    assert all(same_bits(x, want) for x in ad.spawn(rank_fn, world, timeout=60))
