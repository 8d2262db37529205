"""One rank of one peer in the multi-process benchmark (`bench.procs`): times the bulk collectives and
prints, on rank 0, one line ``BENCH-RESULT {label: {collective: [seconds per size]}}``.

Run as a script, ``python procs_worker.py shm|mpi|gloo --sizes ... --colls ...`` under the peer's
launcher. It imports nothing else of the bench, so an older build of the package can run this file and
be compared with the current one in the same run (``bench.procs --compare-python``).

A size is the bytes of the larger buffer, as nccl-tests count it: the message of all_reduce and
broadcast, all_gather's and all_gather_v's output (all_gather_v with equal counts), reduce_scatter's
input, all_to_all's send (and receive); each rank's part is size / n. Each op is timed
on its own after a warm-up; a figure is the max over ranks of each rank's median. Every result is
checked once per size before timing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

RESULT = "BENCH-RESULT "
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
# The collectives of issue 13 this bench also runs (`--colls`, and `bench --collectives`).
PAIRWISE = ("all_to_all", "all_gather_v")


# The label of the copy bound: a numpy copy, on every rank at once (but a broadcast's root, which brings
# nothing in), of the bytes each rank must bring into its output (`copy_bytes`). A collective that
# copies each byte once cannot beat it, so a peer's time over it is the best ratio any implementation
# could show against that peer on this machine.
COPY = "numpy copy"


def busbw_factor(coll: str, n: int) -> float:
    """busbw / algbw as nccl-tests define it: 2(n-1)/n for all_reduce, 1 for broadcast, (n-1)/n for the
    others (all_gather, reduce_scatter, all_to_all), so busbw compares with a link's rate whatever the
    collective and the world size."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(coll, (n - 1) / n)


def copy_bytes(coll: str, size: int, n: int, rank: int) -> int:
    """What rank `rank` must bring into its output: what it receives from its peers (busbw factor x
    size, as nccl-tests count it), and for all_gather, which is out of place here, its own part too."""
    if coll == "broadcast" and rank == 0:
        return 0
    return size if coll == "all_gather" else int(busbw_factor(coll, n) * size)


def iterations(size: int, cap: int = 1000) -> int:
    return max(5, min(cap, (100 << 20) // max(size, 1)))


def median_time(op: Callable[[], Any], size: int, barrier: Callable[[], Any], cap: int = 1000) -> float:
    """Median seconds of individually timed ops (at most `cap` of them, at least 5), after a warm-up
    (which also faults pages in)."""
    for _ in range(2 if size > 1 << 20 else 20):
        op()
    barrier()
    times = []
    for _ in range(iterations(size, cap)):
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    barrier()
    return float(np.median(times))


def copy_time(nbytes: int, barrier: Callable[[], Any]) -> float:
    """Median seconds of a numpy copy of `nbytes` between two private arrays (see COPY); with none to
    copy, about 0, after the same barriers as the ranks that copy. Both arrays start on a page: wherever
    malloc puts them, a destination 16 bytes past its source (mod 4096) copies up to 12x slower, and
    the bound is the best copy."""
    src, dst = page_aligned(nbytes // 4), page_aligned(nbytes // 4)
    src[:] = 1
    return median_time(lambda: np.copyto(dst, src), nbytes, barrier)


def page_aligned(count: int) -> np.ndarray:
    """`count` float32 starting on a 4096-byte boundary."""
    raw = np.empty(count * 4 + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start : start + count * 4].view(np.float32)


def pattern(count: int) -> np.ndarray:
    return np.arange(count, dtype=np.float32) % 7


class Case:
    """The buffers of one collective at one size on one rank, filled so the result can be checked."""

    def __init__(self, coll: str, size: int, rank: int, n: int, alloc: Callable[[int], np.ndarray]):
        self.coll, self.rank, self.n = coll, rank, n
        count = max(n, size // 4 // n * n)
        part = count // n
        gathers = coll in ("all_gather", "all_gather_v")
        self.send = alloc(part if gathers else count)
        self.recv = alloc(count) if gathers or coll == "all_to_all" else alloc(part)
        if coll in ("all_reduce", "broadcast"):
            self.recv = self.send
        self.count, self.part = count, part

    def fill(self) -> None:
        self.send[:] = pattern(self.send.size) + self.rank

    def check(self) -> None:
        n, me, part = self.n, self.rank, self.part
        if self.coll == "all_reduce":
            want = pattern(self.count) * n + n * (n - 1) / 2
        elif self.coll == "broadcast":
            want = pattern(self.count)
        elif self.coll in ("all_gather", "all_gather_v"):
            want = np.concatenate([pattern(part) + j for j in range(n)])
        elif self.coll == "all_to_all":
            want = np.concatenate([pattern(self.count)[me * part : (me + 1) * part] + j for j in range(n)])
        else:
            want = pattern(self.count)[me * part : (me + 1) * part] * n + n * (n - 1) / 2
        if not np.array_equal(self.recv, want.astype(np.float32)):
            raise SystemExit(f"wrong {self.coll} result for {self.recv.nbytes} bytes")


def sweep(
    label: str,
    sizes: list[int],
    colls: list[str],
    rank: int,
    n: int,
    kinds: dict[str, Callable[[int], np.ndarray]],
    calls: dict[str, Callable[[Case], Callable[[], Any]]],
    barrier: Callable[[], Any],
    worst: Callable[[float], float],
    copy_bound: bool = False,
) -> None:
    out: dict[str, dict[str, list[float]]] = {}
    for kind, alloc in kinds.items():
        per: dict[str, list[float]] = {}
        for coll in colls:
            per[coll] = []
            for size in sizes:
                case = Case(coll, size, rank, n, alloc)
                if coll not in calls:
                    per[coll].append(math.nan)  # this peer has no such collective
                    continue
                try:
                    op = calls[coll](case)
                    case.fill()
                    op()
                except (RuntimeError, ValueError, NotImplementedError):
                    per[coll].append(math.nan)  # this peer cannot run this collective
                    continue
                case.check()
                per[coll].append(worst(median_time(op, size, barrier)))
                del case
        out[label + kind] = per
    if copy_bound:

        def bound(coll: str, size: int) -> float:
            return worst(copy_time(copy_bytes(coll, size, n, rank), barrier))

        out[COPY] = {c: [bound(c, s) for s in sizes] for c in colls}
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)


def shm(sizes: list[int], colls: list[str], label: str) -> None:
    from axonml_distributed.shm import init_shm_process_group

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg = init_shm_process_group(rank, n, 120)

    def worst(t: float) -> float:
        every = np.empty(n, np.float64)
        pg.all_gather(np.array([t]), every)
        return float(every.max())

    calls: dict[str, Callable[[Case], Callable[[], Any]]] = {
        "all_reduce": lambda c: lambda: pg.all_reduce(c.send),
        "broadcast": lambda c: lambda: pg.broadcast(c.send, 0),
        "all_gather": lambda c: lambda: pg.all_gather(c.send, c.recv),
        "reduce_scatter": lambda c: lambda: pg.reduce_scatter(c.send, c.recv),
        "all_to_all": lambda c: lambda: pg.all_to_all(c.send, c.recv),
        "all_gather_v": lambda c: lambda: pg.all_gather_v(c.send, c.recv, [c.part] * n),
    }
    kinds = {"": lambda k: np.empty(k, np.float32), "-segment": lambda k: pg.empty(k, np.float32)}
    sweep(label, sizes, colls, rank, n, kinds, calls, pg.barrier, worst, copy_bound=label == "shm")


def mpi(sizes: list[int], colls: list[str], label: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    calls: dict[str, Callable[[Case], Callable[[], Any]]] = {
        "all_reduce": lambda c: lambda: comm.Allreduce(MPI.IN_PLACE, c.send, MPI.SUM),
        "broadcast": lambda c: lambda: comm.Bcast(c.send, 0),
        "all_gather": lambda c: lambda: comm.Allgather(c.send, c.recv),
        "reduce_scatter": lambda c: lambda: comm.Reduce_scatter_block(c.send, c.recv, MPI.SUM),
        "all_to_all": lambda c: lambda: comm.Alltoall(c.send, c.recv),
        "all_gather_v": lambda c: (
            lambda: comm.Allgatherv(
                c.send, [c.recv, ([c.part] * n, [j * c.part for j in range(n)]), MPI.FLOAT]
            )
        ),
    }
    name = "mpi4py " + MPI.Get_library_version().split()[0]
    kinds = {name: lambda k: np.empty(k, np.float32)}
    sweep("", sizes, colls, rank, n, kinds, calls, comm.Barrier, lambda t: max(comm.allgather(t)))


def gloo(sizes: list[int], colls: list[str], label: str) -> None:
    # Imported by name: torch is optional, and without it there are no types to check against.
    torch: Any = importlib.import_module("torch")
    dist: Any = importlib.import_module("torch.distributed")

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.from_numpy

    def worst(x: float) -> float:
        every = [0.0] * n
        dist.all_gather_object(every, x)
        return max(every)

    calls: dict[str, Callable[[Case], Callable[[], Any]]] = {
        "all_reduce": lambda c: lambda: dist.all_reduce(t(c.send)),
        "broadcast": lambda c: lambda: dist.broadcast(t(c.send), 0),
        "all_gather": lambda c: lambda: dist.all_gather_into_tensor(t(c.recv), t(c.send)),
        "reduce_scatter": lambda c: lambda: dist.reduce_scatter_tensor(t(c.recv), t(c.send)),
        "all_to_all": lambda c: lambda: dist.all_to_all_single(t(c.recv), t(c.send)),
    }
    kinds = {"torch-gloo": lambda k: np.empty(k, np.float32)}
    sweep("", sizes, colls, rank, n, kinds, calls, dist.barrier, worst)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("peer", choices=["shm", "mpi", "gloo"])
    p.add_argument("--sizes", required=True)
    p.add_argument("--colls", required=True)
    p.add_argument("--label", default="shm", help="name of our figures (shm peer only)")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    {"shm": shm, "mpi": mpi, "gloo": gloo}[a.peer](sizes, a.colls.split(","), a.label)


if __name__ == "__main__":
    main()
