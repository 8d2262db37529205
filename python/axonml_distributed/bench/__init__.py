"""Benchmarks with their baselines measured in the same run.

    python -m axonml_distributed.bench                        # in-process world: all_reduce sweep + DDP
    python -m axonml_distributed.bench --ranks 2 --sizes 8,67108864
    python -m axonml_distributed.bench --backend shm          # processes (see bench.procs)
    python -m axonml_distributed.bench --backend mpi          # MPI, ours against raw mpi4py (see bench.mpi)
    python -m axonml_distributed.bench --torch                # DDP on torch modules (see bench.torch_ddp)
    python -m axonml_distributed.bench --torch --peers vllm,deepspeed,gloo   # all_reduce on torch tensors
                                                              # beside vLLM's and DeepSpeed's (bench.peers)
    python -m axonml_distributed.bench --torch-calls          # dist.all_reduce against torch's floor
    python -m axonml_distributed.bench --collectives          # all_to_all, all_gather_v (bench.procs)
    python -m axonml_distributed.bench --hosts 2 [--fit]      # simulated hosts, root (see bench.hosts)
    python -m axonml_distributed.bench ... --plot out.png     # chart of any size sweep above (bench.plot)
    python -m axonml_distributed.bench --timeline-overhead    # timeline off vs on (bench.timeline_overhead)

``--plot PATH`` draws, for every mode that sweeps message sizes (threads, shm, mpi, --collectives,
--torch --peers, --torch-calls), bus bandwidth and time per call against size for ours and each peer
measured in the same run (busbw as nccl-tests define it); it needs the ``plot`` extra (matplotlib).
Under ``--hosts`` it draws the fitted cost model instead (with ``--fit``).

The in-process world's figures are described in `bench.threads`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from axonml_distributed.bench.common import DEFAULT_SIZES, Curve, csv_ints

Run = Callable[[list[str]], tuple[int, list[Curve]]]


def _without(argv: list[str], option: str) -> list[str]:
    """argv without `option` and its value (given as two words or as option=value)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if not skip and a != option and not a.startswith(option + "="):
            out.append(a)
        skip = a == option and not skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m axonml_distributed.bench", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["threads", "shm", "mpi"], default="threads")
    p.add_argument("--ranks", type=csv_ints, default=[2, 4])
    p.add_argument("--sizes", type=csv_ints, default=DEFAULT_SIZES)
    p.add_argument("--ddp-params", type=int, default=25_000_000, help="0 skips the DDP comparison")
    p.add_argument("--ddp-iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object at the end")
    p.add_argument("--torch", action="store_true", help="DDP on torch modules against torch's")
    p.add_argument("--collectives", action="store_true", help="all_to_all and all_gather_v against MPICH")
    p.add_argument("--hosts", type=int, help="simulated hosts: axonml against gloo and MPICH (bench.hosts)")
    p.add_argument(
        "--torch-calls", action="store_true", help="dist.all_reduce's cost over torch's do-nothing backend"
    )
    p.add_argument(
        "--plot",
        type=Path,
        help="draw bus bandwidth and latency against message size to this PNG (needs the plot extra)",
    )
    p.add_argument("--timeline-overhead", action="store_true", help="the timeline's cost: off against on")
    p.add_argument("--timeline-rounds", type=int, default=10, help="rounds of each, with --timeline-overhead")
    args, rest = p.parse_known_args(argv)
    if args.hosts is not None:
        from axonml_distributed.bench import hosts

        return hosts.main(argv)  # its own --plot: the cost model
    peers = args.torch and any(a == "--peers" or a.startswith("--peers=") for a in argv)
    if args.torch and not peers and not args.torch_calls:
        if args.plot is not None:
            p.error("--plot draws a sweep of message sizes, and --torch (DDP steps) has none")
        from axonml_distributed.bench import torch_ddp

        return torch_ddp.main(argv)
    if args.timeline_overhead:
        from axonml_distributed.bench import timeline_overhead

        report = timeline_overhead.run(args)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.plot is not None:
        from axonml_distributed.bench import plot

        plot.pyplot()  # a missing matplotlib is said now, not after the run
    given = _without(argv, "--plot")
    title: str
    run: Run
    if args.collectives:
        from axonml_distributed.bench import procs

        given = [a for a in given if a != "--collectives"]
        colls = [] if "--colls" in given else ["--colls", "all_to_all,all_gather_v,all_gather"]
        given, run, title = [*given, *colls], procs.run, "processes over shared memory (shm)"
    elif peers:
        from axonml_distributed.bench import peers as peers_bench

        run, title = peers_bench.run, "all_reduce on torch CPU tensors: ours beside other libraries"
    elif args.torch_calls:
        from axonml_distributed.bench import torch_calls

        run, title = torch_calls.run, "dist.all_reduce over axonml against torch's do-nothing backend"
    elif args.backend != "threads":
        module = "procs" if args.backend == "shm" else "mpi"
        try:
            other = importlib.import_module(f"axonml_distributed.bench.{module}")
        except ImportError as e:
            print(f"the {args.backend} benchmark is unavailable: {e}", file=sys.stderr)
            return 2
        run = other.run
        title = "processes over shared memory (shm)" if module == "procs" else "all_reduce under MPI"
    else:
        if rest:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        run, title = (lambda _: _run_threads(args)), "in-process world (threads)"
    status, curves = run(given)
    if args.plot is not None:
        if curves:
            # Figures of a shared machine compare within one run only: the chart says how busy it was.
            load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end"
            plot.draw_sweep(curves, args.plot, f"{title}; {load}")
            print(f"chart: {args.plot}", file=sys.stderr)  # stderr: stdout may end in --json's object
        else:
            print("no chart: nothing was measured", file=sys.stderr)
    return status


def _run_threads(args: argparse.Namespace) -> tuple[int, list[Curve]]:
    from axonml_distributed.bench import threads

    report = threads.run_threads(args)
    if args.json:
        print(json.dumps(report))
    return 0, threads.curves(report)
