"""DistributedDataParallel over a CPU torch.nn.Module: a torch module itself, which broadcasts in its
constructor and averages gradients inside backward(), as torch's DDP does."""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
from typing import Any

import numpy as np
import pytest
import torch

from axonml_distributed import DDP, DistributedDataParallel, ProcessGroup, ReduceOp, ThreadBackend, spawn
from axonml_distributed.ddp_torch import TorchDistributedDataParallel
from ddp_models import D_IN, D_OUT, HIDDEN, LR, STEPS, TINY_MB, batches, check_training

pytestmark = pytest.mark.timeout(120)


def torch_model(seed: int) -> Any:
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT)
    ).double()
    # Not torch.manual_seed: its generator is global, and the rank threads would race on it.
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.normal(0, 0.5, tuple(p.shape))))
    return model


def loss_of(out: Any, y: np.ndarray) -> Any:
    return 0.5 * ((out - torch.from_numpy(y)) ** 2).sum(1).mean()


def torch_train(
    model: Any, ddp: Any, data: list[tuple[np.ndarray, np.ndarray]], micro: int, style: str
) -> None:
    """``explicit``: the explicit-sync loop (backward in no_sync, sync_gradients after each backward);
    ``torch``: torch's (forward and backward inside no_sync, nothing else)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()  # set_to_none: autograd then makes fresh gradients, which DDP must notice
        chunk = data[step * micro : (step + 1) * micro]
        for i, (x, y) in enumerate(chunk):
            local = ddp is not None and i < len(chunk) - 1
            if style == "torch":
                with ddp.no_sync() if local else contextlib.nullcontext():
                    loss_of((ddp or model)(torch.from_numpy(x)), y).backward()
                continue
            loss = loss_of((ddp or model)(torch.from_numpy(x)), y)
            if local:
                with ddp.no_sync():
                    loss.backward()
                    ddp.sync_gradients()
            else:
                loss.backward()
                if ddp is not None:
                    ddp.sync_gradients()
        opt.step()


class Recorder:
    """A group forwarding to a real one and recording the collectives DDP issues."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.calls: list[tuple[str, Any, int, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def all_reduce(self, buf: np.ndarray, op: Any = ReduceOp.SUM, *, async_op: bool = False) -> Any:
        self.calls.append(("all_reduce", op, buf.size, async_op))
        return self._pg.all_reduce(buf, op, async_op=async_op)

    def broadcast(self, buf: np.ndarray, src: int | None = None, *, async_op: bool = False) -> Any:
        self.calls.append(("broadcast", src, buf.size, async_op))
        return self._pg.broadcast(buf, src, async_op=async_op)


def local_grads(model: Any, x: torch.Tensor, y: np.ndarray) -> list[np.ndarray]:
    """The gradients one rank computes on its own, on a private copy of the model."""
    clone = copy.deepcopy(model)
    loss_of(clone(x), y).backward()
    return [p.grad.numpy().copy() for p in clone.parameters()]


@pytest.mark.parametrize("style", ["explicit", "torch"])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_torch_module_trains_like_one_process(view: bool, micro: int, style: str) -> None:
    batch = 4

    def rank_fn(pg: Any) -> list[np.ndarray]:
        rank = pg.rank()
        model = torch_model(seed=rank)  # the constructor must replace these weights with rank 0's
        ddp = DDP(model, pg, gradient_as_bucket_view=view, bucket_cap_mb=TINY_MB if micro == 2 else 25)
        data = [
            (x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch])
            for x, y in batches(2 * batch, np.float64, STEPS * micro)
        ]
        torch_train(model, ddp, data, micro, style)
        return [p.detach().numpy().copy() for p in model.parameters()]

    reference = torch_model(seed=0)
    torch_train(reference, None, batches(2 * batch, np.float64, STEPS * micro), micro, style)
    check_training(spawn(rank_fn, 2), [p.detach().numpy() for p in reference.parameters()], np.float64)


def test_the_constructor_broadcasts_from_the_groups_first_rank() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray] | None:
        if pg.rank() == 0:
            return None  # not a member of the subgroup
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                t.fill_(pg.rank())
        DDP(model, ProcessGroup.with_ranks(pg.backend(), [1, 2]))
        return [t.detach().numpy().copy() for t in itertools.chain(model.parameters(), model.buffers())]

    _, first, second = spawn(rank_fn, 3)
    assert first is not None and second is not None
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, 1)
        np.testing.assert_array_equal(b, 1)


def test_backward_returns_with_averaged_gradients_and_sync_gradients_returns_at_once() -> None:
    def rank_fn(pg: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[Any], int]:
        group = Recorder(pg)
        model = torch_model(seed=0)
        ddp = DDP(model, group, bucket_cap_mb=TINY_MB)
        group.calls.clear()
        x, y = batches(4, np.float64, 1)[0]
        x, y = x[2 * pg.rank() : 2 * pg.rank() + 2], y[2 * pg.rank() : 2 * pg.rank() + 2]
        own = local_grads(model, torch.from_numpy(x), y)
        loss_of(ddp(torch.from_numpy(x)), y).backward()
        averaged = [p.grad.numpy().copy() for p in model.parameters()]
        issued = list(group.calls)
        ddp.sync_gradients()
        return own, averaged, issued, len(group.calls) - len(issued)

    (own0, avg0, issued, extra), (own1, avg1, _, _) = spawn(rank_fn, 2)
    for a, b, s0, s1 in zip(own0, own1, avg0, avg1, strict=True):
        assert not np.array_equal(a, b)
        np.testing.assert_array_equal(s0, (a + b) / 2)
        np.testing.assert_array_equal(s1, s0)
    sizes = [p.numel() for p in torch_model(0).parameters()][::-1]
    # On the worker, but the last bucket: its gradients come last, and this thread reduces it at the end of
    # backward (no thread hand-off).
    want = [("all_reduce", ReduceOp.AVERAGE, n, True) for n in sizes[:-1]]
    assert issued == [*want, ("all_reduce", ReduceOp.AVERAGE, sizes[-1], False)]
    assert extra == 0


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_a_backward_that_keeps_its_graph_averages_the_gradients_values(view: bool) -> None:
    """backward(create_graph=True) (gradient penalties, higher-order terms) hands over gradients that are
    in a graph themselves: their values are averaged, and no bucket joins the graph."""

    def rank_fn(pg: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[bool]]:
        model = torch_model(seed=0)
        ddp = DDP(model, pg, gradient_as_bucket_view=view, bucket_cap_mb=TINY_MB)
        x, y = batches(4, np.float64, 1)[0]
        x, y = x[2 * pg.rank() : 2 * pg.rank() + 2], y[2 * pg.rank() : 2 * pg.rank() + 2]
        own = local_grads(model, torch.from_numpy(x), y)
        loss_of(ddp(torch.from_numpy(x)), y).backward(create_graph=True)
        averaged = [p.grad.detach().numpy().copy() for p in model.parameters()]
        in_graph = [slot.view.requires_grad for slot in ddp._grads().slots]
        return own, averaged, in_graph

    (own0, avg0, graph0), (own1, avg1, _) = spawn(rank_fn, 2)
    for a, b, s0, s1 in zip(own0, own1, avg0, avg1, strict=True):
        np.testing.assert_array_equal(s0, (a + b) / 2)
        np.testing.assert_array_equal(s1, s0)
    assert graph0 == [False] * len(graph0)


def test_bucket_all_reduces_start_while_backward_still_runs() -> None:
    def rank_fn(pg: Any) -> tuple[int, int]:
        group = Recorder(pg)
        model = torch_model(seed=0)
        ddp = DDP(model, group, bucket_cap_mb=TINY_MB)
        group.calls.clear()
        seen: list[int] = []
        # The first layer's weight gets its gradient last; this hook runs after DDP's on the same parameter.
        model[0].weight.register_post_accumulate_grad_hook(lambda _: seen.append(len(group.calls)))
        loss_of(ddp(torch.ones(2, D_IN, dtype=torch.float64)), np.zeros((2, D_OUT))).backward()
        return seen[0], len(group.calls)

    for during, total in spawn(rank_fn, 2):
        assert during >= 2  # both buckets of the last layer went out before backward reached the first
        assert total == 4


@pytest.mark.parametrize("view", [True, False], ids=["view", "copy"])
def test_no_sync_accumulates_then_the_first_synced_backward_averages_the_totals(view: bool) -> None:
    def rank_fn(pg: Any) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        group = Recorder(pg)
        model = torch_model(seed=0)
        ddp = DDP(model, group, gradient_as_bucket_view=view)
        group.calls.clear()
        data = [(x[2 * pg.rank() :][:2], y[2 * pg.rank() :][:2]) for x, y in batches(4, np.float64, 3)]
        with ddp.no_sync():
            for x, y in data[:2]:
                loss_of(ddp(torch.from_numpy(x)), y).backward()
        local = [p.grad.numpy().copy() for p in model.parameters()]
        silent = len(group.calls)
        x, y = data[2]
        last = local_grads(model, torch.from_numpy(x), y)
        loss_of(ddp(torch.from_numpy(x)), y).backward()
        totals = [a + b for a, b in zip(local, last, strict=True)]
        return totals, [p.grad.numpy().copy() for p in model.parameters()], silent

    (tot0, avg0, silent), (tot1, avg1, _) = spawn(rank_fn, 2)
    assert silent == 0
    for a, b, s0, s1 in zip(tot0, tot1, avg0, avg1, strict=True):
        np.testing.assert_allclose(s0, (a + b) / 2, rtol=1e-12)
        np.testing.assert_array_equal(s0, s1)


def test_sync_gradients_averages_what_a_backward_inside_no_sync_left() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = torch_model(seed=0)
        ddp = DDP(model, pg)
        with ddp.no_sync():
            loss_of(
                ddp(torch.full((2, D_IN), pg.rank() + 1.0, dtype=torch.float64)), np.zeros((2, D_OUT))
            ).backward()
            ddp.sync_gradients()  # a no-op in here
        local = [p.grad.numpy().copy() for p in model.parameters()]
        ddp.sync_gradients()
        return local + [p.grad.numpy().copy() for p in model.parameters()]

    first, second = spawn(rank_fn, 2)
    for a, b, s0, s1 in zip(first[:4], second[:4], first[4:], second[4:], strict=True):
        np.testing.assert_array_equal(s0, (a + b) / 2)
        np.testing.assert_array_equal(s1, s0)


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 2).double()
        self.left = torch.nn.Linear(2, 1).double()
        self.right = torch.nn.Linear(2, 1).double()
        self.spare = torch.nn.Linear(2, 1).double()  # never used

    def forward(self, x: torch.Tensor, use_right: bool) -> torch.Tensor:
        h = self.body(x)
        return self.left(h) + (self.right(h) if use_right else 0)  # type: ignore[no-any-return]


def test_unused_parameters_raise_without_find_unused_parameters() -> None:
    def rank_fn(pg: Any) -> str:
        model = TwoHeads()
        ddp = DDP(model, pg)
        with pytest.raises(RuntimeError, match="find_unused_parameters=True") as error:
            ddp(torch.ones(1, 2, dtype=torch.float64), use_right=False).sum().backward()
        assert model.body.weight.grad is not None
        ddp.sync_parameters()  # the reduction finished first: the ranks are still in step
        return str(error.value)

    for message in spawn(rank_fn, 2):
        for name in ("module.right.weight", "module.right.bias", "module.spare.weight", "module.spare.bias"):
            assert name in message
        assert "module.left.weight" not in message


def test_find_unused_parameters() -> None:
    def rank_fn(pg: Any) -> dict[str, np.ndarray | None]:
        model = TwoHeads()
        ddp = DDP(model, pg, find_unused_parameters=True)
        x = torch.full((1, 2), pg.rank() + 1.0, dtype=torch.float64)
        ddp(x, use_right=pg.rank() == 1).sum().backward()  # the right head only on rank 1
        return {n: None if p.grad is None else p.grad.numpy().copy() for n, p in model.named_parameters()}

    first, second = spawn(rank_fn, 2)
    assert first["spare.weight"] is None and second["spare.bias"] is None  # no rank used it: untouched
    np.testing.assert_array_equal(first["right.bias"], [0.5])  # rank 1's 1, rank 0's zero, averaged
    for name in first:
        if first[name] is not None:
            np.testing.assert_array_equal(first[name], second[name])


def test_it_is_a_torch_module_with_torch_ddp_keys() -> None:
    pg = ProcessGroup(ThreadBackend.single())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ddp = DDP(model, pg)
    assert isinstance(ddp, TorchDistributedDataParallel)
    assert isinstance(ddp, DistributedDataParallel) and isinstance(ddp, torch.nn.Module)
    assert ddp.module is model and ddp.process_group is pg
    assert list(ddp.state_dict()) == ["module." + k for k in model.state_dict()]
    assert [n for n, _ in ddp.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
    assert list(ddp.parameters()) == list(model.parameters())
    # A checkpoint moves between the wrapper and a fresh one (as between torch DDP and ours).
    other = DDP(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), pg)
    other.load_state_dict(ddp.state_dict())
    for a, b in zip(other.state_dict().values(), ddp.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert ddp.eval() is ddp and not model.training and not model[1].training
    assert ddp.train() is ddp and model[1].training
    ddp(torch.ones(2, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    ddp.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_to_rebuilds_the_buckets_for_the_new_dtype() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = torch.nn.Linear(2, 1)
        ddp = DDP(model, pg).to(torch.float64)
        assert isinstance(ddp, TorchDistributedDataParallel)
        ddp(torch.full((1, 2), pg.rank() + 1.0, dtype=torch.float64)).sum().backward()
        assert model.weight.grad is not None and model.weight.grad.dtype == torch.float64
        return [model.weight.grad.numpy().copy(), model.bias.grad.numpy().copy()]

    for weight, bias in spawn(rank_fn, 2):
        np.testing.assert_array_equal(weight, [[1.5, 1.5]])
        np.testing.assert_array_equal(bias, [1.0])


def test_torch_constructor_arguments() -> None:
    pg = ProcessGroup(ThreadBackend.single())
    model = torch.nn.Linear(2, 2)
    for devices in (None, [], "cpu", torch.device("cpu"), ["cpu"], [torch.device("cpu")]):
        ddp = DDP(model, pg, device_ids=devices, output_device=None if devices == [] else devices)
        assert ddp.device_ids is None and ddp.output_device is None
    for devices in ([0], 0, "cuda:0", [torch.device("cuda", 1)], "no-such-device"):
        with pytest.raises(ValueError, match="device_ids=.*CPU"):
            DDP(model, pg, device_ids=devices)
    with pytest.raises(ValueError, match="output_device"):
        DDP(model, pg, output_device=0)
    with pytest.raises(TypeError, match="second argument .* process group.*device_ids="):
        DDP(model, [0])
    ddp = DDP(
        model,
        process_group=pg,
        bucket_cap_mb=None,
        find_unused_parameters=True,
        static_graph=True,
        broadcast_buffers=False,
        gradient_as_bucket_view=False,
        dim=0,
        init_sync=False,
    )
    assert (ddp.find_unused_parameters, ddp.static_graph, ddp.broadcast_buffers) == (True, True, False)
    assert ddp.gradient_as_bucket_view is False
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(model, pg, bucket_cap_mb=0)


def test_a_dropped_wrapper_stops_reducing() -> None:
    def rank_fn(pg: Any) -> int:
        group = Recorder(pg)
        model = torch_model(seed=0)
        DDP(model, group, bucket_cap_mb=TINY_MB)
        gc.collect()
        ddp = DDP(model, group)  # one bucket
        group.calls.clear()
        ddp(torch.ones(1, D_IN, dtype=torch.float64)).sum().backward()
        return len(group.calls)

    assert spawn(rank_fn, 2) == [1, 1]


def test_buffers_follow_the_first_rank_before_forwards_as_in_torch() -> None:
    # torch broadcasts buffers before a forward when the previous forward ran under autograd outside
    # no_sync() (the first forward always); eval mode keeps BatchNorm's statistics fixed, so they show it.
    def rank_fn(pg: Any) -> list[float]:
        model = torch.nn.BatchNorm1d(1).eval()
        ddp = DDP(model, pg)
        x = torch.zeros(1, 1)
        seen = []

        def forward(grad: bool) -> None:
            model.running_mean.fill_(pg.rank() + 1.0)
            with torch.set_grad_enabled(grad):
                ddp(x)
            seen.append(float(model.running_mean))

        forward(True)  # first forward: synced
        forward(False)  # previous one was under autograd: synced
        forward(False)  # previous one was not: left alone
        forward(True)  # still not
        with ddp.no_sync():
            forward(True)  # previous one was under autograd outside no_sync: synced
        forward(True)  # previous one was inside no_sync: left alone
        return seen

    first, second = spawn(rank_fn, 2)
    assert first == [1.0] * 6
    assert second == [1.0, 1.0, 2.0, 2.0, 1.0, 2.0]


def test_torch_gradients_are_bucket_views_and_buffers_broadcast() -> None:
    def rank_fn(pg: Any) -> list[np.ndarray]:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
        model[1].running_mean.fill_(pg.rank())
        model[0].bias.requires_grad_(False)  # frozen: synced as a parameter, never bucketed
        ddp = DDP(model, pg)
        assert ddp.bucket_assignment() == [[3, 2, 0]]
        assert float(model[1].running_mean.abs().max()) == 0.0  # rank 0's
        ddp.sync_parameters()  # harmless again
        ddp(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad][::-1]
        for later, earlier in itertools.pairwise(grads):
            assert later.data_ptr() + later.nbytes == earlier.data_ptr()
        assert model[0].bias.grad is None
        return [b.numpy().copy() for b in model.buffers()]

    first, second = spawn(rank_fn, 2)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
