"""Horovod's calls on our groups (thread world): broadcast_parameters, broadcast_optimizer_state and
DistributedOptimizer, against references computed in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import axonml_distributed as ad

pytestmark = pytest.mark.timeout(60)


def _model(seed: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
    g = torch.Generator().manual_seed(seed)  # not torch's global generator: the ranks are threads
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g, dtype=t.dtype) - 0.5)
    return model


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(6, 2, generator=g, dtype=torch.float64)


def test_broadcast_parameters_takes_a_state_dict_named_parameters_or_parameters() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        out = []
        for pick in ("state_dict", "named", "plain"):
            model = _model(pg.rank())
            params = {
                "state_dict": model.state_dict,
                "named": lambda: list(model.named_parameters()),  # noqa: B023
                "plain": model.parameters,
            }[pick]()
            ad.broadcast_parameters(params, root_rank=1)
            out.append({k: v.clone() for k, v in model.state_dict().items()})
        return out

    results = ad.spawn(fn, 3)
    root = _model(1).state_dict()
    for rank in range(3):
        by_dict, by_named, by_params = results[rank]
        for key, value in root.items():
            assert torch.equal(by_dict[key], value), key  # buffers too
            if "running" not in key and "num_batches" not in key:
                assert torch.equal(by_named[key], value) and torch.equal(by_params[key], value), key
    with pytest.raises(TypeError, match="expected tensors"):
        ad.broadcast_parameters({"lr": 0.1}, 0, ad.ProcessGroup(ad.ThreadBackend.single()))


def test_broadcast_optimizer_state_gives_every_rank_the_roots_state() -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        model = _model(0)
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (pg.rank() + 1))
        if pg.rank() == 1:  # only the root has state: its moments and step counts
            for _ in range(2):
                x, y = _data(1)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        ad.broadcast_optimizer_state(opt, root_rank=1)
        return opt.state_dict()

    states = ad.spawn(fn, 2)
    root = states[1]
    for state in states:
        assert state["param_groups"] == root["param_groups"]  # lr 0.02 everywhere
        assert state["state"].keys() == root["state"].keys() and len(root["state"]) == 6
        for i, entry in root["state"].items():
            for key, value in entry.items():
                assert torch.equal(state["state"][i][key], value), (i, key)


def _reference_step(passes: int, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """One process: the average over both ranks of the gradients summed over `passes` backward passes."""
    model = _model(0)
    grads: list[list[torch.Tensor]] = []
    for rank in range(2):
        model.zero_grad()
        for p in range(passes):
            x, y = _data(rank + 10 * p)
            nn.functional.mse_loss(model(x), y).backward()
        grads.append([q.grad.clone() for q in model.parameters()])
    with torch.no_grad():
        for q, g0, g1 in zip(model.parameters(), *grads, strict=True):
            q -= lr * (g0 + g1) / 2
    return _trained(model)


def _trained(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("passes", [1, 2])
def test_distributed_optimizer_averages_gradients_before_the_step(passes: int) -> None:
    def fn(pg: ad.ProcessGroup) -> Any:
        model = _model(0)
        opt = ad.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
        )
        assert isinstance(opt, torch.optim.SGD)
        opt.zero_grad()
        for p in range(passes):
            x, y = _data(pg.rank() + 10 * p)
            nn.functional.mse_loss(model(x), y).backward()
        # The hooks started the reductions during backward; they are still to be waited for.
        started = opt._reducer.in_flight()
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) was called after backward"):
            opt.zero_grad()
        opt.step()
        return started, _trained(model)

    want = _reference_step(passes)
    for started, got in ad.spawn(fn, 2):
        assert started
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12)


def test_distributed_optimizer_errors_and_extras() -> None:
    pg = ad.ProcessGroup(ad.ThreadBackend.single())
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in it"):
        ad.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:2], pg=pg)
    with pytest.raises(ValueError, match="duplicate"):
        ad.DistributedOptimizer(opt, named_parameters=[("a", p) for p in model.parameters()], pg=pg)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        ad.DistributedOptimizer(opt, pg=pg, backward_passes_per_step=0)
    wrapped = ad.DistributedOptimizer(opt, model.named_parameters(), pg)
    sched = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    x, y = _data(0)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1"):
            nn.functional.mse_loss(model(x), y).backward()
        wrapped.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with wrapped.skip_synchronize():
            wrapped.step()
        wrapped.zero_grad()
        sched.step()
    assert wrapped.param_groups[0]["lr"] == pytest.approx(0.025)
