"""Training flows that torch users know, written on our API, for tests/test_torch_flows.py. One rank of a job
under ``python -m axonml_distributed.run --nproc-per-node 2``: ``flows.py FLOW IMPL OUT [ARGS]``.

- ``tutorial``: the PyTorch DDP tutorial (basic step, checkpoint saved on rank 0 + barrier + loaded on
  every rank, ``no_sync`` accumulation) with ``IMPL`` "torch" (torch DDP over gloo) or "axonml" (ours): only
  the imports differ, and the test compares the two bitwise.
- ``series``: pytorch/examples' ddp-tutorial-series (multigpu_torchrun.py: DistributedSampler with
  set_epoch, a snapshot each epoch, resumed by a second launch); the test compares it with `series_reference`,
  one process replaying both ranks.
- ``horovod``: Horovod's pytorch_mnist on our Horovod-style API, on synthetic MNIST-shaped data (nothing is
  downloaded); compared with `horovod_reference`.

Each rank saves what it ends with to ``OUT/<flow>.<impl>.<rank>.pt``. Importing this module starts nothing.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the tutorials' spelling
from models import ToyModel  # the jobs' directory is on sys.path: they run as scripts
from torch import nn
from torch.utils.data import DataLoader, Dataset

SERIES_EPOCHS, SERIES_BATCH, SERIES_SIZE = 4, 8, 64
HVD_EPOCHS, HVD_BATCH, HVD_SIZE, HVD_TEST, HVD_SEED, HVD_LR = 2, 8, 64, 32, 42, 0.01


# --- the PyTorch DDP tutorial -----------------------------------------------------------------------------


def tutorial(dist: Any, ddp_class: Any, impl: str, rank: int, out: Path) -> dict[str, Any]:
    data = torch.Generator().manual_seed(100 + rank)  # every rank its own batches

    def batch(n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 10, generator=data), torch.randn(n, 5, generator=data)

    results: dict[str, Any] = {}
    # demo_basic; every rank starts from its own weights: the constructor broadcasts rank 0's.
    torch.manual_seed(rank)
    ddp_model = ddp_class(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(3):
        optimizer.zero_grad()
        x, labels = batch()
        loss_fn(ddp_model(x), labels).backward()
        optimizer.step()
    results["basic"] = ddp_model.state_dict()

    # demo_checkpoint: rank 0 saves, the barrier makes every rank wait for the file, every rank loads it.
    checkpoint = out / f"tutorial.{impl}.ckpt"
    if rank == 0:
        torch.save(ddp_model.state_dict(), checkpoint)
    with torch.no_grad():  # drift the replicas apart, so that the load visibly brings them back
        for p in ddp_model.parameters():
            p.add_(rank + 1.0)
    dist.barrier()
    ddp_model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
    optimizer.zero_grad()
    x, labels = batch()
    loss_fn(ddp_model(x), labels).backward()
    optimizer.step()
    results["checkpoint"] = ddp_model.state_dict()

    # Gradient accumulation with no_sync(): micro-batches stay local, the last backward averages all.
    torch.manual_seed(10 + rank)
    ddp_model = ddp_class(ToyModel())
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        with ddp_model.no_sync():
            for _ in range(2):
                x, labels = batch(8)
                loss_fn(ddp_model(x), labels).backward()
        x, labels = batch(8)
        loss_fn(ddp_model(x), labels).backward()
        optimizer.step()
    results["no_sync"] = ddp_model.state_dict()
    return results


# --- pytorch/examples: ddp-tutorial-series -----------------------------------------------------------------


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)  # the same data on every rank (and in the reference)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def series_model(rank: int) -> nn.Module:
    torch.manual_seed(1234 + rank)
    return nn.Linear(20, 1)


def series(rank: int, out: Path, stop_after: int) -> dict[str, Any]:
    """multigpu_torchrun.py's Trainer: resumes from the snapshot if there is one, trains until epoch
    `stop_after` (a crash after saving), saving a snapshot every epoch."""
    import axonml_distributed as ad

    snapshot_path = out / "series.snapshot.pt"
    dataset = MyTrainDataset(SERIES_SIZE)
    loader = DataLoader(
        dataset, batch_size=SERIES_BATCH, shuffle=False, sampler=ad.DistributedSampler(dataset)
    )
    model = series_model(rank)
    epochs_run = 0
    if snapshot_path.exists():
        snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        model.load_state_dict(snapshot["MODEL_STATE"])
        epochs_run = snapshot["EPOCHS_RUN"]
    model = ad.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for epoch in range(epochs_run, stop_after):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(source), targets).backward()
            optimizer.step()
        if rank == 0:
            torch.save({"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch + 1}, snapshot_path)
        ad.barrier()  # the next launch must find this epoch's snapshot
    return {"model": model.module.state_dict(), "epochs_run": epochs_run}


def series_reference() -> dict[str, torch.Tensor]:
    """One process: each step averages the two ranks' gradients, on the shards our sampler gives them."""
    import axonml_distributed as ad

    dataset = MyTrainDataset(SERIES_SIZE)
    model = series_model(0)  # rank 0's weights, which DDP's constructor broadcasts
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    samplers = [ad.DistributedSampler(dataset, num_replicas=2, rank=r) for r in range(2)]
    for epoch in range(SERIES_EPOCHS):
        loaders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            loaders.append(DataLoader(dataset, batch_size=SERIES_BATCH, shuffle=False, sampler=sampler))
        for batches in zip(*loaders, strict=True):
            optimizer.zero_grad()
            _average_grads(model, [lambda b=b: F.cross_entropy(model(b[0]), b[1]) for b in batches])
            optimizer.step()
    return model.state_dict()


def _lockstep(calls: list[Any]) -> list[Any]:
    """Run each rank's call from the same global random state, as the ranks (which share their seed) do;
    the state left is the one every rank ends with."""
    state = torch.get_rng_state()
    results = []
    for call in calls:
        torch.set_rng_state(state)
        results.append(call())
    return results


def _average_grads(model: nn.Module, losses: list[Any]) -> None:
    """Set .grad to the average over the ranks' losses, as the ranks' all-reduce does."""

    def grads(loss: Any) -> list[torch.Tensor]:
        model.zero_grad()
        loss().backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    per_rank = _lockstep([lambda f=f: grads(f) for f in losses])
    for p, *rank_grads in zip(model.parameters(), *per_rank, strict=True):
        p.grad = sum(rank_grads[1:], rank_grads[0]) / len(rank_grads)


# --- Horovod's pytorch_mnist ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class SyntheticMNIST(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """MNIST-shaped (1x28x28 images normalized as torchvision's, labels 0-9), from a fixed seed."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = (torch.rand(size, 1, 28, 28, generator=g) - 0.1307) / 0.3081
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def horovod_model(rank: int) -> nn.Module:
    torch.manual_seed(HVD_SEED + rank)  # own weights per rank: broadcast_parameters must fix that
    model = Net()
    torch.manual_seed(HVD_SEED)  # the example's seed: every rank draws the same dropout masks
    return model


def horovod(rank: int) -> dict[str, Any]:
    import axonml_distributed as hvd

    size = hvd.get_world_size()
    train_dataset, test_dataset = SyntheticMNIST(HVD_SIZE, 1), SyntheticMNIST(HVD_TEST, 2)
    train_sampler = hvd.DistributedSampler(train_dataset, num_replicas=size, rank=hvd.get_rank())
    train_loader = DataLoader(train_dataset, batch_size=HVD_BATCH, sampler=train_sampler)
    test_sampler = hvd.DistributedSampler(test_dataset, num_replicas=size, rank=hvd.get_rank())
    test_loader = DataLoader(test_dataset, batch_size=HVD_BATCH, sampler=test_sampler)
    model = horovod_model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=HVD_LR * size, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    metrics = []
    for epoch in range(HVD_EPOCHS):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        metrics.append(_horovod_test(model, test_loader, len(test_sampler)))
    for values in metrics:
        for i, value in enumerate(values):  # metric_average: hvd.allreduce of a scalar tensor
            t = torch.tensor(value)
            hvd.all_reduce_mean(t)
            values[i] = t.item()
    return {"model": model.state_dict(), "metrics": metrics}


def _horovod_test(model: nn.Module, loader: DataLoader[Any], count: int) -> list[float]:
    model.eval()
    loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(1).eq(target).float().sum().item()
    return [loss / count, correct / count]


def horovod_reference() -> dict[str, Any]:
    """One process replaying both ranks: the same random state for each rank's forward (the ranks share
    the example's seed), each step averaging the ranks' gradients; the metrics averaged over the shards."""
    import axonml_distributed as ad

    train_dataset, test_dataset = SyntheticMNIST(HVD_SIZE, 1), SyntheticMNIST(HVD_TEST, 2)
    model = horovod_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=HVD_LR * 2, momentum=0.5)
    samplers = [ad.DistributedSampler(train_dataset, num_replicas=2, rank=r) for r in range(2)]
    tests = [ad.DistributedSampler(test_dataset, num_replicas=2, rank=r) for r in range(2)]
    metrics = []
    for epoch in range(HVD_EPOCHS):
        model.train()
        for sampler in samplers:
            sampler.set_epoch(epoch)
        # Creating an iterator draws a base seed from the global generator, on every rank.
        iterators = _lockstep(
            [lambda s=s: iter(DataLoader(train_dataset, batch_size=HVD_BATCH, sampler=s)) for s in samplers]
        )
        for batches in zip(*iterators, strict=True):
            optimizer.zero_grad()
            _average_grads(model, [lambda b=b: F.nll_loss(model(b[0]), b[1]) for b in batches])
            optimizer.step()
        loaders = [(DataLoader(test_dataset, batch_size=HVD_BATCH, sampler=s), len(s)) for s in tests]
        per_rank = _lockstep([lambda d=d, n=n: _horovod_test(model, d, n) for d, n in loaders])
        metrics.append([(a + b) / 2 for a, b in zip(*per_rank, strict=True)])
    return {"model": model.state_dict(), "metrics": metrics}


# --- one rank ---------------------------------------------------------------------------------------------


def main() -> None:
    flow, impl, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    if impl == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
    else:
        import axonml_distributed as dist  # type: ignore[no-redef]
        from axonml_distributed import DistributedDataParallel as DDP  # type: ignore[assignment]

        dist.init_process_group("shm", timeout=60)
    if flow == "tutorial":
        result = tutorial(dist, DDP, impl, rank, out)
    elif flow == "series":
        result = series(rank, out, int(sys.argv[4]))
    else:
        result = horovod(rank)
    torch.save(result, out / f"{flow}.{impl}.{rank}.pt")
    # gloo's teardown can abort the process ("terminate called without an active exception") while a
    # DDP reducer left in a reference cycle still holds the group, or while the peer still talks to it:
    # both freed and both ranks past their last call first.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
