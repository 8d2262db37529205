"""DistributedDataParallel over the MPI group: N ranks x batch B train exactly like one process on batch
N*B (each rank computes that reference itself), and the ranks' weights are bitwise identical.
Exit code 0 = pass.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from jobutil import identical_on_all_ranks

from axonml_distributed import DistributedDataParallel
from axonml_distributed.mpi import init_mpi_process_group

D_IN, HIDDEN, D_OUT, BATCH, STEPS, LR = 5, 7, 3, 6, 20, 0.1


class Param:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.grad: np.ndarray | None = None


class MLP:
    """x -> tanh(x W1 + b1) W2 + b2 with a hand-written backward that accumulates into .grad."""

    def __init__(self, seed: int, dtype: type) -> None:
        rng = np.random.default_rng(seed)
        self.params = [
            Param(rng.normal(0, D_IN**-0.5, (D_IN, HIDDEN)).astype(dtype)),
            Param(rng.normal(0, 0.1, HIDDEN).astype(dtype)),
            Param(rng.normal(0, HIDDEN**-0.5, (HIDDEN, D_OUT)).astype(dtype)),
            Param(rng.normal(0, 0.1, D_OUT).astype(dtype)),
        ]
        self.training = True

    def parameters(self) -> Iterator[Param]:
        return iter(self.params)

    def forward(self, x: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2 = (p.data for p in self.params)
        self._x, self._h = x, np.tanh(x @ w1 + b1)
        out: np.ndarray = self._h @ w2 + b2
        return out

    def backward(self, d_out: np.ndarray) -> None:
        d_h = (d_out @ self.params[2].data.T) * (1 - self._h**2)
        grads = [self._x.T @ d_h, d_h.sum(0), self._h.T @ d_out, d_out.sum(0)]
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g if p.grad is None else p.grad + g

    def step(self) -> None:
        for p in self.params:
            assert p.grad is not None
            p.data -= LR * p.grad
            p.grad = None


def batches(rows: int, dtype: type) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    xs = [rng.normal(size=(rows, D_IN)) for _ in range(STEPS)]
    return [(x.astype(dtype), np.sin(2 * x[:, :D_OUT]).astype(dtype)) for x in xs]


def train(model: MLP, data: list[tuple[np.ndarray, np.ndarray]], rows: slice, ddp: object = None) -> None:
    """SGD on the mean squared error over `rows` of each batch. With equal slices, DDP's average of the
    ranks' mean gradients is the gradient of the mean over the whole batch."""
    for x, y in data:
        out = (ddp or model).forward(x[rows])  # type: ignore[attr-defined]
        model.backward((out - y[rows]) / len(out))
        if ddp is not None:
            ddp.sync_gradients()  # type: ignore[attr-defined]
        model.step()


def main() -> None:
    pg = init_mpi_process_group(timeout=120)
    n, rank = pg.size(), pg.rank()
    for dtype, rtol in ((np.float64, 1e-10), (np.float32, 1e-4)):
        for cap_mb in (1e-9, 25.0):  # one bucket per parameter (async queue), then a single bucket
            data = batches(n * BATCH, dtype)
            reference = MLP(0, dtype)
            train(reference, data, slice(0, n * BATCH))

            model = MLP(rank, dtype)  # different on every rank: sync_parameters must fix that
            ddp = DistributedDataParallel(model, pg, bucket_cap_mb=cap_mb)
            ddp.sync_parameters()
            train(model, data, slice(rank * BATCH, (rank + 1) * BATCH), ddp)
            for got, want in zip(model.params, reference.params, strict=True):
                np.testing.assert_allclose(got.data, want.data, rtol=rtol, atol=rtol)
                identical_on_all_ranks(got.data, f"DDP weights {np.dtype(dtype).name} cap {cap_mb}")
    if rank == 0:
        print(f"ddp OK on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
