"""Several hosts: all_reduce and a torch DDP step on simulated hosts whose links are rate-limited, the
"axonml" torch backend against flat gloo and flat MPICH, measured in the same run.

    python -m axonml_distributed.bench --hosts 2 [--ranks-per-host 2] [--rate 10gbit] [--sizes ...]
    python -m axonml_distributed.bench --hosts 2 --fit [--plot docs/cost_model.png]

Needs root (simulated hosts: `axonml_distributed.simhosts`). Brings up `--hosts` hosts, limits both
directions of every host's link to `--rate` with a token bucket (tc tbf; ``--rate none`` leaves them
unshaped), and runs, each launch in turn (`--repeat` rounds, so a burst of load on the machine hits every
contender alike; a figure is the median over rounds):

- ``gloo``: torchrun on every host (c10d rendezvous on h0), torch.distributed's gloo: a flat ring over
  every rank;
- ``axonml``: the same launch with the backend "axonml" (hierarchical across hosts: shared memory inside a
  host, gloo between hosts). A launch that fails is named with its error, and the others still printed;
- ``mpi``: mpiexec (MPICH's hydra) on the ctl node through the hosts' fake ssh: mpi4py's Allreduce (flat
  MPICH) and our MPI process group, in one job;

timing float32 all_reduce (SUM, in place; size = bytes per rank) and, under torchrun, the DDP step of
`bench.torch_ddp`'s models (the DDP tutorial's ToyModel, a ResNet-18 at 64 px, batch 8). Ratios are the
baseline's time over axonml's: how many times faster axonml is. Issue 30's targets at 64 MiB, 2 hosts x 2
ranks, 10 Gbit/s (shown, never asserted): >= 1.35x against flat gloo, >= 2.5x against flat MPICH.

``--fit`` also measures the two levels of a hierarchical all_reduce on their own (shared memory on one
host: `procs_worker`'s shm reduce_scatter and all_gather on h0 alone; across hosts: each local rank
index's gloo group all-reducing its shard, every group at once) and fits the cost model of
`bench.cost_model` to them; ``--plot PATH`` draws its predictions (needs matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axonml_distributed import settings
from axonml_distributed.bench.common import csv_ints, csv_names, human
from axonml_distributed.bench.hosts_worker import FAILED, NOTE
from axonml_distributed.bench.procs import find_mpiexec
from axonml_distributed.bench.procs_worker import RESULT
from axonml_distributed.simhosts import SimHosts, missing_requirements
from axonml_distributed.simhosts.hosts import Where

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
HEADLINE = 64 << 20
TARGETS = {"gloo": 1.35, "mpich": 2.5}
CONTENDERS = ("gloo", "axonml", "mpi")
MODELS = ("toy", "resnet18")
PROCS_WORKER = str(Path(__file__).with_name("procs_worker.py"))
# Room for a launch to end by itself once one of its parts has failed, before it is killed.
_GRACE = 15.0

Figures = dict[str, float]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m axonml_distributed.bench --hosts N", description=__doc__.split("\n")[0]
    )
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host (default 2)")
    p.add_argument("--rate", default="10gbit", help="every link's rate, tc's form, or none (default 10gbit)")
    p.add_argument(
        "--sizes",
        type=csv_ints,
        default=DEFAULT_SIZES,
        help="all_reduce bytes per rank (default 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB)",
    )
    p.add_argument(
        "--contenders",
        type=csv_names,
        default=list(CONTENDERS),
        help=f"which to run, of {', '.join(CONTENDERS)} (default all)",
    )
    p.add_argument(
        "--models",
        type=csv_names,
        default=list(MODELS),
        help="DDP models, of toy, resnet18; empty for none (default both)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed DDP steps per model (default 5)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of launches (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default 600)")
    p.add_argument(
        "--max-iters", type=int, default=200, help="timed all_reduce calls per size at most (default 200)"
    )
    p.add_argument("--fit", action="store_true", help="measure the levels and fit the cost model")
    p.add_argument("--plot", type=Path, help="with --fit: draw the model's predictions to this PNG")
    p.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    p.add_argument("--logs", type=Path, help="keep each launch's output in this directory")
    args, _ = p.parse_known_args(argv)  # the bench command's own options are not ours
    if bad := set(args.contenders) - set(CONTENDERS):
        p.error(f"unknown contenders {sorted(bad)}; choose from {', '.join(CONTENDERS)}")
    if bad := set(args.models) - set(MODELS):
        p.error(f"unknown models {sorted(bad)}; choose from {', '.join(MODELS)}")
    if args.plot and not args.fit:
        p.error("--plot draws the fitted model: add --fit")
    if args.hosts < 2 or args.ranks_per_host < 1:
        p.error("--hosts 2 or more, --ranks-per-host 1 or more")
    args.sizes = sorted({max(4, s // 4 * 4) for s in args.sizes})
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    problem = missing_requirements()
    if problem:
        print(f"the several-hosts bench runs on simulated hosts: {problem}", file=sys.stderr)
        return 2
    runs: dict[str, list[Figures]] = {}
    failed: dict[str, str] = {}
    notes: dict[str, str] = {}
    loads: list[float] = []
    walls: dict[str, list[float]] = {}  # each launch's wall time: where a run's minutes go
    share = [str(Path(__file__).resolve().parents[3])]  # a clone under /tmp stays visible on the hosts
    with SimHosts(args.hosts, prefix=f"axsimbench{secrets.token_hex(3)}", share=share) as hosts:
        if args.rate != "none":
            hosts.shape(None, args.rate)
        launches = _launches(hosts, args)
        for _ in range(args.repeat):
            for name, launch in launches.items():
                loads.append(os.getloadavg()[0])
                start = time.monotonic()
                got = _run_launch(hosts, launch, args.timeout, args.sizes, args.logs, name)
                walls.setdefault(name, []).append(time.monotonic() - start)
                if isinstance(got, str):
                    failed[name] = got
                    continue
                figures, said = got
                if "note" in said:
                    notes[name] = said.pop("note")
                failed |= said
                runs.setdefault(name, []).append(figures)
    results = {f"{name}/{k}": v for name in runs for k, v in _medians(runs[name]).items()}
    _report(args, results, failed, loads)
    for name, note in notes.items():
        print(f"{name}: {note}")
    print("launch wall times: " + ", ".join(f"{k} {max(v):.0f} s" for k, v in walls.items()))
    if args.fit:
        from axonml_distributed.bench import cost_model

        cost_model.report(args, results, args.plot)
    if args.json:
        print(json.dumps({"results": results, "failed": failed, "loads": loads}))
    return 0


# --- launches --------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One contender's processes: argv per place (a host index, or "ctl"), started together; or why the
    contender cannot run here."""

    places: dict[Where, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    why_not: str | None = None


def _launches(hosts: SimHosts, args: argparse.Namespace) -> dict[str, Launch]:
    py, m, n = sys.executable, args.ranks_per_host, args.hosts
    env = {
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": hosts.env(0)["SIMHOSTS_IFACE"],
        settings.SHM_ARENA_MB: str(2 * (max(args.sizes) >> 20) + 16),
    }
    sizes = ["--sizes", ",".join(map(str, args.sizes))]
    common = ["--timeout", str(min(args.timeout, 300.0)), "--max-iters", str(args.max_iters)]
    out: dict[str, Launch] = {}
    if args.fit:  # the in-host level, on one host alone
        job = [PROCS_WORKER, "shm", *sizes, "--colls", "reduce_scatter,all_gather,all_reduce"]
        out["in-host"] = Launch(
            {0: [py, "-m", "axonml_distributed.run", "--nproc-per-node", str(m), *job]}, env
        )
    for backend in ("gloo", "axonml"):
        if backend not in args.contenders:
            continue
        port = 29400 + secrets.randbelow(20000)  # a fresh port per launch: no TIME_WAIT from the last
        torchrun = [py, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", str(m)]
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}"]
        torchrun += ["--rdzv-id", f"bench{backend}", "-m", "axonml_distributed.bench.hosts_worker", "torch"]
        job = [*sizes, *common, "--backend", backend, "--steps", str(args.steps)]
        job += ["--models", ",".join(args.models)] + (["--levels"] if args.fit and backend == "gloo" else [])
        out[backend] = Launch({i: [*torchrun, *job] for i in range(n)}, env)
    if "mpi" in args.contenders:
        mpiexec = find_mpiexec()
        why = _mpich_missing(mpiexec)
        if why:
            out["mpi"] = Launch(why_not=why)
        else:
            assert mpiexec is not None
            hydra = [mpiexec, "-launcher", "ssh", "-launcher-exec", hosts.ssh, "-iface", "eth0"]
            hydra += ["-hosts", ",".join(f"h{i}:{m}" for i in range(n)), "-n", str(n * m)]
            worker = [py, "-m", "axonml_distributed.bench.hosts_worker", "mpi", *sizes, *common]
            out["mpi"] = Launch({"ctl": [*hydra, *worker]}, env)
    return out


def _mpich_missing(mpiexec: str | None) -> str | None:
    """Why flat MPICH cannot be measured here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install "axonml-distributed[mpi]")'
    if mpiexec is None:
        return "mpiexec not found beside this Python nor on PATH"
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    if "HYDRA" not in version.stdout:
        return f"{mpiexec} is not MPICH's (hydra): the launch goes through hydra's ssh launcher"
    return None


def _run_launch(
    hosts: SimHosts, launch: Launch, timeout: float, sizes: list[int], logs: Path | None, name: str
) -> tuple[Figures, dict[str, str]] | str:
    """Run one launch to its end: (its rank 0's figures, failures it named), or why it gave none."""
    if launch.why_not is not None:
        return launch.why_not
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for k, (where, argv) in enumerate(launch.places.items()):
            outs.append(Path(tmp) / f"{k}.out")
            with open(outs[-1], "w") as out:
                procs.append(hosts.popen(where, argv, env=launch.env, stdout=out, stderr=subprocess.STDOUT))
        ended = _wait_all(procs, timeout)
        said = "\n".join(path.read_text(errors="replace") for path in outs)
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "a") as log:
            log.write(said)
    figures: Figures | None = None
    named: dict[str, str] = {}
    for line in said.splitlines():
        if line.startswith(RESULT):
            figures = _flatten(json.loads(line[len(RESULT) :]), sizes)
        elif line.startswith(FAILED + "axonml-mpi "):
            named["axonml-mpi"] = line[len(FAILED + "axonml-mpi ") :]
        elif line.startswith(FAILED):
            named.setdefault("launch", line[len(FAILED) :])
        elif line.startswith(NOTE):
            named.setdefault("note", line[len(NOTE) :])
    if figures is not None:
        return figures, named
    if "launch" in named:
        return named["launch"]
    codes = ", ".join(str(p.returncode) for p in procs)
    tail = " | ".join(said.strip().splitlines()[-3:])
    return f"{ended}; exit {codes}: {tail[-400:]}"


def _flatten(raw: dict[str, Any], sizes: list[int]) -> Figures:
    """`procs_worker`'s {label: {collective: [per size]}} into this bench's {key: seconds}; the worker of
    this bench gives its own keys already."""
    flat: Figures = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key == "shm":  # the in-host level on ordinary arrays, as the hierarchy's callers hold them
                for coll, times in value.items():
                    flat |= {f"{coll} {s}": t for s, t in zip(sizes, times, strict=True)}
        else:
            flat[key] = float(value)
    return flat


def _wait_all(procs: list[subprocess.Popen[Any]], timeout: float) -> str:
    """Wait for every process; once one has failed, or at the timeout, kill the rest (and everything
    they started on the hosts) after a grace. Says how the launch ended."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + _GRACE):
            for p in procs:
                if p.poll() is None:
                    _kill_tree(p.pid)
                    p.wait()
            return "killed after a part failed" if failed_at is not None else f"timed out after {timeout:g} s"
        time.sleep(0.1)
    return "ended"


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, seen from the machine's own PID namespace (the nsenter
    of a simulated host, the torchrun agent it waits for and the workers in their own sessions)."""
    tree, k = [pid], 0
    while k < len(tree):
        try:
            for task in os.listdir(f"/proc/{tree[k]}/task"):
                tree += [int(c) for c in Path(f"/proc/{tree[k]}/task/{task}/children").read_text().split()]
        except OSError:
            pass
        k += 1
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _medians(figures: list[Figures]) -> Figures:
    keys = set().union(*figures)
    out = {}
    for key in keys:
        values = sorted(f[key] for f in figures if key in f)
        mid = len(values) // 2
        out[key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out


# --- the table -------------------------------------------------------------------------------------------


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _ratio(base: float | None, ours: float | None) -> str:
    return "-" if base is None or ours is None else f"{base / ours:.2f}x"


def _report(args: argparse.Namespace, res: Figures, failed: dict[str, str], loads: list[float]) -> None:
    n, m = args.hosts, args.ranks_per_host
    rate = "unshaped links" if args.rate == "none" else f"each link {args.rate} (tbf)"
    load = f"{min(loads):.2f}..{max(loads):.2f}" if loads else "-"
    ranks = f"{m} rank{'s' * (m != 1)}"
    print(f"\n{n} simulated hosts x {ranks}, {rate}; load average at the launches {load} ", end="")
    print(f"({os.cpu_count()} CPUs shared by every host); median of {args.repeat} round(s)")
    print("all_reduce float32 SUM in place; time = the slowest rank's median op; x = baseline / axonml")
    cols = [
        ("flat gloo", "gloo/all_reduce"),
        ("axonml", "axonml/all_reduce"),
        ("flat MPICH", "mpi/mpich"),
        ("axonml mpi", "mpi/axonml-mpi"),
    ]
    head = f"{'size':>9} | " + " | ".join(f"{c:>10}" for c, _ in cols)
    head += f" | {'gloo/axonml':>11} | {'MPICH/axonml':>12} | {'MPICH/ax.mpi':>12}"
    print(head)
    print("-" * len(head))
    for s in args.sizes:
        cell = {key: _get(res, key, s) for _, key in cols}
        row = f"{human(s):>9} | " + " | ".join(f"{_time(cell[key]):>10}" for _, key in cols)
        gloo, axonml, mpich = cell["gloo/all_reduce"], cell["axonml/all_reduce"], cell["mpi/mpich"]
        row += f" | {_ratio(gloo, axonml):>11} | {_ratio(mpich, axonml):>12}"
        row += f" | {_ratio(mpich, cell['mpi/axonml-mpi']):>12}"
        print(row + ("  <- headline" if s == HEADLINE else ""))
    if HEADLINE in args.sizes:
        targets = ", ".join(
            f">= {v}x against flat {k if k == 'gloo' else 'MPICH'}" for k, v in TARGETS.items()
        )
        print(
            f"issue 30's targets at {human(HEADLINE)}, 2 hosts x 2 ranks, 10 Gbit/s (not asserted): {targets}"
        )
    if args.models:
        print("\ntorch DDP step (zero_grad, forward, backward with its all_reduce, SGD step), slowest rank")
        print(f"{'model':>9} | {'gloo DDP':>10} | {'axonml DDP':>10} | {'gloo/axonml':>11}")
        for name in args.models:
            g, a = res.get(f"gloo/ddp {name}"), res.get(f"axonml/ddp {name}")
            print(f"{name:>9} | {_time(g):>10} | {_time(a):>10} | {_ratio(g, a):>11}")
    for name in [*CONTENDERS, "axonml-mpi", "in-host"]:
        if name in failed:
            print(f"{name} not measured: {failed[name]}")
        elif name in CONTENDERS and name not in args.contenders:
            print(f"{name} not run (--contenders)")


def _get(res: Figures, key: str, size: int) -> float | None:
    return res.get(f"{key} {size}")
