"""The in-process world's benchmark: all_reduce over threads against the memory-traffic bound, and DDP.

For each message size S (bytes per rank) and N ranks it prints the median time per all_reduce (the
slowest rank's), algbw = S/t and busbw = algbw * 2(N-1)/N as nccl-tests define them, and the fraction of
the memory-traffic bound: an in-place all_reduce over buffers every rank can see must read and write
each byte once, 2*N*S bytes, at the machine's copy traffic rate measured now with numpy (read + write,
one copying thread per core). The DDP section times `sync_gradients` on a model of ~25M float32
parameters against one flat all_reduce of the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from axonml_distributed._core import ProcessGroup, ReduceOp
from axonml_distributed.bench.common import Curve, busbw_factor, human
from axonml_distributed.ddp import DistributedDataParallel
from axonml_distributed.progress import progress
from axonml_distributed.spawn import spawn


def copy_traffic_rate(nbytes: int = 64 << 20) -> float:
    """Bytes of memory traffic per second (read + write) of numpy copies, one thread per core."""
    cores = os.cpu_count() or 1
    srcs = [np.ones(nbytes // 4, np.float32) for _ in range(cores)]
    dsts = [np.empty_like(s) for s in srcs]
    best = float("inf")
    for _ in range(5):
        threads = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(dsts, srcs, strict=True)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best = min(best, time.perf_counter() - t)
    return 2 * cores * nbytes / best


def iterations(nbytes: int) -> int:
    """Calls per timed loop: enough to amortise the loop's start without making large sizes slow."""
    return max(2, min(1000, (64 << 20) // max(nbytes, 1)))


def time_op(pg: ProcessGroup, op: Callable[[], Any], iters: int, rounds: int = 5) -> float:
    """Seconds per call on this rank: the median over `rounds` of back-to-back loops of `iters` calls
    (as nccl-tests time them), after a warm-up; the ranks start each loop together."""
    for _ in range(min(iters, 10)):
        op()
    times = []
    for _ in range(rounds):
        pg.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            op()
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def sweep(
    ranks: int, sizes: list[int], timeout: float, done: Callable[[], object] = lambda: None
) -> list[dict[str, float]]:
    """all_reduce (SUM, float32) for every size on a fresh in-process world of `ranks` threads; rank 0
    calls `done` after each size."""

    def rank_fn(pg: ProcessGroup) -> list[float]:
        out = []
        for nbytes in sizes:
            x = np.ones(max(nbytes // 4, 1), np.float32)
            out.append(time_op(pg, functools.partial(pg.all_reduce, x, ReduceOp.SUM), iterations(nbytes)))
            if pg.rank() == 0:
                done()
        return out

    per_rank = spawn(rank_fn, ranks, timeout=timeout)
    return [{"bytes": s, "seconds": max(r[i] for r in per_rank)} for i, s in enumerate(sizes)]


class _Param:
    def __init__(self, n: int, rank: int) -> None:
        self.data = np.zeros(n, np.float32)
        self.grad = np.full(n, float(rank), np.float32)


class _Model:
    """A stand-in with the parameter sizes of a ~25M-parameter network (gradients only matter here)."""

    def __init__(self, total: int, rank: int) -> None:
        sizes = [total // 16] * 15 + [total - 15 * (total // 16)]
        self.params = [_Param(n, rank) for n in sizes]

    def parameters(self) -> list[_Param]:
        return self.params


def ddp_vs_flat(ranks: int, params: int, iters: int, timeout: float) -> dict[str, float]:
    """sync_gradients on a `params`-parameter model vs one flat all_reduce of the same bytes."""

    def rank_fn(pg: ProcessGroup) -> tuple[float, float]:
        ddp = DistributedDataParallel(_Model(params, pg.rank()), pg)
        flat = pg.empty((params,), np.float32)
        flat[...] = 1.0
        t_ddp = time_op(pg, ddp.sync_gradients, iters)
        t_flat = time_op(pg, lambda: pg.all_reduce(flat, ReduceOp.AVERAGE), iters)
        return t_ddp, t_flat

    res = spawn(rank_fn, ranks, timeout=timeout)
    t_ddp, t_flat = max(r[0] for r in res), max(r[1] for r in res)
    return {"ranks": ranks, "params": params, "sync_gradients_s": t_ddp, "flat_all_reduce_s": t_flat}


def run_threads(args: argparse.Namespace) -> dict[str, Any]:
    traffic = copy_traffic_rate()
    print(f"numpy copy traffic rate (read + write, {os.cpu_count()} threads): {traffic / 1e9:.1f} GB/s")
    report: dict[str, Any] = {"copy_traffic_gbps": traffic / 1e9, "all_reduce": [], "ddp": []}
    with progress(len(args.ranks) * (len(args.sizes) + bool(args.ddp_params)), "bench (threads)") as bar:
        for n in args.ranks:
            rows = sweep(n, args.sizes, args.timeout, lambda: bar.update(1))
            print(f"\nall_reduce float32 SUM, {n} ranks (threads)")
            print(f"{'size':>10} {'time':>12} {'algbw GB/s':>11} {'busbw GB/s':>11} {'of bound':>9}")
            for row in rows:
                s, t = row["bytes"], row["seconds"]
                algbw = s / t / 1e9
                bound = 2 * n * s / traffic
                row.update(
                    ranks=n,
                    algbw_gbps=algbw,
                    busbw_gbps=algbw * busbw_factor("all_reduce", n),
                    fraction_of_bound=bound / t,
                )
                report["all_reduce"].append(row)
                busbw = row["busbw_gbps"]
                print(
                    f"{human(int(s)):>10} {t * 1e6:>10.1f}us {algbw:>11.2f} {busbw:>11.2f} {bound / t:>8.0%}"
                )
        if args.ddp_params:
            print(f"\nDDP sync_gradients vs one flat all_reduce, {args.ddp_params:,} float32 parameters")
            for n in args.ranks:
                r = ddp_vs_flat(n, args.ddp_params, args.ddp_iters, args.timeout)
                bar.update(1)
                report["ddp"].append(r)
                ratio = r["sync_gradients_s"] / r["flat_all_reduce_s"]
                print(
                    f"{n} ranks: sync_gradients {r['sync_gradients_s'] * 1e3:.1f} ms, flat all_reduce "
                    f"{r['flat_all_reduce_s'] * 1e3:.1f} ms, ratio {ratio:.2f}x"
                )
    return report


def curves(report: dict[str, Any]) -> list[Curve]:
    """The all_reduce sweep of `run_threads`'s report, per world size: ours and the memory-traffic bound
    (2 N S bytes at the measured copy traffic rate)."""
    traffic = report["copy_traffic_gbps"] * 1e9
    out = []
    for n in dict.fromkeys(r["ranks"] for r in report["all_reduce"]):
        rows = [r for r in report["all_reduce"] if r["ranks"] == n]
        sizes = [int(r["bytes"]) for r in rows]
        out.append(Curve("axonml (threads)", "ours", "all_reduce", n, sizes, [r["seconds"] for r in rows]))
        bound = [2 * n * s / traffic for s in sizes]
        out.append(Curve("memory-traffic bound (numpy copy)", "bound", "all_reduce", n, sizes, bound))
    return out
