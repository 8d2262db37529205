"""Multi-process all_reduce benchmark: our shm backend against mpi4py (MPI shared memory) and torch gloo.

``python -m axonml_distributed.bench.procs [--ranks 2,4] [--max-mib 64]`` (also reached as
``python -m axonml_distributed.bench --backend shm``) runs float32 all_reduce (SUM, in place) from 8 B to
64 MiB per rank through: our "shm" backend on ordinary numpy arrays and on arrays from ``pg.empty`` (in
the segment), mpi4py ``Allreduce(IN_PLACE)`` under mpiexec when mpi4py and an MPI are installed, and
torch.distributed gloo when torch is installed, all in the same run. Each op is timed on its own; a
figure is the max over ranks of each rank's median. algbw = S / t, busbw = algbw * 2(n-1)/n (the
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

from axonml_distributed.bench.common import human

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


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print a table per world size (see the module docs); returns 0.

    Also the target of ``python -m axonml_distributed.bench --backend shm``, which passes its whole
    command line: ``--backend``, ``--ranks``, ``--sizes`` and ``--json`` are understood, its DDP options
    do not apply here and are ignored.
    """
    p = argparse.ArgumentParser(prog="axonml-bench-procs", description=__doc__.split("\n")[0])
    p.add_argument(
        "--ranks", "--nproc", type=_csv_ints, default=[2], help="world sizes, e.g. 2,4 (default 2)"
    )
    p.add_argument("--sizes", type=_csv_ints, help="message bytes per rank, e.g. 8,67108864 (default below)")
    p.add_argument("--max-mib", type=int, default=64, help="default sizes: 8 B to this many MiB (default 64)")
    p.add_argument(
        "--peers", default="mpi,gloo", help="comma-separated peers to run if installed (mpi, gloo)"
    )
    p.add_argument("--repeat", type=int, default=3, help="launches per peer, alternating (default 3)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--backend", choices=["shm"], default="shm", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=["shm", "mpi", "gloo"], help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    sizes = sorted({max(4, s // 4 * 4) for s in args.sizes}) if args.sizes else _sizes(args.max_mib)
    if args.worker:
        {"shm": _worker_shm, "mpi": _worker_mpi, "gloo": _worker_gloo}[args.worker](sizes)
        return 0
    if rest:
        print(f"[bench.procs] ignoring options that do not apply here: {' '.join(rest)}", file=sys.stderr)
    report = {n: _compare(n, sizes, args) for n in args.ranks}
    if args.json:
        print(json.dumps({"sizes": sizes, "results": report}))
    return 0


def _compare(n: int, sizes: list[int], args: argparse.Namespace) -> dict[str, list[float]]:
    """Run every peer on `n` ranks, `args.repeat` times in turn, print the table; returns the medians."""
    me = ["-m", "axonml_distributed.bench.procs", "--sizes", ",".join(map(str, sizes)), "--worker"]
    arena_mib = 2 * (max(sizes) >> 20) + 16
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONML_SHM_ARENA_MB=str(arena_mib), GLOO_SOCKET_IFNAME="lo")
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
            for k, v in _launch(cmd, env).items():
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
        print(f"{human(s):>8} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios))
    return results


if __name__ == "__main__":
    sys.exit(main())
