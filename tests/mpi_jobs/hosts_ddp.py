"""An mpiexec job for tests/test_hosts_mpi.py, on 2 simulated hosts x 2 ranks with every eligible
all_reduce through the two levels (AXONML_HOSTS_FLAT_BELOW=0): our numpy DDP (tests/ddp_models.py) and
our DDP of a torch module train like one process on the whole batch, to float32 rounding, with weights
bitwise identical on every rank. Exit code 0 = pass; rank 0 prints ``hosts ddp OK on 4 ranks``."""

from __future__ import annotations

import numpy as np
from jobutil import identical_on_all_ranks

import axonml_distributed as ad
from axonml_distributed import DDP
from axonml_distributed.mpi import MpiHostsProcessGroup
from ddp_models import D_IN, D_OUT, HIDDEN, HUGE_MB, LR, STEPS, TINY_MB, TOL, batches, train_ddp, train_single

BATCH = 4


def check_numpy_ddp(pg: MpiHostsProcessGroup) -> None:
    n = pg.size()
    for dtype in (np.float32, np.float64):
        expected = train_single(n * BATCH, dtype)
        for cap in (TINY_MB, HUGE_MB):  # one bucket per parameter (async handles), then one bucket
            got = train_ddp(pg, BATCH, dtype, bucket_cap_mb=cap)
            rtol, atol = TOL[dtype]
            for mine, want in zip(got, expected, strict=True):
                np.testing.assert_allclose(mine, want, rtol=rtol, atol=atol)
                identical_on_all_ranks(mine, f"numpy DDP {np.dtype(dtype).name} cap {cap}")


def torch_model(seed: int):  # type: ignore[no-untyped-def]
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT)
    )
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.normal(0, 0.5, tuple(p.shape)).astype(np.float32)))
    return model


def torch_train(model, ddp, data) -> None:  # type: ignore[no-untyped-def]
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        out = (ddp or model)(torch.from_numpy(x))
        (0.5 * ((out - torch.from_numpy(y)) ** 2).sum(1).mean()).backward()
        opt.step()


def check_torch_ddp(pg: MpiHostsProcessGroup) -> None:
    n, rank = pg.size(), pg.rank()
    data = batches(n * BATCH, np.float32, STEPS)
    reference = torch_model(0)
    torch_train(reference, None, data)
    for cap in (TINY_MB, 25.0):
        model = torch_model(rank)  # the constructor must replace these weights with rank 0's
        ddp = DDP(model, pg, bucket_cap_mb=cap)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        torch_train(model, ddp, [(x[rows], y[rows]) for x, y in data])
        rtol, atol = TOL[np.float32]
        for mine, want in zip(model.parameters(), reference.parameters(), strict=True):
            got = mine.detach().numpy()
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=rtol, atol=atol)
            identical_on_all_ranks(got, f"torch DDP cap {cap}")


def main() -> None:
    pg = ad.init_process_group("mpi", timeout=60)
    assert isinstance(pg, MpiHostsProcessGroup), repr(pg)
    check_numpy_ddp(pg)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch missing: its DDP not checked", flush=True)
    else:
        check_torch_ddp(pg)
    if pg.rank() == 0:
        print(f"hosts ddp OK on {pg.size()} ranks", flush=True)
    ad.destroy_process_group()


if __name__ == "__main__":
    main()
