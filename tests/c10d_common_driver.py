"""The backend-parameterised tests of pytorch's `test/distributed/test_c10d_common.py`, on each backend, side
by side (by default "axonml" and gloo).

The file is in pytorch's repository, not in the wheel; take the one of the installed torch:

    curl -LO https://raw.githubusercontent.com/pytorch/pytorch/v2.15.0/test/distributed/test_c10d_common.py
    python tests/c10d_common_driver.py --file test_c10d_common.py [--backends axonml gloo] [-k sequence] [-v]

or give a checkout (`git clone --depth 1 -b v2.15.0 https://github.com/pytorch/pytorch`) with
`--pytorch-src pytorch`.

The file's backend-parameterised tests are mixins that each backend's own test file (test_c10d_gloo.py,
test_c10d_nccl.py) completes with its backend. This driver completes them the same way, once a backend
(`COMPLETIONS`); every test runs in ranks forked from this process, at the world size its mixin sets:
- each `_test_<x>(self, backend)` (one parameter besides `self`, named `backend...`) of `AbstractCommTest`
  (2 ranks), `AbstractLargeCommTest` (4), `ProcessGroupWithDispatchedCollectivesTests` (1) and
  `AbstractTimeoutTest` (1, the rank that runs its thread) becomes `test_<x>`, called with the backend's
  name; the mixins' `device` is "cpu", as in test_c10d_gloo.py;
- `CommonDistributedDataParallelTest` (2 ranks) gets the backend's default group from `_get_process_group`,
  as test_c10d_gloo.py's `DistributedDataParallelTest` does, and runs its own `test_*` and, as gloo's
  `test_gloo_backend_cpu_module*` do, `_test_ddp_with_process_group` on a CPU module, with and without
  gradients as bucket views.
A mixin that is itself a test case keeps its own `test_*` out (they take no backend).

test_c10d_gloo.py gates most of its `CommTest` calls with `skip_if_lt_x_gpu(2)`; those decorators are in
that file, not in this one, and are not copied: their bodies mostly run on CPU, and where one needs an
accelerator it fails on gloo as well, which the report says (on a machine without one, three do:
`test_sequence_num_incremented_default_group` and `_subgroup` and `test_warn_not_in_group` ask for the
rank's device; a CUDA build of torch then says "Cannot re-initialize CUDA in forked subprocess"). The
file's own `skip_if_lt_x_gpu` decorators (on the DDP tests) are decided in this process, as
tests/torch_suite.py does.

No gate is opened, and no test body changed: the file names a backend only to pick a device (nccl: cuda,
xccl: xpu, else cpu) and to spare gloo the `reduce_scatter` and `all_to_all` it lacks in
`_call_collective_with_varying_tensors` (`if backend != "gloo"`), which any other backend then runs.

The run prints, per backend, the tests ran, passed, failed and skipped, then each failure with its reason
(the last exception line of the failing rank) and whether the reference backend (the last one given,
gloo by default) fails it too. It fails if a backend fails a test the reference passes that
`KNOWN_FAILURES` does not list, or if a listed test passes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import unittest
from pathlib import Path
from typing import Any

from torch_tests import ForkedRanks, Outcomes, accelerator_count, decide_accelerator_skips_in_parent, of

FILE_IN_SOURCE = Path("test/distributed/test_c10d_common.py")

# Each mixin the file's backend-parameterised tests are written in, and what completes it besides the
# backend: the rest of its bases, and attributes the backends' test files set.
COMPLETIONS: dict[str, dict[str, Any]] = {
    "AbstractCommTest": {"device": "cpu"},
    "AbstractLargeCommTest": {"device": "cpu"},
    "ProcessGroupWithDispatchedCollectivesTests": {},
    "AbstractTimeoutTest": {"world_size": 1},
    "CommonDistributedDataParallelTest": {},
}

# Tests a backend fails, each with the reason; a listed test that passes fails the run.
KNOWN_FAILURES: dict[str, dict[str, str]] = {}

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Failure|Interrupt|Exit)\b(?::.*)?$", re.M)


def reason(trace: str) -> str:
    """The last exception line of a failure's text (a multi-process test's text ends with the failed
    ranks' tracebacks), or its last line."""
    lines = _EXCEPTION_LINE.findall(trace) or [line for line in trace.splitlines() if line.strip()] or [""]
    return lines[-1].strip()


def backend_methods(mixin: type) -> list[str]:
    """The `_test_*` methods of `mixin` whose one argument is the backend."""
    names = []
    for name, member in inspect.getmembers(mixin, inspect.isfunction):
        parameters = list(inspect.signature(member).parameters)
        if name.startswith("_test_") and len(parameters) == 2 and parameters[1].startswith("backend"):
            names.append(name)
    return names


def _calling(method: str) -> Any:
    def test(self: Any) -> None:
        getattr(self, method)(self.backend)

    test.__name__ = "test" + method[len("_test") :]
    return test


def _ddp_cpu_module(gradient_as_bucket_view: bool) -> Any:
    def test(self: Any) -> None:
        import torch

        group = self._get_process_group()
        self._test_ddp_with_process_group(
            group, [torch.device("cpu")], None, gradient_as_bucket_view=gradient_as_bucket_view
        )

    return test


def _default_group(self: Any) -> Any:
    import torch.distributed as dist

    store = dist.FileStore(self.file_name, self.world_size)
    dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size)
    return dist.distributed_c10d._get_default_group()


def _start_ranks(self: Any) -> None:
    super(type(self), self).setUp()
    if not self.processes:  # the mixin's own setUp may have started them
        self._spawn_processes()


def completed(module: types.ModuleType, mixin_name: str, backend: str) -> tuple[type, list[str]]:
    """`mixin_name` of `module` completed with `backend` as a forked multi-process test case, and the names
    of its tests."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    mixin = getattr(module, mixin_name, None)
    if not isinstance(mixin, type):
        raise RuntimeError(f"{module.__file__} has no class {mixin_name}: update COMPLETIONS")
    attributes: dict[str, Any] = dict(COMPLETIONS[mixin_name], backend=backend, setUp=_start_ranks)
    tests = [_calling(method) for method in backend_methods(mixin)]
    if mixin_name == "CommonDistributedDataParallelTest":
        attributes["_get_process_group"] = _default_group
        attributes["test_ddp_cpu_module"] = _ddp_cpu_module(False)
        attributes["test_ddp_cpu_module_grad_is_view"] = _ddp_cpu_module(True)
    attributes.update((test.__name__, test) for test in tests)
    bases: tuple[type, ...] = (ForkedRanks, mixin)
    if not issubclass(mixin, MultiProcessTestCase):
        bases += (MultiProcessTestCase,)
    case = type(mixin_name.removeprefix("Abstract"), bases, attributes)
    names = unittest.TestLoader().getTestCaseNames(case)
    if issubclass(mixin, unittest.TestCase):
        names = [name for name in names if name in attributes]
    return case, list(names)


def load(path: Path) -> types.ModuleType:
    """The test file as the module `test_c10d_common`, its accelerator skips decided in this process."""
    decide_accelerator_skips_in_parent(accelerator_count())
    spec = importlib.util.spec_from_file_location("test_c10d_common", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(module: types.ModuleType, backend: str, patterns: list[str], verbosity: int) -> Outcomes:
    """Every completed test of `module` on `backend` whose `Class.test` name holds one of `patterns`."""
    suite = unittest.TestSuite()
    for mixin_name in COMPLETIONS:
        case, names = completed(module, mixin_name, backend)
        for name in names:
            if not patterns or any(p in f"{case.__name__}.{name}" for p in patterns):
                suite.addTest(case(name))
    print(f"--- {backend}: {suite.countTestCases()} tests", flush=True)
    result = unittest.TextTestRunner(resultclass=_QualifiedOutcomes, verbosity=verbosity).run(suite)
    assert isinstance(result, Outcomes)
    return result


class _QualifiedOutcomes(Outcomes):
    """Outcomes named `Class.test` (the file's classes share test names)."""

    @staticmethod
    def naming(test: unittest.TestCase) -> str:
        return ".".join(test.id().rsplit(".", 2)[-2:])


def report(outcomes: dict[str, dict[str, str]], reasons: dict[str, dict[str, str]]) -> bool:
    """Print the counts side by side and each failure with its reason; True if no backend breaks the rule
    (fail only what the reference fails, or what `KNOWN_FAILURES` lists)."""
    backends = list(outcomes)
    reference = outcomes[backends[-1]]
    rows = {
        "ran": ("passed", "failed", "known failure"),
        "passed": ("passed",),
        "failed": ("failed", "known failure"),
        "skipped": ("skipped",),
    }
    print(f"\n{'':10}" + "".join(f"{b:>10}" for b in backends))
    for row, kinds in rows.items():
        print(f"{row:10}" + "".join(f"{len(of(outcomes[b], *kinds)):>10}" for b in backends))
    ok = True
    for backend in backends:
        known = KNOWN_FAILURES.get(backend, {})
        for test in of(outcomes[backend], "failed", "known failure"):
            if test in known:
                note = f"known: {known[test]}"
            elif backend != backends[-1] and reference.get(test) != "passed":
                note = f"{reference.get(test, 'not run')} on {backends[-1]} too"
            else:
                note = "REGRESSION" if backend != backends[-1] else ""
                ok = ok and backend == backends[-1]
            print(f"  {backend} {test}: {reason(reasons[backend][test])}" + (f"  [{note}]" if note else ""))
        for test in of(outcomes[backend], "passed"):
            if test in known:
                ok = False
                print(f"  {backend} {test}: PASSED, but KNOWN_FAILURES lists it (remove it)")
    return ok


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, help="pytorch's test/distributed/test_c10d_common.py")
    source.add_argument("--pytorch-src", type=Path, help="a checkout of pytorch, which holds the file")
    parser.add_argument("--backends", nargs="+", default=["axonml", "gloo"], help="the last is the reference")
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="run tests named with this")
    parser.add_argument("-v", dest="verbose", action="store_true")
    parser.add_argument("--outcomes", type=Path, help="also write each backend's outcomes there, as JSON")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    path = args.file if args.file else args.pytorch_src / FILE_IN_SOURCE
    # Before torch is imported (it reads OMP_NUM_THREADS then); the forked ranks inherit them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from torch.testing._internal import common_utils

    sys.argv[1:] = []
    common_utils.parse_cmd_line_args()
    module = load(path)
    verbosity = 2 if args.verbose else 1
    results = {backend: run(module, backend, args.patterns, verbosity) for backend in args.backends}
    outcomes = {b: r.outcomes(KNOWN_FAILURES.get(b, {})) for b, r in results.items()}
    if args.outcomes:
        args.outcomes.write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    print(f"\ntest_c10d_common's backend-parameterised tests ({path}):")
    return 0 if report(outcomes, {b: r.reasons() for b, r in results.items()}) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
