"""One rank of the torch call bench (`bench.torch_calls`), and torch's floor: a do-nothing backend.

Run as a script, ``python torch_calls_worker.py --sizes 4,4096 --blocks 40 --calls 200`` under
``axonml-run``: it joins an "axonml" default group, makes a group of the floor backend beside it, and
prints, on rank 0, one line ``BENCH-RESULT {stat: {mode: {contender: [seconds per call, per size]}}}``. It
imports nothing else of the bench, so an older build of the package can run this file and be compared
with the current one in the same run (``bench.torch_calls --compare-python``).

The floor, "axonml_floor", is registered as "axonml" is (a creator with torch's extended API, a Python
``ProcessGroup`` subclass) and does no work: a blocking call from torch's Python API (``asyncOp=False``)
returns no Work, as ours does, any other call a new Work that has finished. So ``dist.all_reduce`` over
it costs what torch's wrapper and its call into a Python backend cost, which no backend written this way
avoids; what ours costs beyond the floor and the native call is the cost of our torch layer.

Contenders, per mode: ``axonml`` (``dist.all_reduce`` over our backend), ``floor`` (the same call over
the floor) and ``native`` (our core's ``ProcessGroup.all_reduce`` on the same tensor, under the "axonml"
group). Blocking is ``dist.all_reduce(t)`` (native: ``all_reduce(t)``), async
``dist.all_reduce(t, async_op=True).wait()`` (native: ``all_reduce(t, async_op=True).wait()``). Each
block times `--calls` calls in a row; contenders take turns block by block (rotating which goes first),
after a barrier; a figure is the max over ranks of each rank's median block (stat "median"), or of its
fastest block ("best": the block least disturbed by other work on a shared machine), per call.
"""

# The overrides follow the signatures torch's C++ trampolines call.
# mypy: disable-error-code="override"

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

RESULT = "BENCH-RESULT "
FLOOR = "axonml_floor"
CONTENDERS = ("axonml", "floor", "native")
MODES = ("blocking", "async")
STATS = ("median", "best")


class FloorWork(dist.Work):
    """A Work that finished before it was returned (a new one per call, as a real backend's)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FloorProcessGroup(dist.ProcessGroup):
    """torch's ProcessGroup interface, doing nothing."""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return FLOOR

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FloorWork | None:
        if opts is not None and opts.asyncOp is False:
            return None
        return FloorWork()


def _create_floor(opts: Any, _backend_options: Any) -> FloorProcessGroup:
    return FloorProcessGroup(opts.group_rank, opts.group_size)


def register_floor() -> None:
    """Register "axonml_floor" with torch.distributed, once per process."""
    if FLOOR.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(FLOOR, _create_floor, extended_api=True, devices=["cpu"])


def _calls(t: torch.Tensor, floor: Any, native: Any) -> dict[str, dict[str, Callable[[], Any]]]:
    """mode -> contender -> one call."""
    return {
        "blocking": {
            "axonml": lambda: dist.all_reduce(t),
            "floor": lambda: dist.all_reduce(t, group=floor),
            "native": lambda: native.all_reduce(t),
        },
        "async": {
            "axonml": lambda: dist.all_reduce(t, async_op=True).wait(),
            "floor": lambda: dist.all_reduce(t, group=floor, async_op=True).wait(),
            "native": lambda: native.all_reduce(t, async_op=True).wait(),
        },
    }


def _block(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def _check(t: torch.Tensor, calls: dict[str, dict[str, Callable[[], Any]]], n: int) -> None:
    """Every call of ours sums: a tensor of ones becomes n everywhere."""
    for mode, per in calls.items():
        for name in ("axonml", "native"):
            t.fill_(1)
            per[name]()
            if not bool((t == n).all()):
                raise SystemExit(f"wrong {mode} {name} all_reduce result for {t.nbytes} bytes")


def run(sizes: list[int], blocks: int, calls: int) -> None:
    importlib.import_module("axonml_distributed.torch")  # registers "axonml" (a torch without autoload)
    register_floor()
    dist.init_process_group("axonml")
    floor = dist.new_group(backend=FLOOR)
    native = dist.group.WORLD._native  # type: ignore[union-attr]
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[str, dict[str, list[float]]]]
    out = {stat: {m: {c: [] for c in CONTENDERS} for m in MODES} for stat in STATS}
    for size in sizes:
        t = torch.empty(max(1, size // 4), dtype=torch.float32)
        per_mode = _calls(t, floor, native)
        _check(t, per_mode, n)
        t.zero_()  # sums of zeros stay zeros, however many calls
        for mode, per in per_mode.items():
            for call in per.values():
                _block(call, calls)  # warm-up
            times: dict[str, list[float]] = {c: [] for c in per}
            order = list(per)
            for b in range(blocks):
                for name in order[b % len(order) :] + order[: b % len(order)]:
                    native.barrier()
                    times[name].append(_block(per[name], calls))
            for name, ts in times.items():
                worst = torch.tensor([statistics.median(ts), min(ts)], dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                out["median"][mode][name].append(float(worst[0]))
                out["best"][mode][name].append(float(worst[1]))
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--calls", type=int, required=True)
    a = p.parse_args()
    run([int(s) for s in a.sizes.split(",")], a.blocks, a.calls)


if __name__ == "__main__":
    main()
