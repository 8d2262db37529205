"""all_to_all_single (torch's alltoall_base) refuses a tensor that is not contiguous, as gloo and nccl do
(c10d's ``ValueError("Tensors must be contiguous")``, which pytorch's test_c10d_common
`test_all_to_all_single` expects), on a group in ascending order and on one in another order, blocking or
not, with or without split sizes; the group stays usable. A tensor dense in another memory format
(channels last) is taken, and exchanged by its values."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import axonml_distributed as ad
from axonml_distributed.torch.group import AxonmlProcessGroup, OrderedProcessGroup
from axonml_distributed.torch.rank_order import RankOrder

WORLD = 2


def _opts(async_op: bool) -> Any:
    o = dist.AllToAllOptions()
    o.asyncOp = async_op
    return o


def on_both_ranks(group: Callable[[Any, int], Any], fn: Callable[[Any, int], Any]) -> list[Any]:
    """`fn(pg, global rank)` on each rank of a thread world, `pg` made by `group(native, rank)`."""
    worlds = ad.ThreadBackend.create_world(WORLD, timeout=30)
    got: list[Any] = [None] * WORLD

    def rank(r: int) -> None:
        try:
            got[r] = fn(group(ad.ProcessGroup(worlds[r]), r), r)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return got


def ascending(native: Any, r: int) -> Any:
    return AxonmlProcessGroup(native, r, WORLD)


def reversed_order(native: Any, r: int) -> Any:
    order = [1, 0]  # torch's group rank i is global rank order[i]
    return OrderedProcessGroup(native, order.index(r), WORLD, RankOrder(order))


def mine(r: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(4, 2) + 10 * r


def refusals(pg: Any, r: int) -> dict[str, Any]:
    """Each non-contiguous form, what it raised; then a contiguous call, its result."""
    out: dict[str, Any] = {}
    forms = {
        "input": lambda: (torch.zeros(4, 2), mine(r).t().contiguous().t(), [], []),
        "output": lambda: (torch.zeros(2, 4).t(), mine(r), [], []),
        "input with splits": lambda: (torch.zeros(4, 2), mine(r).t().contiguous().t(), [2, 2], [2, 2]),
        "output with splits": lambda: (torch.zeros(2, 4).t(), mine(r), [2, 2], [2, 2]),
    }
    assert not forms["input"]()[1].is_contiguous() and not forms["output"]()[0].is_contiguous()
    for name, args in forms.items():
        for async_op in (False, True):
            try:
                pg.alltoall_base(*args(), _opts(async_op))
                out[f"{name} async={async_op}"] = "accepted"
            except ValueError as e:
                out[f"{name} async={async_op}"] = str(e)
    result = torch.zeros(4, 2)
    pg.all_to_all_single(result, mine(r), [], [], _opts(False))
    out["after"] = result
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("group", [ascending, reversed_order])
def test_all_to_all_single_refuses_a_non_contiguous_tensor_as_gloo(group: Callable[[Any, int], Any]) -> None:
    got = on_both_ranks(group, refusals)
    for r, out in enumerate(got):
        assert isinstance(out, dict), out
        for name, what in out.items():
            if name != "after":
                assert what.startswith("Tensors must be contiguous"), (r, name, what)
        # Rank r receives rows 2r and 2r+1 from each rank, in group-rank order.
        peers = [0, 1] if group is ascending else [1, 0]
        want = torch.cat([mine(p)[2 * peers.index(r) : 2 * peers.index(r) + 2] for p in peers])
        assert torch.equal(out["after"], want), (r, out["after"], want)


def channels_last(pg: Any, r: int) -> torch.Tensor:
    x = (torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2) + 100 * r).to(memory_format=torch.channels_last)
    out = torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    pg.alltoall_base(out, x, [], [], _opts(False))
    return out


@pytest.mark.timeout(60)
def test_a_channels_last_tensor_is_exchanged_by_its_values() -> None:
    got = on_both_ranks(ascending, channels_last)
    x = [torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2) + 100 * r for r in range(WORLD)]
    for r, out in enumerate(got):
        assert isinstance(out, torch.Tensor), out
        assert torch.equal(out, torch.stack([x[0][r], x[1][r]])), (r, out)
