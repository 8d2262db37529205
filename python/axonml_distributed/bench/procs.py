"""Multi-process benchmark: our shm backend against mpi4py (MPI shared memory) and torch gloo.

``python -m axonml_distributed.bench.procs [--ranks 2,4] [--max-mib 64] [--colls all_reduce,...]
[--busy]`` (also reached as ``python -m axonml_distributed.bench --backend shm``) runs float32 all_reduce
(SUM, in place), broadcast, all_gather and reduce_scatter (with ``--colls``, also all_to_all and
all_gather_v with equal counts; ``python -m axonml_distributed.bench --collectives`` runs those two and
all_gather) through: our "shm" backend on ordinary numpy
arrays and on arrays from ``pg.empty`` (in the segment), mpi4py under mpiexec (the one beside the running
Python first, as the PyPI ``mpich`` wheel installs it, then the one on PATH), and torch.distributed gloo
with ``--peers mpi,gloo``, all in the same run; a peer that cannot be measured is named, with why.
``--busy`` runs every launch twice, once alone and once with one CPU-bound process alongside, and adds
the busy tables, with each figure's worst busy launch against its quiet median. ``--compare-python PY``
also runs our workers under another interpreter (an older build, labelled "base"), interleaved.
Each table also shows the copy bound (``numpy copy``: every rank copying, with numpy, the bytes it must
bring in from its peers) and, per peer, the peer's time over it: the best ratio against that peer that a
collective copying each byte once could show on this machine. Figures and sizes are described in
`bench.procs_worker`; busbw as nccl-tests define it.

The two routes of private arrays, measured. The shm world moves ordinary (private) arrays either through
the segment (staged) or straight from process to process by the kernel (crossing); which one a call takes
is the route policy's choice (``rust/algo/route.rs``, with the timings of ``rust/algo/route_times.rs``).
``AXONML_SHM_CMA=0`` forces staging and ``AXONML_SHM_CMA=1`` crossing (for arrays of 64 KiB or more), so
two runs of this bench compare the routes. What the policy rests on, float32, staged against crossing, on
hosts of the design's machine kind (2 cores, a VM):

* 2 ranks, 256 KiB: all_reduce 25 against 39 us and broadcast 17 against 16 on one host; 31 against 25
  and 28 against 9.5 on another; on the first, for seconds to minutes at a time, 80 against 50 and 61
  against 22. No size threshold fits all three, so each member times both routes for calls under
  ``ROUTE_TIMED_BELOW`` and asks for the faster, by the best of its recent samples, not the median: the
  first call of a route after the other is slow, and that once kept a 2-rank all_reduce of 256 KiB
  staging at 32 us for a whole run against 18 crossing.
* 2 ranks, all_reduce 8 MiB (too large to time): 1.34 ms staged against 1.18 crossing, so large calls
  cross.
* 4 ranks on 2 cores (ranks outnumber cores: timings say more about who held a core than about the
  route, so nothing is timed and the size decides): all_gather 16 MiB 4.3-4.8 ms staged against
  5.2-6.2 ms crossing, and broadcast 64 MiB beside a CPU-bound process 19 against 28 ms, so the copy
  collectives stage there; all_reduce on one host 256 KiB 120 against 191 us, 2 MiB about even, 4 MiB
  2.34 against 2.00 ms, on another 256 KiB 73 against 57 us, 1 MiB 355 against 277 us, 2 MiB 737
  against 583 us (reduce_scatter 2 MiB 564 against 485 us), so reductions cross from
  ``CMA_REDUCE_CROWDED`` (2 MiB).
* 2 ranks, all_reduce of torch float32 tensors of 16 and 64 MiB (``bench.peers``, both ranks at real-time
  priority on a machine shared with other jobs): crossing 1.54 and 10.0 ms; staged 2.71 and 12.6 ms;
  staged with the copy into the segment streamed (non-temporal stores) 3.24 and 14.5 ms; vLLM's scheme
  through our staging (each member streams its whole 1 MiB round into its buffer, then reduces every
  member's copy itself) 2.97 and 15.2 ms, about what vLLM itself took in the same runs (2.9-3.1 and
  14.6-15.9 ms). Crossing in tiles of 256 KiB to 1 MiB instead of ``CMA_TILE`` (128 KiB) was slower
  (64 MiB: 12.6-15.9 against 10.8 ms). Without real-time priority, at a load average of about 6 on the 2
  cores, crossing kept its lead: 64 MiB 22-25 ms against vLLM's 57-60 in the same runs, the staged
  schemes 23-126 ms. So large calls keep crossing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from axonml_distributed import settings
from axonml_distributed.bench.common import Curve, csv_ints, csv_names, human
from axonml_distributed.bench.procs_worker import COLLECTIVES, COPY, PAIRWISE, RESULT, busbw_factor
from axonml_distributed.progress import progress

WORKER = str(Path(__file__).with_name("procs_worker.py"))
OURS = ("shm", "shm-segment")
Results = dict[str, dict[str, list[float]]]


def _sizes(max_mib: int) -> list[int]:
    sizes, s = [], 8
    while s <= max_mib << 20:
        sizes.append(s)
        s *= 8 if s < 64 << 20 else 2
    if sizes[-1] != max_mib << 20:
        sizes.append(max_mib << 20)
    return sizes


def find_mpiexec() -> str | None:
    # A venv's bin need not be on PATH, and a system MPI there may not match the one mpi4py loads.
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def launch_workers(cmd: list[str], env: dict[str, str]) -> Any:
    """Run one launch of bench workers; its rank 0 prints the results as one JSON line (returned as it
    decodes). A string says why there are none."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return "timed out after 1800 s"
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    return f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _fmt_time(t: float) -> str:
    if t != t:
        return "n/a"
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print tables per world size (see the module docs); returns 0."""
    return run(argv)[0]


def run(argv: Sequence[str] | None = None) -> tuple[int, list[Curve]]:
    """`main`, also returning what was measured, for the chart.

    Also the target of ``python -m axonml_distributed.bench --backend shm``, which passes its whole
    command line: ``--backend``, ``--ranks``, ``--sizes`` and ``--json`` are understood, its DDP options
    do not apply here and are ignored.
    """
    p = argparse.ArgumentParser(prog="axonml-bench-procs", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", "--nproc", type=csv_ints, default=[2], help="world sizes, e.g. 2,4 (default 2)")
    p.add_argument("--sizes", type=csv_ints, help="message bytes per rank, e.g. 8,67108864 (default below)")
    p.add_argument("--max-mib", type=int, default=64, help="default sizes: 8 B to this many MiB (default 64)")
    p.add_argument(
        "--colls",
        type=csv_names,
        default=list(COLLECTIVES),
        help=f"comma-separated collectives: {', '.join(COLLECTIVES + PAIRWISE)} (default the first four)",
    )
    p.add_argument("--peers", type=csv_names, default=["mpi"], help="peers to run, of mpi,gloo (default mpi)")
    p.add_argument("--repeat", type=int, default=3, help="launches per peer, alternating (default 3)")
    p.add_argument("--busy", action="store_true", help="also run every launch beside a CPU-bound process")
    p.add_argument("--compare-python", help="also run our workers with this Python (an older build)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--backend", choices=["shm"], default="shm", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    sizes = sorted({max(4, s // 4 * 4) for s in args.sizes}) if args.sizes else _sizes(args.max_mib)
    colls = args.colls
    if bad := set(colls) - set(COLLECTIVES + PAIRWISE):
        p.error(f"unknown collectives {sorted(bad)}; choose from {', '.join(COLLECTIVES + PAIRWISE)}")
    if rest:
        print(f"[bench.procs] ignoring options that do not apply here: {' '.join(rest)}", file=sys.stderr)
    report = {n: _compare(n, sizes, colls, args) for n in args.ranks}
    if args.json:
        print(json.dumps({"sizes": sizes, "results": report}))
    return 0, curves(sizes, report)


def curves(sizes: list[int], report: dict[int, Results]) -> list[Curve]:
    """`run`'s medians per world size as curves; a busy run's labels are "busy:<label>"."""
    out = []
    for n, medians in report.items():
        for key, per in medians.items():
            busy, label = key.startswith("busy:"), key.removeprefix("busy:")
            kind = "ours" if label.startswith(("shm", "base")) else "bound" if label == COPY else "peer"
            for coll, times in per.items():
                done = [(s, t) for s, t in zip(sizes, times, strict=True) if t == t]  # nan: not measured
                setting = "beside a CPU-bound process" if busy else ""
                out.append(
                    Curve(label, kind, coll, n, [s for s, _ in done], [t for _, t in done], setting=setting)
                )
    return out


def _launches(n: int, sizes: list[int], colls: list[str], args: argparse.Namespace) -> dict[str, list[str]]:
    """The command of every peer that can run here; a peer that cannot is said so on stderr."""
    job = ["--sizes", ",".join(map(str, sizes)), "--colls", ",".join(colls)]
    ours = [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", str(n), WORKER, "shm", *job]
    launches = {"shm": ours}
    if args.compare_python:
        base = [args.compare_python, "-m", "axonml_distributed.run", "--nproc-per-node", str(n), WORKER]
        launches["base"] = [*base, "shm", *job, "--label", "base"]
    peers = args.peers
    mpiexec = find_mpiexec()
    if "mpi" in peers:
        if mpiexec and _have("mpi4py"):
            launches["mpi"] = [mpiexec, "-n", str(n), sys.executable, WORKER, "mpi", *job]
        else:
            missing = "mpi4py" if mpiexec else "mpiexec (not beside this Python nor on PATH)"
            print(f"[bench] MPI not measured: {missing} not found", file=sys.stderr)
    if "gloo" in peers:
        if _have("torch"):
            launches["gloo"] = [*ours[:5], WORKER, "gloo", *job]
        else:
            print("[bench] torch gloo not measured: torch is not installed", file=sys.stderr)
    return launches


def _compare(n: int, sizes: list[int], colls: list[str], args: argparse.Namespace) -> Results:
    """Run every peer on `n` ranks, `args.repeat` times in turn, print the tables; returns the medians."""
    arena_mib = 2 * (max(sizes) >> 20) + 16
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env[settings.SHM_ARENA_MB] = str(arena_mib)
    launches = _launches(n, sizes, colls, args)
    # Peers take turns, `--repeat` times, so a burst of load on a shared machine hits all of them alike;
    # each figure is the median over the repeats.
    runs: dict[str, dict[str, dict[str, list[list[float]]]]] = {"quiet": {}, "busy": {}}
    loads: dict[str, list[float]] = {"quiet": [], "busy": []}
    failed: dict[str, str] = {}
    modes = ("quiet", "busy") if args.busy else ("quiet",)
    with progress(args.repeat * len(launches) * len(modes), f"bench (shm, {n} ranks)") as bar:
        for _ in range(args.repeat):
            for peer, cmd in launches.items():
                for mode in modes:
                    hog = _hog() if mode == "busy" else None
                    try:
                        loads[mode].append(os.getloadavg()[0])
                        got = launch_workers(cmd, env)
                    finally:
                        if hog is not None:
                            hog.kill()
                            hog.wait()
                    bar.update(1)
                    if isinstance(got, str):
                        failed[peer] = got
                        continue
                    for label, per in got.items():
                        for coll, times in per.items():
                            runs[mode].setdefault(label, {}).setdefault(coll, []).append(times)
    for peer, why in failed.items():
        print(f"[bench] {peer} not measured in every launch: {why}", file=sys.stderr)
    if not runs["quiet"].get("shm"):
        raise SystemExit("the shm benchmark failed")
    medians = {
        mode: {label: {c: _median(v) for c, v in per.items()} for label, per in r.items()}
        for mode, r in runs.items()
    }
    for mode in medians:
        if not loads[mode]:
            continue
        beside = ", one CPU-bound process alongside" if mode == "busy" else ""
        lo, hi = min(loads[mode]), max(loads[mode])
        print(f"\n{mode}: load average during the runs {lo:.2f}..{hi:.2f} ({os.cpu_count()} CPUs){beside}")
        for coll in colls:
            worst = _worst_over_quiet(runs, medians, coll) if mode == "busy" else {}
            _table(n, sizes, coll, mode, args.repeat, medians[mode], worst)
    return medians["quiet"] | {f"busy:{k}": v for k, v in medians["busy"].items()}


def _median(launches: list[list[float]]) -> list[float]:
    return [float(np.median(col)) for col in zip(*launches, strict=True)]


def _worst_over_quiet(runs: dict, medians: dict, coll: str) -> dict[str, list[float]]:
    """Per label, each size's slowest busy launch divided by its quiet median."""
    out = {}
    for label, per in runs["busy"].items():
        quiet = medians["quiet"].get(label, {}).get(coll)
        if quiet and coll in per:
            out[label] = [max(col) / q for col, q in zip(zip(*per[coll], strict=True), quiet, strict=True)]
    return out


def _hog() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _table(
    n: int, sizes: list[int], coll: str, mode: str, repeat: int, res: Results, worst: dict[str, list[float]]
) -> None:
    labels = [k for k in res if coll in res[k]]
    ours = [k for k in labels if k.startswith(("shm", "base"))]
    others = [k for k in labels if k not in ours and k != COPY]
    bound = [o for o in others if COPY in labels]
    print(
        f"float32 {coll}, {n} ranks ({mode}); time = max over ranks of the median op (median of {repeat} "
        f"launches); busbw as nccl-tests; ratio = peer time / our time"
        + (
            f"; bound = peer time / {COPY} time, the best ratio a copy-once collective could show"
            if bound
            else ""
        )
        + ("; worst = slowest busy launch / quiet median" if worst else "")
    )
    head = f"{'size':>8} | " + " | ".join(f"{k:>22}" for k in labels)
    head += "".join(f" | {o[:14] + ' / ' + k:>26}" for k in ours for o in others)
    head += "".join(f" | {'bound ' + o[:14]:>20}" for o in bound)
    head += "".join(f" | {'worst ' + k:>17}" for k in worst)
    print(head)
    print("-" * len(head))
    f = busbw_factor(coll, n)
    for i, s in enumerate(sizes):
        cells = [f"{_fmt_time(t := res[k][coll][i]):>10} {s / t * f / 1e9:>7.2f} GB/s" for k in labels]
        ratios = [f"{res[o][coll][i] / res[k][coll][i]:>25.2f}x" for k in ours for o in others]
        ratios += [f"{res[o][coll][i] / res[COPY][coll][i]:>19.2f}x" for o in bound]
        slow = [f"{w[i]:>16.2f}x" for w in worst.values()]
        print(f"{human(s):>8} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios + slow))


if __name__ == "__main__":
    sys.exit(main())
