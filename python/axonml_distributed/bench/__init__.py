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
    python -m axonml_distributed.bench --timeline-overhead    # timeline off vs on (bench.timeline_overhead)

The in-process world's figures are described in `bench.threads`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from axonml_distributed.bench.common import DEFAULT_SIZES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m axonml_distributed.bench", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["threads", "shm", "mpi"], default="threads")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES)
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
    p.add_argument("--timeline-overhead", action="store_true", help="the timeline's cost: off against on")
    p.add_argument("--timeline-rounds", type=int, default=10, help="rounds of each, with --timeline-overhead")
    args, rest = p.parse_known_args(argv)
    if args.hosts is not None:
        from axonml_distributed.bench import hosts

        return hosts.main(argv)
    if args.collectives:
        from axonml_distributed.bench import procs

        given = [a for a in argv or sys.argv[1:] if a != "--collectives"]
        colls = [] if "--colls" in given else ["--colls", "all_to_all,all_gather_v,all_gather"]
        return procs.main([*given, *colls])
    if args.torch and any(a == "--peers" or a.startswith("--peers=") for a in argv or sys.argv[1:]):
        from axonml_distributed.bench import peers

        return peers.main(argv)
    if args.torch_calls:
        from axonml_distributed.bench import torch_calls

        return torch_calls.main(argv)
    if args.torch:
        from axonml_distributed.bench import torch_ddp

        return torch_ddp.main(argv)
    if args.timeline_overhead:
        from axonml_distributed.bench.timeline_overhead import run

        report = run(args)
        if args.json:
            print(json.dumps(report))
        return 0
    if args.backend != "threads":
        module = "procs" if args.backend == "shm" else "mpi"
        try:
            other = importlib.import_module(f"axonml_distributed.bench.{module}")
        except ImportError as e:
            print(f"the {args.backend} benchmark is unavailable: {e}", file=sys.stderr)
            return 2
        return int(other.main(argv))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from axonml_distributed.bench.threads import run_threads

    report = run_threads(args)
    if args.json:
        print(json.dumps(report))
    return 0
