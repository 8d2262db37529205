"""torch's own generic distributed tests (`DistributedTest._DistTestBase`) against a backend.

Run as a script, the way the pytorch repository's `test/distributed/test_distributed_spawn.py` runs the
same class, one test at a time, each in `WORLD_SIZE` processes of its own, but forked from this one (as
the repository's former `test_distributed_fork.py` did): a spawned child imports torch again, 15-20 s a
test on a loaded machine, a forked one inherits it.

    python tests/torch_suite.py --backend axonml --world-size 2 [-v] [-k all_gather]

The run ends with one line of counts (ran, passed, failed, skipped) and fails if a test fails that
`KNOWN_FAILURES` does not list, or if a listed test passes.

Skips that torch decides in the children from facts the parent shares (accelerators present, world
size) are decided by the same decorators in the parent, before any process starts (`_decide_in_parent`):
the same tests are skipped, with the same messages, without two processes started for each.

torch's suite gates many CPU tests on the backend's name ("gloo"). For a backend other than gloo the
driver opens exactly these gates, and changes no test body (`GATES` below, applied to the module's
source before it is imported; each must match at least once, so a torch that renames one fails loudly):
- `require_backend_is_available({"gloo"})` also admits the backend under test;
- `BACKEND != "gloo"` skip conditions read "not gloo and not the backend under test";
- the one `BACKEND == "mpi" or BACKEND == "gloo"` branch (a CPU DDP test) takes the backend too;
- the backend joins torch's `ddp`, `subgroup` and `plugin` feature sets (as torch_ucc's driver does)
  and the three profiling allowlists (so profiler tests expect its events);
- on a machine without accelerators it also joins the `gpu` set ({nccl, gloo, ...}: backends that take
  device tensors), whose tests there either skip for want of a device or, as for gloo, run on CPU
  (`test_all_gather_object_*`); with accelerators present the set stays closed to a CPU-only backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import types
import unittest

from torch_tests import (
    ForkedRanks,
    Outcomes,
    accelerator_count,
    decide_accelerator_skips_in_parent,
    of,
    skip_decided,
)

GATES = [
    ('require_backend_is_available({"gloo"})', 'require_backend_is_available({"gloo", BACKEND})'),
    ('BACKEND != "gloo"', 'BACKEND not in ("gloo", _UNDER_TEST)'),
    ('BACKEND == "mpi" or BACKEND == "gloo"', 'BACKEND in ("mpi", "gloo", _UNDER_TEST)'),
]
FEATURES = ["ddp", "subgroup", "plugin"]
PROFILING_LISTS = [
    "PROFILING_SUPPORTED_BACKENDS",
    "CUDA_PROFILING_SUPPORTED_BACKENDS",
    "SEND_RECV_PROFILING_SUPPORTED_BACKENDS",
]
MODULE = "torch.testing._internal.distributed.distributed_test"

# Tests that fail on the backend under test only because torch refuses it by what it is (by name, or a
# backend written as a ProcessGroup); each fails the run if it starts passing.
_MONITORED_BARRIER = (
    "dist.monitored_barrier asks for a group with a CPU backend registered (torch 2.15: "
    "`torch.device('cpu') in group._device_types`; 2.13 and older: gloo by name); a backend that is a "
    "ProcessGroup has none registered, and claiming one has torch attach its flight recorder, which fails "
    "on such a group. The group's own method works (tests/test_monitored_barrier.py)."
)
KNOWN_FAILURES: dict[str, dict[str, str]] = {
    "axonml": {
        "test_monitored_barrier_gloo": _MONITORED_BARRIER,
        "test_monitored_barrier_gloo_subgroup": _MONITORED_BARRIER,
    },
}


def _decide_in_parent(accelerators: int) -> None:
    """Make torch's skip decorators that test only accelerators and the world size skip in this process,
    through `unittest.skip` with torch's own message, where the children would exit with that skip."""
    from torch.testing._internal import common_distributed as cd

    world_size = int(os.environ["WORLD_SIZE"])
    not_mpi = os.environ["BACKEND"] != "mpi"
    decide_accelerator_skips_in_parent(accelerators)
    no_gpu, small, odd = cd.skip_if_no_gpu, cd.skip_if_small_worldsize, cd.skip_if_odd_worldsize
    no_device = None if accelerators >= world_size else f"multi-device-{world_size}"
    cd.skip_if_no_gpu = skip_decided(no_gpu, no_device if accelerators else "no_accelerator")
    small_skip = "small_worldsize" if not_mpi and world_size < 8 else None
    cd.skip_if_small_worldsize = skip_decided(small, small_skip)
    cd.skip_if_odd_worldsize = skip_decided(odd, "odd_worldsize" if not_mpi and world_size % 2 else None)


def _load_suite(backend: str) -> types.ModuleType:
    """torch's distributed_test module with the gates above opened to `backend` (gloo: unchanged)."""
    # torch only now: `_environment` has set OMP_NUM_THREADS, which torch reads at import
    from torch.testing._internal.common_distributed import DistTestCases

    accelerators = accelerator_count()
    _decide_in_parent(accelerators)
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None and spec.loader is not None
    if backend == "gloo":
        return importlib.import_module(MODULE)
    for feature in FEATURES + ([] if accelerators else ["gpu"]):
        DistTestCases.backend_feature[feature].add(backend)
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for old, new in GATES:
        if old not in source:
            raise RuntimeError(f"torch's distributed_test.py no longer has {old!r}: update GATES")
        source = source.replace(old, new)
    module = importlib.util.module_from_spec(spec)
    module._UNDER_TEST = backend  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    # dont_inherit: this file's `from __future__ import annotations` must not turn the suite's annotations
    # into strings (DDP checks a comm hook's annotation against dist.GradBucket).
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    for name in PROFILING_LISTS:
        getattr(module, name).append(backend)
    return module


def _environment(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Set the environment torch's suite reads at import (BACKEND, WORLD_SIZE, TEMP_DIR, INIT_METHOD),
    from the command line; the forked children inherit it. Returns ours and unittest's arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="axonml")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--outcomes", help="also write each test's outcome to this file, as JSON")
    args, rest = parser.parse_known_args(argv)
    temp = tempfile.mkdtemp(prefix="torch_suite_")
    for sub in ("barrier", "test_dir"):
        os.mkdir(os.path.join(temp, sub))
    os.environ.update(
        BACKEND=args.backend,
        WORLD_SIZE=str(args.world_size),
        TEMP_DIR=temp,
        INIT_METHOD="env://",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    return args, rest


_args, _rest = _environment(sys.argv[1:])
_suite = _load_suite(os.environ["BACKEND"])


class TestDistBackendWithFork(ForkedRanks, _suite.TestDistBackend, _suite.DistributedTest._DistTestBase):  # type: ignore[name-defined,misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def _verdict(outcomes: dict[str, str], backend: str, known: dict[str, str]) -> bool:
    """Print the counts and the tests that break the rule (fail only if listed); True if none does."""
    ran, failed = of(outcomes, "passed", "failed", "known failure"), of(outcomes, "failed", "known failure")
    passed, unlisted = of(outcomes, "passed"), of(outcomes, "failed")
    print(
        f"torch_suite {backend} world_size={os.environ['WORLD_SIZE']}: ran {len(ran)}, "
        f"passed {len(passed)}, failed {len(failed)} ({len(failed) - len(unlisted)} known), "
        f"skipped {len(of(outcomes, 'skipped'))}"
    )
    for test in unlisted:
        print(f"  FAILED, not in KNOWN_FAILURES: {test}")
    now_passing = [test for test in passed if test in known]
    for test in now_passing:
        print(f"  PASSED, but KNOWN_FAILURES lists it (remove it): {test}")
    return not unlisted and not now_passing


if __name__ == "__main__":
    from torch.testing._internal import common_utils

    sys.argv[1:] = _rest
    common_utils.parse_cmd_line_args()
    runner = unittest.TextTestRunner(resultclass=Outcomes, verbosity=2 if "-v" in _rest else 1)
    result = unittest.main(argv=common_utils.UNITTEST_ARGS, testRunner=runner, exit=False).result
    assert isinstance(result, Outcomes)
    known = KNOWN_FAILURES.get(_args.backend, {})
    outcomes = result.outcomes(known)
    if _args.outcomes:
        with open(_args.outcomes, "w", encoding="utf-8") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
    sys.exit(0 if _verdict(outcomes, _args.backend, known) else 1)
