"""The seed's comm helpers on the default group (spawn makes each rank's group its default)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import axonml_distributed as ad
from reference import data, reduce_ref, same_bits

pytestmark = pytest.mark.timeout(60)


def test_reduce_helpers_match_numpy() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        base = data(pg.rank(), 100, np.float32)
        out = {}
        for name in ["sum", "mean", "min", "max", "product"]:
            x = base.copy()
            getattr(ad, f"all_reduce_{name}")(x)
            out[name] = x
        return out

    ops = {"sum": "SUM", "mean": "AVERAGE", "min": "MIN", "max": "MAX", "product": "PRODUCT"}
    res = ad.spawn(fn, 3)
    for name, op in ops.items():
        want = reduce_ref([data(r, 100, np.float32) for r in range(3)], getattr(ad.ReduceOp, op))
        assert all(same_bits(r[name], want) for r in res), name


def test_broadcast_gather_scatter_helpers() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        me = pg.rank()
        a = np.full(4, me, np.int32)
        ad.broadcast(a)
        b = np.full(4, me, np.int32)
        ad.broadcast_from(b, 2)
        g = ad.all_gather(np.array([me, me], np.int8))
        full = np.arange(24, dtype=np.float64).reshape(4, 6)
        part = ad.scatter_tensor(full, 1, pg)
        back = ad.gather_tensor(part, 1)
        rs = ad.reduce_scatter_sum(np.arange(6, dtype=np.float32) * (me + 1))
        rm = ad.reduce_scatter_mean(np.arange(6, dtype=np.float32) * (me + 1))
        ad.barrier()
        info = (ad.rank(), ad.world_size(), ad.is_main_process())
        return a[0], b[0], g.tolist(), part, back, rs, rm, info

    res = ad.spawn(fn, 3)
    for r, (a, b, g, part, back, rs, rm, info) in enumerate(res):
        assert (a, b) == (0, 2)
        assert g == [[0, 0], [1, 1], [2, 2]]
        full = np.arange(24, dtype=np.float64).reshape(4, 6)
        assert same_bits(part, full[:, 2 * r : 2 * r + 2]) and same_bits(back, full)
        assert rs.tolist() == (np.arange(6, dtype=np.float32)[2 * r : 2 * r + 2] * 6).tolist()
        assert np.allclose(rm, np.arange(6, dtype=np.float32)[2 * r : 2 * r + 2] * 2)
        assert info == (r, 3, r == 0)


def test_gathering_helpers_accept_non_contiguous_input() -> None:
    # They return new arrays, so a strided view or a transpose is fine (as for gather_tensor).
    def fn(pg: ad.ProcessGroup) -> Any:
        me = pg.rank()
        t = (np.arange(12, dtype=np.float32) * (me + 1)).reshape(3, 4)
        g = ad.all_gather(t.T)
        rs = ad.reduce_scatter_sum(t[:, ::2].T)
        rm = ad.reduce_scatter_mean(np.arange(8, dtype=np.float32)[::-2] * (me + 1))
        return g, rs, rm

    res = ad.spawn(fn, 2)
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    sums = base[:, ::2].T * 3
    means = np.arange(8, dtype=np.float32)[::-2] * 1.5
    for r, (g, rs, rm) in enumerate(res):
        assert same_bits(g, np.stack([base.T, base.T * 2]))
        assert same_bits(rs, sums[r : r + 1])
        assert same_bits(rm, means[2 * r : 2 * r + 2])


def test_sync_gradients_averages_each_gradient_in_place() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        grads = [data(pg.rank(), 7, np.float32).reshape(7), data(pg.rank(), 6, np.float64).reshape(2, 3)]
        single = data(pg.rank(), 5, np.float32)
        ad.sync_gradients(grads)
        ad.sync_gradient(single)
        return grads, single

    res = ad.spawn(fn, 2)
    want0 = reduce_ref([data(r, 7, np.float32) for r in range(2)], ad.ReduceOp.AVERAGE)
    want1 = reduce_ref([data(r, 6, np.float64).reshape(2, 3) for r in range(2)], ad.ReduceOp.AVERAGE)
    want2 = reduce_ref([data(r, 5, np.float32) for r in range(2)], ad.ReduceOp.AVERAGE)
    for grads, single in res:
        assert same_bits(grads[0], want0) and same_bits(grads[1], want1) and same_bits(single, want2)


def test_helpers_validate_their_arguments() -> None:
    pg = ad.ProcessGroup(ad.MockBackend.create_world(1)[0])
    with pytest.raises(ValueError, match="divide"):
        ad.scatter_tensor(np.ones(5), 0, ad.ProcessGroup(ad.MockBackend.create_world(2)[0]))
    with pytest.raises(ValueError, match="out of range"):
        ad.gather_tensor(np.ones(5), 3, pg)


def test_without_a_default_group_the_error_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ad.barrier()
