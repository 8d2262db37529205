"""What a ``torch.distributed`` call over "axonml" costs beyond torch's own floor, measured in one run.

``python -m axonml_distributed.bench --torch-calls [--ranks 2] [--sizes 4,4096,65536] [--repeat 3]
[--compare-python PY]`` launches ``bench.torch_calls_worker`` under ``axonml-run`` (OMP_NUM_THREADS=1),
``--repeat`` times, and prints, per mode (blocking ``dist.all_reduce(t)``, async
``dist.all_reduce(t, async_op=True).wait()``) and size, float32, per call: ``axonml`` (over our
backend), ``floor`` (over a do-nothing backend registered with torch the same way, see the worker),
``native`` (our core's ``ProcessGroup.all_reduce`` on the same tensor, blocking or ``async_op=True``
then ``wait()``), and ``overhead`` = axonml - floor - native: what our torch layer adds, against issue
28's target of at most 1.5 us. Each figure is the median over launches of the max over ranks of each
rank's median block, and, in a second set of tables, of its fastest block (see the worker): on a
shared machine, where other work takes the cores for tens of microseconds at a time, the fastest
blocks still compare the code. ``--ranks 1`` measures the layers alone, with no peer to wait for.
``--compare-python PY`` also runs the worker under another interpreter (an older build, labelled
"base"), launches taking turns, so before and after share the load. Figures are shown, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from axonml_distributed.bench.common import Curve, human
from axonml_distributed.bench.procs import launch_workers
from axonml_distributed.progress import progress

WORKER = str(Path(__file__).with_name("torch_calls_worker.py"))
# The worker's names (not imported: importing the worker imports torch).
MODES = {"blocking": "dist.all_reduce(t)", "async": "dist.all_reduce(t, async_op=True).wait()"}
STATS = {
    "median": "median block",
    "best": "fastest block (the least disturbed by other work on a shared machine)",
}
TARGET_US = 1.5
# One launch's figures: stat -> mode -> contender -> seconds per call, per size.
Launch = dict[str, dict[str, dict[str, list[float]]]]
# label -> stat -> mode -> contender -> seconds per call, per size (the median over launches)
Results = dict[str, Launch]


def _us(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e6:.2f} us"


def report(n: int, sizes: list[int], results: Results, loads: list[float]) -> None:
    """The tables: per statistic and mode, a row per size and label (see the module docs)."""
    lo, hi = (min(loads), max(loads)) if loads else (float("nan"), float("nan"))
    print(f"\n{n} ranks, float32; load average during the runs {lo:.2f}..{hi:.2f} ({os.cpu_count()} CPUs)")
    for stat, what in STATS.items():
        for mode, call in MODES.items():
            print(f"\n{mode}: {call}; per call, {what}, median of launches")
            head = f"{'size':>8} | {'build':>5} | {'axonml':>10} | {'floor':>10} | {'native':>10} | "
            head += f"{'overhead (axonml - floor - native)':>34} | target"
            print(head)
            print("-" * len(head))
            for i, size in enumerate(sizes):
                for label, stats in results.items():
                    got = {c: v[i] for c, v in stats.get(stat, {}).get(mode, {}).items()}
                    ours, floor, native = got.get("axonml"), got.get("floor"), got.get("native")
                    over = None
                    if ours is not None and floor is not None and native is not None:
                        over = ours - floor - native
                    cells = [f"{human(size):>8}", f"{label:>5}", f"{_us(ours):>10}", f"{_us(floor):>10}"]
                    cells += [f"{_us(native):>10}", f"{_us(over):>34}", f"<= {TARGET_US} us"]
                    print(" | ".join(cells))


def _medians(launches: list[Launch]) -> Launch:
    """Each figure's median over the launches."""
    first = launches[0]
    return {
        stat: {
            mode: {
                c: [statistics.median(col) for col in zip(*(g[stat][mode][c] for g in launches), strict=True)]
                for c in first[stat][mode]
            }
            for mode in first[stat]
        }
        for stat in first
    }


def curves(n: int, sizes: list[int], results: Results) -> list[Curve]:
    """The median-block figures of one world size, one curve per mode and contender; another build's
    ("base") contenders are labelled with it. The floor (torch's do-nothing backend) is a bound."""
    out = []
    for label, stats in results.items():
        for mode, per in stats.get("median", {}).items():
            for contender, seconds in per.items():
                kind = "bound" if contender == "floor" else "ours"
                name = contender if label == "this" else f"{contender} ({label})"
                out.append(Curve(name, kind, "all_reduce", n, sizes, seconds, setting=mode))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv)[0]


def run(argv: Sequence[str] | None = None) -> tuple[int, list[Curve]]:
    """`main`, also returning what was measured, for the chart."""
    prog = "python -m axonml_distributed.bench --torch-calls"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",") if x], default=[2])
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[4, 4096, 65536])
    p.add_argument("--repeat", type=int, default=3, help="launches per build, taking turns (default 3)")
    p.add_argument("--blocks", type=int, default=40, help="timed blocks per contender and launch")
    p.add_argument("--calls", type=int, default=200, help="calls per timed block")
    p.add_argument("--compare-python", help="also run the worker with this Python (an older build)")
    args, _ = p.parse_known_args(argv)  # the parent bench's own options (--torch-calls ...) are not ours
    job = ["--sizes", ",".join(map(str, args.sizes)), "--blocks", str(args.blocks)]
    job += ["--calls", str(args.calls)]
    pythons = {"this": sys.executable} | ({"base": args.compare_python} if args.compare_python else {})
    measured = []
    for n in args.ranks:
        runs: dict[str, list[Launch]] = {label: [] for label in pythons}
        loads: list[float] = []
        with progress(args.repeat * len(pythons), f"bench (torch calls, {n} ranks)") as bar:
            for _ in range(args.repeat):
                for label, python in pythons.items():  # in turns, so a burst of load hits both builds alike
                    loads.append(os.getloadavg()[0])
                    cmd = [python, "-m", "axonml_distributed.run", "--nproc-per-node", str(n), WORKER, *job]
                    got = launch_workers(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
                    bar.update(1)
                    if isinstance(got, str):
                        print(f"[bench --torch-calls] {label} launch failed: {got}", file=sys.stderr)
                        continue
                    runs[label].append(got)
        results: Results = {label: _medians(got) for label, got in runs.items() if got}
        report(n, args.sizes, results, loads)
        measured += curves(n, args.sizes, results)
    return 0, measured


if __name__ == "__main__":
    sys.exit(main())
