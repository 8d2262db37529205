"""Train a small MLP on handwritten digits across several ranks, and show what the parallelism cost.

    python -m axonml_distributed.demo                         # 4 ranks as threads of this process
    python -m axonml_distributed.demo --check                 # also compare with one process, union batch
    python -m axonml_distributed.demo --backend shm --nproc 2  # 2 processes over shared memory
    python -m axonml_distributed.demo --scaling --plot demo.png # samples/s at 1, 2, 4 ranks; a chart

``--plot PATH`` writes one PNG (the ``plot`` extra, matplotlib): loss and accuracy per epoch side by side
and, with ``--scaling``, a third panel of samples per second against ranks (see demo.chart).
``--scaling`` (threads only) also trains at 1, 2 and 4 ranks of the in-process world, the same epochs
and per-rank batch, and prints their throughput (see demo.scaling).

Each rank trains on its own DistributedSampler shard; DistributedDataParallel averages the gradients after
every backward pass, so all ranks take the same SGD step and end with identical parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from axonml_distributed import settings
from axonml_distributed.demo import scaling
from axonml_distributed.demo.train import Config, Digits, load_digits_split, train
from axonml_distributed.spawn import spawn

# |param diff| allowed between DDP and one process on the union batch: the two sum the same float32
# gradients in a different order, and those rounding differences compound over the steps.
CHECK_TOLERANCE = 1e-4


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
    if "scaling" in summary:
        lines += ["scaling         samples per second of the same training, in-process world:"]
        lines += [f"                {line}" for line in scaling.table(summary["scaling"])]
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
    if cfg.plot is not None:
        from axonml_distributed.demo import chart

        chart.draw(summary, cfg.plot)
        print(f"chart: {cfg.plot}", file=sys.stderr)  # stderr: --json keeps stdout one JSON line
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
    add("--plot", type=Path, help="draw loss and accuracy per epoch (and --scaling) to this PNG")
    add("--scaling", action="store_true", help="also measure samples/s at 1, 2 and 4 ranks (threads)")
    args = parser.parse_args(argv)
    world_size = args.nproc if args.backend == "shm" and args.nproc is not None else args.world_size
    if world_size < 1 or args.epochs < 1 or args.batch_size < 1:
        parser.error("--world-size/--nproc, --epochs and --batch-size must be >= 1")
    if args.scaling and args.backend != "threads":
        parser.error("--scaling measures in-process worlds: use it with --backend threads")
    if args.plot is not None:
        from axonml_distributed.bench import plot

        plot.pyplot()  # a missing matplotlib is said now, not after the training
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
        plot=args.plot,
        scaling=args.scaling,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    data = load_digits_split(cfg.seed)  # before launching anything, so a missing sklearn fails once
    if cfg.backend == "shm":
        # A worker of axonml-run trains; any other process launches the workers.
        if not settings.launched_by_axonml_run():
            return launch_shm(cfg.world_size, argv)
        return run_shm_worker(cfg, data)
    summary = spawn(train, cfg.world_size, cfg, data)[0]
    assert summary is not None  # rank 0 always returns the summary
    if cfg.scaling:
        summary["scaling"] = scaling.measure(cfg, data)
    return finish(summary, cfg)
