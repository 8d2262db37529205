"""Train a small MLP on handwritten digits across several ranks, and show what the parallelism cost.

    python -m axonml_distributed.demo                         # 4 ranks as threads of this process
    python -m axonml_distributed.demo --check                 # also compare with one process, union batch
    python -m axonml_distributed.demo --backend shm --nproc 2  # 2 processes over shared memory

Each rank trains on its own DistributedSampler shard; DistributedDataParallel averages the gradients after
every backward pass, so all ranks take the same SGD step and end with identical parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from axonml_distributed import DistributedDataParallel, DistributedSampler, ReduceOp, spawn
from axonml_distributed.mlp import MLP, SGD, cross_entropy

# |param diff| allowed between DDP and one process on the union batch: the two sum the same float32
# gradients in a different order, and those rounding differences compound over the steps.
CHECK_TOLERANCE = 1e-4
# Set by axonml_distributed.run in every worker: with it, --backend shm trains instead of launching workers.
_LAUNCHED_ENV = "AXONML_JOB_ID"


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


class Progress:
    """Per-epoch progress on stderr: a redrawn bar on a terminal, one plain line per epoch otherwise."""

    def __init__(self, enabled: bool, epochs: int) -> None:
        self.enabled = enabled
        self.epochs = epochs
        self.tty = sys.stderr.isatty()

    def _label(self, epoch: int) -> str:
        return f"epoch {epoch + 1:3d}/{self.epochs}"

    def step(self, epoch: int, done: int, total: int) -> None:
        if self.enabled and self.tty:
            filled = 30 * done // total
            bar = "#" * filled + "-" * (30 - filled)
            sys.stderr.write(f"\r{self._label(epoch)} [{bar}] {done}/{total}")
            sys.stderr.flush()

    def epoch(self, epoch: int, loss: float, acc: float, seconds: float) -> None:
        if self.enabled:
            line = f"{self._label(epoch)}  loss {loss:.4f}  train acc {acc:6.2%}  {seconds:.2f} s"
            # On a terminal, overwrite the bar; the padding clears its longer tail.
            sys.stderr.write(f"\r{line:<60}\n" if self.tty else f"{line}\n")
            sys.stderr.flush()


def train(pg: Any, cfg: Config, data: Digits) -> dict[str, Any] | None:
    """One rank's training loop; returns the run summary on the main rank, None elsewhere."""
    is_main = pg.rank() == 0
    # Each rank starts from different weights on purpose: sync_parameters() must make rank 0's win.
    model = MLP(seed=cfg.seed + pg.rank())
    ddp = DistributedDataParallel(model, pg)
    ddp.sync_parameters()
    optimizer = SGD(model.parameters(), cfg.lr, cfg.momentum)
    sampler = DistributedSampler(len(data.y_train), seed=cfg.seed, process_group=pg)
    progress = Progress(is_main and not cfg.json, cfg.epochs)
    steps = -(-len(sampler) // cfg.batch_size)
    sync_seconds = compute_seconds = 0.0
    train_start = time.perf_counter()
    for epoch in range(cfg.epochs):
        epoch_start = time.perf_counter()
        totals = np.zeros(3)  # summed loss, correct predictions, samples: all-reduced for a global view
        for step, batch in enumerate(_batches(_shard(sampler, epoch), cfg.batch_size)):
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
            progress.step(epoch, step + 1, steps)
        pg.all_reduce(totals, ReduceOp.SUM)
        progress.epoch(epoch, totals[0] / totals[2], totals[1] / totals[2], time.perf_counter() - epoch_start)
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


def report(summary: dict[str, Any]) -> str:
    total = summary["sync_seconds"] + summary["compute_seconds"]
    lines = [
        (
            f"test accuracy   {summary['test_accuracy']:.2%} on held-out digits "
            f"(final train loss {summary['train_loss']:.4f}, train accuracy {summary['train_accuracy']:.2%})"
        ),
        (
            f"throughput      {summary['samples_per_sec']:,.0f} samples/s on {summary['world_size']} ranks "
            f"({summary['backend']}), {summary['train_seconds']:.2f} s of training"
        ),
        (
            f"time per rank   compute {summary['compute_seconds']:.3f} s, gradient sync "
            f"{summary['sync_seconds']:.3f} s ({summary['sync_seconds'] / total:.0%} of the step, "
            "waiting for slower peers included)"
        ),
        f"ranks agree     largest |param diff| between any two ranks: {summary['max_param_diff']}",
    ]
    if "check_max_diff" in summary:
        lines.append(
            f"check           largest |param diff| vs one process on batch "
            f"{summary['world_size'] * summary['batch_size']}: {summary['check_max_diff']:.3g} "
            f"(tolerance {CHECK_TOLERANCE:g})"
        )
    return "\n".join(lines)


def failures(summary: dict[str, Any]) -> list[str]:
    problems = []
    if summary["max_param_diff"] != 0.0:
        problems.append("ranks ended with different parameters")
    if summary.get("check_max_diff", 0.0) > CHECK_TOLERANCE:
        problems.append("DDP result differs from the single-process baseline beyond tolerance")
    return problems


def finish(summary: dict[str, Any], cfg: Config) -> int:
    print(json.dumps(summary) if cfg.json else report(summary))
    problems = failures(summary)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def run_shm_worker(cfg: Config, data: Digits) -> int:
    from axonml_distributed import destroy_process_group, get_default_group, init_process_group

    try:
        init_process_group("shm")
    except (ImportError, NotImplementedError, OSError, RuntimeError, ValueError) as exc:
        print(f"error: the shm backend is unavailable here ({exc}); try --backend threads", file=sys.stderr)
        return 2
    try:
        summary = train(get_default_group(), cfg, data)
    finally:
        destroy_process_group()
    return finish(summary, cfg) if summary is not None else 0


def launch_shm(nproc: int, argv: Sequence[str]) -> int:
    """Re-run this demo as nproc worker processes under the launcher, which sets up the shm world."""
    from axonml_distributed.run import launch

    return launch(["--nproc-per-node", str(nproc), "-m", "axonml_distributed.demo", *argv])


def parse_args(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(prog="axonml-demo", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    default = " (default: %(default)s)"
    add("--world-size", type=int, default=4, help="ranks for --backend threads" + default)
    add("--epochs", type=int, default=30, help="passes over the training digits" + default)
    add("--batch-size", type=int, default=32, help="samples per rank per step" + default)
    add("--lr", type=float, default=0.2, help="SGD learning rate" + default)
    add("--momentum", type=float, default=0.9, help="SGD momentum" + default)
    add("--seed", type=int, default=0, help="seeds the split, the weights and the shuffles" + default)
    add("--backend", choices=("threads", "shm"), default="threads", help="where the ranks run" + default)
    add("--nproc", type=int, help="processes for --backend shm (default: --world-size)")
    add("--check", action="store_true", help="also train one process on the union batch and compare")
    add("--json", action="store_true", help="print the summary as one JSON line")
    args = parser.parse_args(argv)
    world_size = args.nproc if args.backend == "shm" and args.nproc is not None else args.world_size
    if world_size < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--world-size/--nproc, --epochs and --batch-size must be >= 1")
    return Config(
        world_size=world_size,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        backend=args.backend,
        check=args.check,
        json=args.json,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    data = load_digits_split(cfg.seed)  # before launching anything, so a missing sklearn fails once
    if cfg.backend == "shm":
        if _LAUNCHED_ENV not in os.environ:
            return launch_shm(cfg.world_size, argv)
        return run_shm_worker(cfg, data)
    summary = spawn(train, cfg.world_size, cfg, data)[0]
    assert summary is not None  # rank 0 always returns the summary
    return finish(summary, cfg)


if __name__ == "__main__":
    sys.exit(main())
