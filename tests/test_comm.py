"""The comm helpers on the default group (spawn makes each rank's group its default)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed

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
    pg = ad.ProcessGroup(ad.ThreadBackend.create_world(1)[0])
    with pytest.raises(ValueError, match="divide"):
        ad.scatter_tensor(np.ones(5), 0, ad.ProcessGroup(ad.ThreadBackend.create_world(2)[0]))
    with pytest.raises(ValueError, match="out of range"):
        ad.gather_tensor(np.ones(5), 3, pg)


def test_without_a_default_group_the_error_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ad.barrier()


def test_helpers_take_cpu_torch_tensors_in_place_and_give_back_tensors() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        me = pg.rank()
        out: dict[str, Any] = {}
        for name in ["sum", "mean", "min", "max", "product"]:
            t = torch.from_numpy(data(me, 10, np.float32).copy())
            address = t.data_ptr()
            getattr(ad, f"all_reduce_{name}")(t)
            assert t.data_ptr() == address  # in place, no copy
            out[name] = t.numpy()
        param = torch.nn.Parameter(torch.full((3,), float(me)))  # requires grad: still fine
        ad.broadcast(param)
        b = torch.full((2,), me, dtype=torch.int64)
        ad.broadcast_from(b, 1)
        work = ad.all_reduce_sum(w := torch.ones(4, dtype=torch.float64), async_op=True)
        work.wait()
        returned = {
            "gather": ad.all_gather(torch.tensor([me, me], dtype=torch.int32)),
            "rs_sum": ad.reduce_scatter_sum(torch.arange(4.0) * (me + 1)),
            "rs_mean": ad.reduce_scatter_mean(torch.arange(4.0) * (me + 1)),
            "scatter": ad.scatter_tensor(torch.arange(8.0).reshape(2, 4), 1),
            "gather_dim": ad.gather_tensor(torch.full((2, 1), float(me)), 1),
        }
        grads = [torch.full((3,), me + 1.0), torch.full((2, 2), me + 3.0, dtype=torch.float64)]
        addresses = [g.data_ptr() for g in grads]
        ad.sync_gradients(grads)
        assert [g.data_ptr() for g in grads] == addresses
        single = torch.full((2,), float(me))
        ad.sync_gradient(single)
        return out, param.detach().clone(), b, w, returned, grads, single

    res = ad.spawn(fn, 2)
    for r, (out, param, b, w, returned, grads, single) in enumerate(res):
        for name, op in {
            "sum": "SUM",
            "mean": "AVERAGE",
            "min": "MIN",
            "max": "MAX",
            "product": "PRODUCT",
        }.items():
            want = reduce_ref([data(q, 10, np.float32) for q in range(2)], getattr(ad.ReduceOp, op))
            assert same_bits(out[name], want), name
        assert param.tolist() == [0.0] * 3 and b.tolist() == [1, 1] and w.tolist() == [2.0] * 4
        assert all(isinstance(t, torch.Tensor) for t in returned.values())
        assert returned["gather"].tolist() == [[0, 0], [1, 1]]
        assert returned["rs_sum"].tolist() == [3.0 * (2 * r), 3.0 * (2 * r + 1)]
        assert returned["rs_mean"].tolist() == [1.5 * (2 * r), 1.5 * (2 * r + 1)]
        assert returned["scatter"].tolist() == [[2.0 * r, 2.0 * r + 1], [2.0 * r + 4, 2.0 * r + 5]]
        assert returned["gather_dim"].tolist() == [[0.0, 1.0], [0.0, 1.0]]
        assert grads[0].tolist() == [1.5] * 3 and grads[1].tolist() == [[3.5, 3.5], [3.5, 3.5]]
        assert single.tolist() == [0.5, 0.5]


def test_torch_argument_order_gets_a_type_error_that_names_the_right_call() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        t = torch.full((2,), float(pg.rank()))
        with pytest.raises(TypeError, match=r"broadcast_from\(t, 0\)"):
            ad.broadcast(t, 0)
        with pytest.raises(TypeError, match=r"broadcast_from\(t, 0\)"):
            ad.broadcast(t, src=0)
        with pytest.raises(TypeError, match=r"call out = all_gather\(t, pg\)"):
            ad.all_gather([torch.empty(2), torch.empty(2)], t)  # torch's (tensor_list, tensor)
        for op in (ad.ReduceOp.SUM, torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX):
            with pytest.raises(TypeError, match=r"all_reduce_sum\(t, pg\) takes the process group.*in the"):
                ad.all_reduce_sum(t, op)
        with pytest.raises(TypeError, match=r"all_reduce_max\(t, pg\).*all_reduce_sum/mean/min/max"):
            ad.all_reduce_max(t, "max")
        with pytest.raises(TypeError, match=r"chunk = reduce_scatter_sum\(t, pg\)"):
            ad.reduce_scatter_sum(torch.empty(1), [t, t])  # torch's (output, input_list)
        with pytest.raises(TypeError, match=r"gather_tensor\(t, dim, pg\) takes the dimension second"):
            ad.gather_tensor(t, [torch.empty(2), torch.empty(2)])  # torch's gather(t, gather_list, dst)
        with pytest.raises(TypeError, match=r"scatter_tensor\(t, dim, pg\) takes the dimension second"):
            ad.scatter_tensor(t, [t, t])  # torch's scatter(t, scatter_list, src)
        with pytest.raises(TypeError, match=r"broadcast_from\(t, src, pg\) takes the process group"):
            ad.broadcast_from(t, 0, 1)
        with pytest.raises(TypeError, match=r"barrier\(pg\) takes the process group"):
            ad.barrier(0)
        ad.all_reduce_sum(t)  # the world was not aborted: the ranks go on
        return t.tolist()

    assert ad.spawn(fn, 2) == [[1.0, 1.0], [1.0, 1.0]]


def test_get_rank_and_get_world_size_as_in_torch() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        sub = ad.ProcessGroup.with_ranks(pg.backend(), [1, 2])
        return ad.get_rank(), ad.get_world_size(), ad.get_rank(sub), ad.get_world_size(sub)

    assert ad.spawn(fn, 3) == [(0, 3, -1, 2), (1, 3, 0, 2), (2, 3, 1, 2)]
