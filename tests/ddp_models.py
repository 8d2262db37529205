"""The models and training loops the DDP tests share: a small numpy MLP, its data, one process on the whole
batch (the reference) and DDP on N ranks; a group that counts the collectives DDP issues."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from axonml_distributed._core import ReduceOp
from axonml_distributed.ddp import DDP

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


class Bag:
    """Parameters only: a model whose gradients the test sets by hand."""

    def __init__(self, *arrays: np.ndarray) -> None:
        self.params = [Param(a) for a in arrays]

    def parameters(self) -> Iterator[Param]:
        return iter(self.params)


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])
