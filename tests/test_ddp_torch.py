"""DistributedDataParallel over a CPU torch.nn.Module (torch is optional: these tests skip without it)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from axonml_distributed import DDP, spawn
from test_ddp import D_IN, D_OUT, HIDDEN, LR, STEPS, TINY_MB, batches, check_training

pytestmark = pytest.mark.timeout(120)


def torch_model(torch: Any, seed: int) -> Any:
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT)
    ).double()
    # Not torch.manual_seed: its generator is global, and the rank threads would race on it.
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.normal(0, 0.5, tuple(p.shape))))
    return model


def torch_train(
    torch: Any, model: Any, ddp: Any, data: list[tuple[np.ndarray, np.ndarray]], micro: int
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()  # set_to_none: autograd then makes fresh gradients, which DDP must notice
        chunk = data[step * micro : (step + 1) * micro]
        for i, (x, y) in enumerate(chunk):
            out = (ddp or model)(torch.from_numpy(x))
            loss = 0.5 * ((out - torch.from_numpy(y)) ** 2).sum(1).mean()
            if ddp is not None and i < len(chunk) - 1:
                with ddp.no_sync():
                    loss.backward()
                    ddp.sync_gradients()
            else:
                loss.backward()
                if ddp is not None:
                    ddp.sync_gradients()
        opt.step()


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_torch_module_trains_like_one_process(view: bool, micro: int) -> None:
    torch = pytest.importorskip("torch")
    batch = 4

    def rank_fn(pg: Any) -> list[np.ndarray]:
        rank = pg.rank()
        model = torch_model(torch, seed=rank)
        ddp = DDP(model, pg, gradient_as_bucket_view=view, bucket_cap_mb=TINY_MB if micro == 2 else 25)
        ddp.sync_parameters()
        data = [
            (x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch])
            for x, y in batches(2 * batch, np.float64, STEPS * micro)
        ]
        torch_train(torch, model, ddp, data, micro)
        return [p.detach().numpy().copy() for p in model.parameters()]

    reference = torch_model(torch, seed=0)
    torch_train(torch, reference, None, batches(2 * batch, np.float64, STEPS * micro), micro)
    check_training(spawn(rank_fn, 2), [p.detach().numpy() for p in reference.parameters()], np.float64)


def test_torch_gradients_are_bucket_views_and_buffers_broadcast() -> None:
    torch = pytest.importorskip("torch")

    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
        model[1].running_mean.fill_(pg.rank())
        model[0].bias.requires_grad_(False)  # frozen: synced as a parameter, never bucketed
        ddp = DDP(model, pg)
        assert ddp.bucket_assignment() == [[3, 2, 0]]
        ddp.sync_parameters()
        assert float(model[1].running_mean.abs().max()) == 0.0  # rank 0's
        ddp(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        ddp.sync_gradients()
        grads = [p.grad for p in model.parameters() if p.requires_grad][::-1]
        for later, earlier in itertools.pairwise(grads):
            assert later.data_ptr() + later.nbytes == earlier.data_ptr()
        assert model[0].bias.grad is None
        return [b.numpy().copy() for b in model.buffers()]

    first, second = spawn(rank_fn, 2)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
