"""Multi-process all_reduce benchmark: our shm backend against mpi4py (MPI shared memory) and torch gloo.

``python -m axonml_distributed.bench_procs [--nproc 2] [--max-mib 64]`` runs float32 all_reduce (SUM, in
place) from 8 B to 64 MiB per rank through: our "shm" backend on ordinary numpy arrays and on arrays from
``pg.empty`` (in the segment), mpi4py ``Allreduce(IN_PLACE)`` under mpiexec when mpi4py and an MPI are
installed, and torch.distributed gloo when torch is installed, all in the same run. Each op is timed on its
own; a figure is the max over ranks of each rank's median. algbw = S / t, busbw = algbw * 2(n-1)/n (the
nccl-tests definitions). Results are checked once per size before timing.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_RESULT = "BENCH-RESULT "


def _sizes(max_mib: int) -> list[int]:
    sizes, s = [], 8
    while s <= max_mib << 20:
        sizes.append(s)
        s *= 8 if s < 64 << 20 else 2
    if sizes[-1] != max_mib << 20:
        sizes.append(max_mib << 20)
    return sizes


def _iters(size: int) -> int:
    return max(10, min(2000, (400 << 20) // max(size, 1)))


def _time(op: Callable[[], Any], size: int, barrier: Callable[[], Any]) -> float:
    """Median seconds of individually timed ops, after a warm-up (which also faults pages in)."""
    for _ in range(3 if size > 1 << 20 else 50):
        op()
    barrier()
    times = []
    for _ in range(_iters(size)):
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    barrier()
    return float(np.median(times))


def _fill(a: np.ndarray, rank: int) -> None:
    a[:] = np.arange(a.size, dtype=np.float32) % 7 + rank


def _check(a: np.ndarray, n: int) -> None:
    want = (np.arange(a.size, dtype=np.float32) % 7) * n + n * (n - 1) / 2
    if not np.array_equal(a, want):
        raise SystemExit(f"wrong all_reduce result for {a.nbytes} bytes")


def _worker_shm(sizes: list[int]) -> None:
    from axonml_distributed.shm import init_shm_process_group

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg = init_shm_process_group(rank, n, 120)
    out: dict[str, list[float]] = {"shm": [], "shm-segment": []}
    for size in sizes:
        for name, a in (
            ("shm", np.empty(size // 4, np.float32)),
            ("shm-segment", pg.empty(size // 4, np.float32)),
        ):
            _fill(a, rank)
            pg.all_reduce(a)
            _check(a, n)
            t = _time(functools.partial(pg.all_reduce, a), size, pg.barrier)
            worst = np.empty(n, np.float64)
            pg.all_gather(np.array([t]), worst)
            out[name].append(float(worst.max()))
            del a
    if rank == 0:
        print(_RESULT + json.dumps(out), flush=True)


def _worker_mpi(sizes: list[int]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    res = []
    for size in sizes:
        a = np.empty(size // 4, np.float32)
        _fill(a, rank)
        comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
        _check(a, n)
        t = _time(functools.partial(comm.Allreduce, MPI.IN_PLACE, a, MPI.SUM), size, comm.Barrier)
        res.append(max(comm.allgather(t)))
    if rank == 0:
        print(_RESULT + json.dumps({"mpi4py " + MPI.Get_library_version().split()[0]: res}), flush=True)


def _worker_gloo(sizes: list[int]) -> None:
    # Imported by name: torch is optional, and without it there are no types to check against.
    torch: Any = importlib.import_module("torch")
    dist: Any = importlib.import_module("torch.distributed")

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    res = []
    for size in sizes:
        a = np.empty(size // 4, np.float32)
        _fill(a, rank)
        dist.all_reduce(torch.from_numpy(a))
        _check(a, n)
        t = _time(functools.partial(dist.all_reduce, torch.from_numpy(a)), size, dist.barrier)
        worst = [0.0] * n
        dist.all_gather_object(worst, t)
        res.append(max(worst))
    if rank == 0:
        print(_RESULT + json.dumps({"torch-gloo": res}), flush=True)


def _launch(cmd: list[str], env: dict[str, str]) -> dict[str, list[float]]:
    """Run one peer's workers; its rank 0 prints the results as one JSON line."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT):
            result: dict[str, list[float]] = json.loads(line[len(_RESULT) :])
            return result
    print(
        f"[bench] {' '.join(cmd[:4])}... failed ({proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr
    )
    return {}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _fmt_size(s: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s >= div:
            return f"{s // div} {unit}"
    return f"{s} B"


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print one table per size range (see the module docs)."""
    p = argparse.ArgumentParser(prog="axonml-bench-procs", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--max-mib", type=int, default=64, help="largest message per rank in MiB (default 64)")
    p.add_argument(
        "--peers", default="mpi,gloo", help="comma-separated peers to run if installed (mpi, gloo)"
    )
    p.add_argument("--repeat", type=int, default=3, help="launches per peer, alternating (default 3)")
    p.add_argument("--worker", choices=["shm", "mpi", "gloo"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = _sizes(args.max_mib)
    if args.worker:
        {"shm": _worker_shm, "mpi": _worker_mpi, "gloo": _worker_gloo}[args.worker](sizes)
        return
    n = args.nproc
    me = ["-m", "axonml_distributed.bench_procs", "--max-mib", str(args.max_mib), "--worker"]
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONML_SHM_ARENA_MB=str(2 * args.max_mib + 16))
    run = [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", str(n)]
    launches = [[*run, *me, "shm"]]
    peers = args.peers.split(",")
    mpiexec = shutil.which("mpiexec")
    if "mpi" in peers and mpiexec and _have("mpi4py"):
        launches.append([mpiexec, "-n", str(n), sys.executable, *me, "mpi"])
    if "gloo" in peers and _have("torch"):
        launches.append([*run, *me, "gloo"])
    # Peers take turns, `--repeat` times, so a burst of load on a shared machine hits all of them alike;
    # each figure is the median over the repeats.
    runs: dict[str, list[list[float]]] = {}
    loads = []
    for _ in range(args.repeat):
        for cmd in launches:
            loads.append(os.getloadavg()[0])
            for k, v in _launch(cmd, dict(env, GLOO_SOCKET_IFNAME="lo")).items():
                runs.setdefault(k, []).append(v)
    if not runs.get("shm"):
        raise SystemExit("the shm benchmark failed")
    results = {k: [float(np.median(col)) for col in zip(*v, strict=True)] for k, v in runs.items()}
    print(f"load average during the runs: {min(loads):.2f}..{max(loads):.2f} (for {os.cpu_count()} CPUs)")
    ours = ["shm", "shm-segment"]
    others = [k for k in results if k not in ours]
    print(
        f"float32 all_reduce, {n} ranks, in place; time = max over ranks of the median op (median of "
        f"{args.repeat} launches); busbw = 2(n-1)/n S/t; ratio = peer time / our time"
    )
    head = f"{'size':>8} | " + " | ".join(f"{k:>22}" for k in results)
    head += "".join(f" | {o + ' / ' + k:>30}" for k in ours for o in others)
    print(head)
    print("-" * len(head))
    for i, s in enumerate(sizes):
        cells = []
        for k in results:
            t = results[k][i]
            cells.append(f"{_fmt_time(t):>10} {s / t * 2 * (n - 1) / n / 1e9:>7.2f} GB/s")
        ratios = [f"{results[o][i] / results[k][i]:>29.2f}x" for k in ours for o in others]
        print(f"{_fmt_size(s):>8} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios))


if __name__ == "__main__":
    main()
