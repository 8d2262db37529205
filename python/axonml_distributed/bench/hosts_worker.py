"""One rank of one contender in the several-hosts bench (`bench.hosts`): times float32 all_reduce (SUM, in
place) per size and, under torch, a DDP training step; rank 0 prints one line ``BENCH-RESULT {key:
seconds}``. A contender that cannot run prints ``BENCH-FAILED <exception>: <message>`` and exits 1, so
the driver can name why and still report the others; ``BENCH-NOTE <text>`` is something the table must
say beside the figures (a backend whose ``dist.barrier`` fails is synchronised by a one-element
all_reduce instead, so its all_reduce and DDP figures are still measured).

    torchrun ... -m axonml_distributed.bench.hosts_worker torch --backend gloo|axonml --sizes ... [--levels]
    mpiexec ... python -m axonml_distributed.bench.hosts_worker mpi --sizes ...

Keys: ``all_reduce S`` (S bytes per rank), ``ddp MODEL`` (the step time of `bench.torch_ddp`'s models),
``shards S`` (``--levels``, torch only: the cross-host level of a hierarchical all_reduce measured with
the backend's own groups: each local rank index's group of one rank per host all-reducing its S/M shard,
every group at once, as the M shards share each host's link), and under MPI ``mpich S`` (mpi4py's
Allreduce) and ``axonml-mpi S`` (our MPI process group). A figure is the max over ranks of each rank's
median op (`procs_worker.median_time`); every all_reduce result is checked once before it is timed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from axonml_distributed.bench.common import csv_ints, csv_names
from axonml_distributed.bench.procs_worker import RESULT, median_time

FAILED = "BENCH-FAILED "
NOTE = "BENCH-NOTE "


def failure(exc: BaseException) -> str:
    """An exception in one line, as the driver prints it."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def count_for(size: int, n: int) -> int:
    """float32 elements of a message of `size` bytes, a multiple of `n` so every shard is whole."""
    return max(n, size // 4 // n * n)


def checked_sweep(
    sizes: list[int],
    make: Callable[[int], Any],
    call: Callable[[Any], Callable[[], Any]],
    value: float,
    want: float,
    barrier: Callable[[], Any],
    worst: Callable[[float], float],
    cap: int,
) -> list[float]:
    """Each size's time, the slowest rank's. `make(size)` is the buffer this rank reduces for a message
    of `size` bytes; filled with `value` on this rank, one call must give `want` everywhere."""
    out = []
    for size in sizes:
        buf = make(size)
        op = call(buf)
        buf[:] = value
        op()
        if not bool((buf == want).all()):
            raise AssertionError(f"all_reduce of {size} bytes is wrong: not {want} everywhere")
        buf[:] = 0  # zeros stay zeros: no overflow over many sums
        out.append(worst(median_time(op, buf.nbytes, barrier, cap)))
    return out


def _barrier(torch: Any, dist: Any, rank: int) -> Callable[[], Any]:
    """dist.barrier, or where the backend's fails, a one-element all_reduce (said in a note). Also
    where a backend that sets up lazily fails: here, not in the first timed call."""
    try:
        dist.barrier()
        return dist.barrier
    except Exception as exc:  # noqa: BLE001 - said, and measured without it
        one = torch.zeros(1)
        dist.all_reduce(one)
        if rank == 0:
            print(
                f"{NOTE}dist.barrier failed ({failure(exc)}): synchronised by a 1-element all_reduce",
                flush=True,
            )
        return lambda: dist.all_reduce(one)


def torch_job(args: argparse.Namespace) -> dict[str, float]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from axonml_distributed.bench.torch_ddp import _time_steps

    if args.backend == "axonml":
        importlib.import_module("axonml_distributed.torch")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    barrier = _barrier(torch, dist, rank)
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])

    def worst(t: float) -> float:
        every = [0.0] * n
        dist.all_gather_object(every, t)
        return max(every)

    def full(size: int) -> Any:
        return torch.empty(count_for(size, n))

    out: dict[str, float] = {}
    everyone = float(sum(range(1, n + 1)))
    times = checked_sweep(
        args.sizes,
        full,
        lambda b: lambda: dist.all_reduce(b),
        rank + 1,
        everyone,
        barrier,
        worst,
        args.max_iters,
    )
    out |= {f"all_reduce {s}": t for s, t in zip(args.sizes, times, strict=True)}
    if args.levels:
        # torchrun numbers ranks host by host: rank = host * per_host + local rank.
        hosts = n // per_host
        groups = [dist.new_group([h * per_host + k for h in range(hosts)]) for k in range(per_host)]
        mine: Any = groups[rank % per_host]  # a ProcessGroup: torch types it with a sentinel

        def shard(size: int) -> Any:
            return torch.empty(count_for(size, n) // per_host)

        times = checked_sweep(
            args.sizes,
            shard,
            lambda b: lambda: dist.all_reduce(b, group=mine),
            rank // per_host + 1,
            float(sum(range(1, hosts + 1))),
            barrier,
            worst,
            args.max_iters,
        )
        out |= {f"shards {s}": t for s, t in zip(args.sizes, times, strict=True)}
    ddp = torch.nn.parallel.DistributedDataParallel
    for name in args.models:
        out[f"ddp {name}"] = worst(_time_steps(torch, name, ddp, lambda m: None, args.steps))
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


def mpi_job(args: argparse.Namespace) -> dict[str, float]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def worst(t: float) -> float:
        return float(max(comm.allgather(t)))

    def full(size: int) -> np.ndarray:
        return np.empty(count_for(size, n), np.float32)

    out: dict[str, float] = {}
    everyone = float(sum(range(1, n + 1)))
    raw = checked_sweep(
        args.sizes,
        full,
        lambda b: lambda: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
        rank + 1,
        everyone,
        comm.Barrier,
        worst,
        args.max_iters,
    )
    out |= {f"mpich {s}": t for s, t in zip(args.sizes, raw, strict=True)}
    try:
        from axonml_distributed.mpi import init_mpi_process_group

        pg = init_mpi_process_group(timeout=args.timeout)
        ours = checked_sweep(
            args.sizes,
            full,
            lambda b: lambda: pg.all_reduce(b),
            rank + 1,
            everyone,
            comm.Barrier,
            worst,
            args.max_iters,
        )
        out |= {f"axonml-mpi {s}": t for s, t in zip(args.sizes, ours, strict=True)}
    except Exception as exc:  # noqa: BLE001 - ours failing must not hide MPICH's figures
        if rank == 0:
            print(FAILED + "axonml-mpi " + failure(exc), flush=True)
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m axonml_distributed.bench.hosts_worker")
    p.add_argument("engine", choices=["torch", "mpi"])
    p.add_argument("--backend", choices=["gloo", "axonml"], default="gloo")
    p.add_argument("--sizes", type=csv_ints, required=True)
    p.add_argument("--models", type=csv_names, default=[])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--levels", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--max-iters", type=int, default=200, help="timed ops per size at most (at least 5)")
    args = p.parse_args(argv)
    try:
        (torch_job if args.engine == "torch" else mpi_job)(args)
    except Exception as exc:  # noqa: BLE001 - any failure: said in one line for the driver's table
        print(FAILED + failure(exc), flush=True)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
