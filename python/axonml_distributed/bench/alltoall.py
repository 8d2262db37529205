"""all_to_all and all_gather_v across processes: our shm backend against mpi4py on MPICH, in the same run.

``python -m axonml_distributed.bench.alltoall [--ranks 2,4] [--mib 64]`` (also reached as
``python -m axonml_distributed.bench --collectives``) times, per rank S bytes of float32:

- all_to_all (send S, recv S) against mpi4py ``Alltoall``;
- all_gather_v with equal counts (S / n from each rank, recv S) against our all_gather of the same
  bytes and against mpi4py ``Allgatherv``;

ours on ordinary numpy arrays and on arrays from ``pg.empty`` (in the segment). A figure is the max over
ranks of each rank's median op (see `bench.procs`); results are checked once before timing. The ratios
are MPICH's time over ours (> 1: we are faster) and all_gather_v's over all_gather's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from axonml_distributed.bench.common import human
from axonml_distributed.bench.procs import _csv_ints, _fmt_time, _have, _launch, find_mpiexec
from axonml_distributed.bench.procs_worker import RESULT, median_time


def _inputs(size: int, n: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s all_to_all send (part j = j + rank * n) and its all_gather piece (rank)."""
    count = size // 4 // n
    send = (np.arange(n, dtype=np.float32) + rank * n).repeat(count)
    return send, np.full(count, rank, np.float32)


def _check(op: str, recv: np.ndarray, n: int, rank: int) -> None:
    count = recv.size // n
    want = np.arange(n, dtype=np.float32) * n + rank if op == "all_to_all" else np.arange(n, dtype=np.float32)
    if not np.array_equal(recv, want.repeat(count)):
        raise SystemExit(f"wrong {op} result for {recv.nbytes} bytes")


def _gather_v(pg: Any, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
    pg.all_gather_v(send, recv, counts)


def _allgatherv(comm: Any, send: np.ndarray, recv: np.ndarray, counts: list[int], displs: list[int]) -> None:
    from mpi4py import MPI

    comm.Allgatherv(send, [recv, (counts, displs), MPI.FLOAT])


def _worker_shm(sizes: list[int]) -> None:
    from axonml_distributed.shm import init_shm_process_group

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg = init_shm_process_group(rank, n, 120)
    out: dict[str, list[float]] = {}
    for size in sizes:
        for where, alloc in (("", np.empty), (" segment", pg.empty)):
            send, piece = _inputs(size, n, rank)
            counts = [piece.size] * n
            ops: dict[str, tuple[np.ndarray, np.ndarray, Callable[..., Any]]] = {
                "all_to_all": (send, alloc(send.size, np.float32), pg.all_to_all),
                "all_gather": (piece, alloc(n * piece.size, np.float32), pg.all_gather),
                "all_gather_v": (
                    piece,
                    alloc(n * piece.size, np.float32),
                    functools.partial(_gather_v, pg, counts=counts),
                ),
            }
            for op, (src, recv, call) in ops.items():
                mine = alloc(src.size, np.float32)
                mine[...] = src
                call(mine, recv)
                _check(op, recv, n, rank)
                t = median_time(functools.partial(call, mine, recv), size, pg.barrier)
                worst = np.empty(n, np.float64)
                pg.all_gather(np.array([t]), worst)
                out.setdefault(f"ours {op}{where}", []).append(float(worst.max()))
                del mine, recv
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)


def _worker_mpi(sizes: list[int]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    out: dict[str, list[float]] = {}
    for size in sizes:
        send, piece = _inputs(size, n, rank)
        counts = [piece.size] * n
        displs = [i * piece.size for i in range(n)]
        ops: dict[str, tuple[np.ndarray, np.ndarray, Callable[..., Any]]] = {
            "all_to_all": (send, np.empty_like(send), lambda s, r: comm.Alltoall(s, r)),
            "all_gather_v": (
                piece,
                np.empty(n * piece.size, np.float32),
                functools.partial(_allgatherv, comm, counts=counts, displs=displs),
            ),
        }
        for op, (src, recv, call) in ops.items():
            call(src, recv)
            _check(op, recv, n, rank)
            t = median_time(functools.partial(call, src, recv), size, comm.Barrier)
            out.setdefault(f"mpich {op}", []).append(max(comm.allgather(t)))
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)


def _compare(n: int, sizes: list[int], repeat: int) -> dict[str, list[float]]:
    me = ["-m", "axonml_distributed.bench.alltoall", "--sizes", ",".join(map(str, sizes)), "--worker"]
    arena_mib = 4 * (max(sizes) >> 20) + 16
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONML_SHM_ARENA_MB=str(arena_mib))
    launches = [[sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", str(n), *me, "shm"]]
    mpiexec = find_mpiexec()
    if mpiexec and _have("mpi4py"):
        launches.append([mpiexec, "-n", str(n), sys.executable, *me, "mpi"])
    else:
        print("[bench] MPICH not measured: no mpiexec or no mpi4py", file=sys.stderr)
    runs: dict[str, list[list[float]]] = {}
    for _ in range(repeat):
        for cmd in launches:
            got = _launch(cmd, env)
            if isinstance(got, str):
                print(f"[bench] {cmd[0]} ... not measured: {got}", file=sys.stderr)
                continue
            # This bench's workers print one flat list of times per name.
            for k, v in cast(dict[str, list[float]], got).items():
                runs.setdefault(k, []).append(v)
    res = {k: [float(np.median(col)) for col in zip(*v, strict=True)] for k, v in runs.items()}
    load = os.getloadavg()[0]
    print(f"\n{n} ranks, float32, S bytes per rank (median of {repeat} launches; load average {load:.2f})")
    for i, s in enumerate(sizes):
        print(f"{human(s):>8}:")
        for op in ("all_to_all", "all_gather_v"):
            peer = res.get(f"mpich {op}", [None] * len(sizes))[i]
            for where in ("", " segment"):
                ours = res.get(f"ours {op}{where}")
                if ours is None:
                    continue
                line = f"  {op + where:>22}: {_fmt_time(ours[i]):>10}"
                if peer is not None:
                    line += f" | MPICH {_fmt_time(peer):>10} | MPICH / ours {peer / ours[i]:5.2f}x"
                if op == "all_gather_v":
                    base = res[f"ours all_gather{where}"][i]
                    line += f" | all_gather {_fmt_time(base):>10} | v / plain {ours[i] / base:5.2f}x"
                print(line)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="axonml-bench-alltoall", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=_csv_ints, default=[2, 4], help="world sizes (default 2,4)")
    p.add_argument("--sizes", type=_csv_ints, help="bytes per rank (default: 1 MiB and --mib)")
    p.add_argument("--mib", type=int, default=64, help="the largest size, in MiB (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="launches per peer, alternating (default 3)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--worker", choices=["shm", "mpi"], help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)
    # Whole float32 parts for every world size asked for (and 4 ranks).
    unit = 4 * int(np.lcm.reduce([*args.ranks, 4]))
    sizes = args.sizes or [1 << 20, args.mib << 20]
    sizes = sorted({max(unit, s // unit * unit) for s in sizes})
    if args.worker:
        {"shm": _worker_shm, "mpi": _worker_mpi}[args.worker](sizes)
        return 0
    report = {n: _compare(n, sizes, args.repeat) for n in args.ranks}
    if args.json:
        print(json.dumps({"sizes": sizes, "results": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
