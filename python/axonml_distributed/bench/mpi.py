"""all_reduce over MPI: MpiProcessGroup against raw mpi4py on the same buffers, in the same run.

    python -m axonml_distributed.bench --backend mpi [--ranks 2,4] [--sizes 8,67108864] [--json]
    mpiexec -n 2 python -m mpi4py -m axonml_distributed.bench.mpi [--sizes ...]   # inside your own job

Outside an MPI job this launches `mpiexec -n N` for each N in --ranks (the mpiexec beside the Python
interpreter first, as the `mpich` wheel installs it, then the one on PATH). Inside one, for each message
size (float32, SUM, in place) it times three calls on the same buffer, interleaved batch by batch:

- raw:  mpi4py's `comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`, the peer;
- ours: `MpiProcessGroup.all_reduce` with the signature check on (the default);
- ours without the check (`check_signatures=False`), so the check's own cost shows.

It prints the median time per op (the slowest rank's, per batch of back-to-back ops), algbw = S/t and
busbw = algbw * 2(N-1)/N as nccl-tests define them, the ratios ours/raw and the check's cost (medians of
batch-by-batch comparisons). Targets (issue 6): within 1.1x of raw at 64 MiB, within 2x at 8 B.
--ddp-params and --ddp-iters (of the in-process bench) are accepted and ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from axonml_distributed.bench.common import DEFAULT_SIZES, Curve, busbw_factor, csv_ints, human

# Launchers set these in every rank's environment: MPICH's hydra (PMI_*), Open MPI and PMIx-based ones.
MPI_JOB_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
INSTALL_HINT = 'pip install "axonml-distributed[mpi]" (mpi4py and the mpich wheel, which brings mpiexec)'


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m axonml_distributed.bench --backend mpi")
    p.add_argument("--backend", default="mpi", help="accepted for the bench command's sake")
    p.add_argument("--ranks", type=csv_ints, default=[2, 4])
    p.add_argument("--sizes", type=csv_ints, default=DEFAULT_SIZES)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds, per job and per MPI wait")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object at the end")
    p.add_argument("--ddp-params", type=int, help="ignored: no DDP comparison under MPI")
    p.add_argument("--ddp-iters", type=int, help="ignored")
    # Set by the launching process: where rank 0 of the job writes its results for the combined report.
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)
    return args


# What each timed call is, for the chart: label and kind (see `bench.common.Curve`).
VARIANTS = {
    "raw": ("mpi4py Allreduce", "peer"),
    "checked": ("axonml MPI, signature check on", "ours"),
    "unchecked": ("axonml MPI, signature check off", "ours"),
}


def main(argv: list[str] | None = None) -> int:
    return run(argv)[0]


def run(argv: list[str] | None = None) -> tuple[int, list[Curve]]:
    """`main`, also returning what was measured, for the chart (nothing inside a job)."""
    args = parse(argv)
    if any(v in os.environ for v in MPI_JOB_VARIABLES):
        report = run_in_job(args)
        if report is not None and args.report is not None:
            args.report.write_text(json.dumps(report))
        return 0, []
    code, rows = launch_jobs(args)
    return code, curves(rows)


def curves(rows: list[dict[str, Any]]) -> list[Curve]:
    """The report's rows (one per world size and size) as one curve per world size and variant."""
    out = []
    for n in dict.fromkeys(r["ranks"] for r in rows):
        mine = [r for r in rows if r["ranks"] == n]
        sizes = [int(r["bytes"]) for r in mine]
        for name, (label, kind) in VARIANTS.items():
            out.append(Curve(label, kind, "all_reduce", n, sizes, [r[f"{name}_s"] for r in mine]))
    return out


# --- outside MPI: one mpiexec job per rank count ------------------------------------------------------


def find_mpiexec() -> str | None:
    # A venv's bin need not be on PATH, and a system MPI there may not match the one mpi4py loads.
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def launcher_flags(mpiexec: str) -> list[str]:
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    if "Open MPI" not in version.stdout + version.stderr:
        return []
    # Open MPI refuses more ranks than cores, and running as root, unless told.
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def launch_jobs(args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    mpiexec = find_mpiexec()
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        missing = "mpiexec" if mpiexec is None else "mpi4py"
        print(
            f"the MPI benchmark needs mpi4py and mpiexec; {missing} was not found: {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2, []
    flags = launcher_flags(mpiexec)
    rows: list[dict[str, Any]] = []
    header: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            report = Path(tmp) / f"ranks{n}.json"
            # `-m mpi4py` turns an exception on any rank into MPI_Abort, so a failing job ends at once.
            python = [sys.executable, "-m", "mpi4py", "-m", "axonml_distributed.bench.mpi"]
            job_args = ["--sizes", ",".join(map(str, args.sizes)), "--timeout", str(args.timeout)]
            code = run_job([mpiexec, *flags, "-n", str(n), *python, *job_args, "--report", str(report)], args)
            if code != 0:
                print(f"the {n}-rank MPI job failed (exit {code})", file=sys.stderr)
                return 1, rows
            result = json.loads(report.read_text())
            rows.extend(result.pop("all_reduce"))
            header = result
    if args.json:
        print(json.dumps({**header, "all_reduce": rows}))
    return 0, rows


def run_job(cmd: list[str], args: argparse.Namespace) -> int:
    """Run one job with its output passed through. The job has a session of its own so that its whole
    process group (mpiexec, its proxies, the ranks) can be killed: after --timeout, or when this process
    is interrupted (a Ctrl-C at the terminal no longer reaches the job by itself)."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"the MPI job ran past --timeout {args.timeout:g} s and was killed", file=sys.stderr)
        return 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- inside an MPI job ----------------------------------------------------------------------------------
# mpi4py is imported here only: importing mpi4py.MPI initializes MPI, which the launching process must not.


def batch_shape(nbytes: int) -> tuple[int, int]:
    """(ops per timed batch, batches). Small ops run back to back in batches of up to 1000, so the timer
    and the barrier before each batch vanish in the mean; large ones are timed one by one, in more
    batches, as single ops vary more."""
    per_batch = max(1, min(1000, (4 << 20) // max(nbytes, 1)))
    return per_batch, 11 if per_batch > 1 else 21


def time_variants(calls: dict[str, Callable[[], object]], nbytes: int) -> dict[str, np.ndarray]:
    """Seconds per op of each call in each batch, the slowest rank's. The calls take turns batch by
    batch, each going first in turn, so a busy spell on the machine hits them alike and batch b of one
    call can be compared with batch b of another."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    per_batch, batches = batch_shape(nbytes)
    for call in calls.values():
        for _ in range(min(per_batch, 100)):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for b in range(batches):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            call = calls[name]
            world.Barrier()
            t = time.perf_counter()
            for _ in range(per_batch):
                call()
            times[name].append((time.perf_counter() - t) / per_batch)
    slowest = {}
    for name, ts in times.items():
        slowest[name] = np.array(ts)
        world.Allreduce(MPI.IN_PLACE, slowest[name], MPI.MAX)
    return slowest


def run_in_job(args: argparse.Namespace) -> dict[str, Any] | None:
    """Time every size on this job's ranks; rank 0 prints and returns the report, the others None."""
    from mpi4py import MPI

    from axonml_distributed._core import ReduceOp
    from axonml_distributed.mpi import init_mpi_process_group

    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    checked = init_mpi_process_group(timeout=args.timeout)
    unchecked = init_mpi_process_group(timeout=args.timeout, check_signatures=False)
    library = " ".join(MPI.Get_library_version().split("\n", 1)[0].split())  # "MPICH Version: 5.0.2"
    if rank == 0:
        print(
            f"\nall_reduce float32 SUM in place, {n} ranks under MPI ({library}, mpi4py {mpi4py_version()})"
        )
        print(f"median time per op, slowest rank; {load()} at the start")
        print("/raw and check costs: medians over batches run side by side of (ours / raw) and (on - off)")
        print_header()
    rows = []
    for nbytes in args.sizes:
        buf = np.zeros(max(nbytes // 4, 1), np.float32)
        calls: dict[str, Callable[[], object]] = {
            "raw": partial(world.Allreduce, MPI.IN_PLACE, buf, MPI.SUM),
            "checked": partial(checked.all_reduce, buf, ReduceOp.SUM),
            "unchecked": partial(unchecked.all_reduce, buf, ReduceOp.SUM),
        }
        for name, call in calls.items():
            sane(buf, call, name, n, rank)
        buf.fill(0)  # zeros stay zeros: no overflow, and no denormals, over thousands of sums
        row = report_row(n, buf.nbytes, time_variants(calls, buf.nbytes))
        rows.append(row)
        if rank == 0:
            print_row(row)
    if rank != 0:
        return None
    print(f"{load()} at the end (other work on the machine makes the numbers noisy)")
    print_targets(rows)
    return {"backend": "mpi", "mpi_library": library, "all_reduce": rows}


def mpi4py_version() -> str:
    import mpi4py

    return str(mpi4py.__version__)


def load() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def sane(buf: np.ndarray, call: Callable[[], object], name: str, n: int, rank: int) -> None:
    """One call on rank-dependent data must give the sum: a broken variant would be timed for nothing."""
    buf.fill(rank + 1)
    call()
    if not np.all(buf == n * (n + 1) / 2):
        raise AssertionError(f"{name}: all_reduce gave {buf[:4]}, expected {n * (n + 1) / 2}")


def report_row(n: int, nbytes: int, seconds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Medians over batches. Ratios and the check's cost are medians of batch-by-batch comparisons: the
    batches compared ran next to each other, so a busy spell on the machine cancels out."""
    row: dict[str, Any] = {"ranks": n, "bytes": nbytes}
    for name, ts in seconds.items():
        t = float(np.median(ts))
        algbw = nbytes / t / 1e9
        row[f"{name}_s"] = t
        row[f"{name}_algbw_gbps"] = algbw
        row[f"{name}_busbw_gbps"] = algbw * busbw_factor("all_reduce", n)
    row["checked_over_raw"] = float(np.median(seconds["checked"] / seconds["raw"]))
    row["unchecked_over_raw"] = float(np.median(seconds["unchecked"] / seconds["raw"]))
    row["check_cost_s"] = float(np.median(seconds["checked"] - seconds["unchecked"]))
    return row


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:.2f} us"


def print_header() -> None:
    print(f"{'':>9} | {'raw mpi4py':^28} | {'ours, check on':^27} | {'ours, check off':^27} | {'check':>9}")
    ours = f"{'time':>10} {'busbw':>8} {'/raw':>7}"
    print(f"{'size':>9} | {'time':>10} {'algbw':>8} {'busbw':>8} | {ours} | {ours} | {'costs':>9}")


def print_row(row: dict[str, Any]) -> None:
    cells = [
        f"{human(row['bytes']):>9}",
        f"{duration(row['raw_s']):>10} {row['raw_algbw_gbps']:>8.3f} {row['raw_busbw_gbps']:>8.3f}",
    ]
    for name in ("checked", "unchecked"):
        ratio = row[f"{name}_over_raw"]
        cells.append(f"{duration(row[f'{name}_s']):>10} {row[f'{name}_busbw_gbps']:>8.3f} {ratio:>6.2f}x")
    cells.append(f"{duration(row['check_cost_s']):>9}")
    print(" | ".join(cells), flush=True)


def print_targets(rows: list[dict[str, Any]]) -> None:
    for nbytes, limit in ((64 << 20, 1.1), (8, 2.0)):
        for row in rows:
            if row["bytes"] == nbytes:
                on, off = row["checked_over_raw"], row["unchecked_over_raw"]
                target = f"target at {human(nbytes)}: ours/raw <= {limit}x"
                print(f"{target}; check on {on:.2f}x, check off {off:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
