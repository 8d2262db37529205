"""The demo's training: data split and shards, the DDP training loop on each rank, and the one-process
baseline it is checked against."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from axonml_distributed import DistributedDataParallel, DistributedSampler, ReduceOp
from axonml_distributed.demo.mlp import MLP, SGD, cross_entropy
from axonml_distributed.progress import progress, write_above


@dataclass(frozen=True)
class Config:
    world_size: int
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    seed: int
    backend: str
    check: bool
    json: bool
    quiet: bool = False  # no progress bar or per-epoch lines (the --scaling runs)
    plot: Path | None = None
    scaling: bool = False


@dataclass(frozen=True)
class Digits:
    x_train: NDArray[np.float32]
    y_train: NDArray[np.intp]
    x_test: NDArray[np.float32]
    y_test: NDArray[np.intp]


def load_digits_split(seed: int, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's bundled 8x8 digits scaled to [0, 1], with the same share of each class held out."""
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    except ImportError:
        raise SystemExit(
            'The demo needs scikit-learn for its bundled digits data: pip install "axonml-distributed[demo]"'
        ) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = digits.target.astype(np.intp)
    rng = np.random.default_rng(seed)
    test = np.concatenate(
        [rng.permutation(members)[: round(test_fraction * len(members))] for members in _by_class(y)]
    )
    train = np.setdiff1d(np.arange(len(y)), test)
    return Digits(x[train], y[train], x[test], y[test])


def _by_class(y: NDArray[np.intp]) -> list[NDArray[np.intp]]:
    return [np.flatnonzero(y == label) for label in np.unique(y)]


def _batches(shard: NDArray[np.intp], batch_size: int) -> Iterator[NDArray[np.intp]]:
    for start in range(0, len(shard), batch_size):
        yield shard[start : start + batch_size]


def _shard(sampler: DistributedSampler, epoch: int) -> NDArray[np.intp]:
    sampler.set_epoch(epoch)
    return np.fromiter(sampler, dtype=np.intp, count=len(sampler))


def accuracy(model: MLP, x: NDArray[np.float32], y: NDArray[np.intp]) -> float:
    return float(np.mean(model(x).argmax(axis=1) == y))


def _epoch_line(epoch: int, epochs: int, loss: float, acc: float, seconds: float) -> str:
    return f"epoch {epoch + 1:3d}/{epochs}  loss {loss:.4f}  train acc {acc:6.2%}  {seconds:.2f} s"


def train(pg: Any, cfg: Config, data: Digits) -> dict[str, Any] | None:
    """One rank's training loop; returns the run summary on the main rank, None elsewhere."""
    is_main = pg.rank() == 0
    # Each rank starts from different weights on purpose: sync_parameters() must make rank 0's win.
    model = MLP(seed=cfg.seed + pg.rank())
    ddp = DistributedDataParallel(model, pg)
    ddp.sync_parameters()
    optimizer = SGD(model.parameters(), cfg.lr, cfg.momentum)
    sampler = DistributedSampler(len(data.y_train), seed=cfg.seed, process_group=pg)
    # Rank 0 shows a bar over every step (on a terminal) and a line per epoch on stderr.
    shown = is_main and not (cfg.json or cfg.quiet)
    steps = -(-len(sampler) // cfg.batch_size)
    sync_seconds = compute_seconds = 0.0
    loss_per_epoch, accuracy_per_epoch = [], []
    train_start = time.perf_counter()
    with progress(cfg.epochs * steps, "training", enabled=shown) as bar:
        for epoch in range(cfg.epochs):
            bar.set_description(f"epoch {epoch + 1}/{cfg.epochs}")
            epoch_start = time.perf_counter()
            totals = np.zeros(3)  # summed loss, correct predictions, samples: all-reduced for a global view
            for batch in _batches(_shard(sampler, epoch), cfg.batch_size):
                t0 = time.perf_counter()
                logits = ddp(data.x_train[batch])
                labels = data.y_train[batch]
                loss, dlogits = cross_entropy(logits, labels)
                model.backward(dlogits)
                t1 = time.perf_counter()
                ddp.sync_gradients()
                t2 = time.perf_counter()
                optimizer.step()
                # Compute is forward, backward and the SGD step; sync includes waiting for slower peers.
                compute_seconds += (t1 - t0) + (time.perf_counter() - t2)
                sync_seconds += t2 - t1
                totals += (loss * len(batch), np.sum(logits.argmax(axis=1) == labels), len(batch))
                bar.update(1)
            pg.all_reduce(totals, ReduceOp.SUM)
            epoch_loss, epoch_acc = float(totals[0] / totals[2]), float(totals[1] / totals[2])
            loss_per_epoch.append(epoch_loss)
            accuracy_per_epoch.append(epoch_acc)
            if shown:
                seconds = time.perf_counter() - epoch_start
                write_above(_epoch_line(epoch, cfg.epochs, epoch_loss, epoch_acc, seconds))
    train_seconds = time.perf_counter() - train_start

    # The largest difference between any two ranks, coordinate by coordinate; DDP promises exactly 0.
    every_rank = pg.all_gather_tensor(model.flat_parameters())
    max_param_diff = float(np.ptp(every_rank, axis=0).max())
    times = pg.all_gather_tensor(np.array([sync_seconds, compute_seconds]))
    if not is_main:
        return None
    mean_sync, mean_compute = times.mean(axis=0)
    summary: dict[str, Any] = {
        "test_accuracy": accuracy(model, data.x_test, data.y_test),
        "train_accuracy": float(totals[1] / totals[2]),
        "train_loss": float(totals[0] / totals[2]),
        "max_param_diff": max_param_diff,
        "world_size": pg.size(),
        "backend": cfg.backend,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "samples_per_sec": cfg.epochs * sampler.total_size / train_seconds,
        "train_seconds": train_seconds,
        "sync_seconds": float(mean_sync),
        "compute_seconds": float(mean_compute),
        # Over all ranks' samples of each epoch (all-reduced), as the progress lines show them.
        "loss_per_epoch": loss_per_epoch,
        "accuracy_per_epoch": accuracy_per_epoch,
    }
    if cfg.check:
        baseline = train_single_process(cfg, data, pg.size())
        summary["check_max_diff"] = float(np.abs(baseline.flat_parameters() - model.flat_parameters()).max())
    return summary


def train_single_process(cfg: Config, data: Digits, world_size: int) -> MLP:
    """What DDP should equal: one model whose every batch is the union of the ranks' batches for that step.

    With equal per-rank batch sizes, the mean loss over the union is the average of the per-rank mean
    losses, so its gradient is exactly the averaged gradient DDP applies.
    """
    model = MLP(seed=cfg.seed)  # rank 0's initial weights, which sync_parameters() gave every rank
    optimizer = SGD(model.parameters(), cfg.lr, cfg.momentum)
    n = len(data.y_train)
    samplers = [DistributedSampler(n, world_size, r, seed=cfg.seed) for r in range(world_size)]
    for epoch in range(cfg.epochs):
        per_rank = [_batches(_shard(s, epoch), cfg.batch_size) for s in samplers]
        for rank_batches in zip(*per_rank, strict=True):
            batch = np.concatenate(rank_batches)
            _, dlogits = cross_entropy(model(data.x_train[batch]), data.y_train[batch])
            model.backward(dlogits)
            optimizer.step()
    return model
