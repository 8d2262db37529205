"""torch's own generic distributed tests (`DistributedTest._DistTestBase`) against a backend.

Run as a script, the way the pytorch repository's `test/distributed/test_distributed_spawn.py` runs the
same class: one test at a time, each in `WORLD_SIZE` fresh processes started by torch's spawn harness.

    python tests/torch_suite.py --backend axonml --world-size 2 [unittest args, e.g. -k all_gather]

torch's suite gates many CPU tests on the backend's name ("gloo"). For a backend other than gloo the
driver opens exactly these gates, and changes no test body (`GATES` below, applied to the module's
source before it is imported; each must match at least once, so a torch that renames one fails loudly):
- `require_backend_is_available({"gloo"})` also admits the backend under test;
- `BACKEND != "gloo"` skip conditions read "not gloo and not the backend under test";
- the one `BACKEND == "mpi" or BACKEND == "gloo"` branch (a CPU DDP test) takes the backend too;
- the backend joins torch's `ddp`, `subgroup` and `plugin` feature sets (as torch_ucc's driver does)
  and the three profiling allowlists (so profiler tests expect its events).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import types

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


def _load_suite(backend: str) -> types.ModuleType:
    """torch's distributed_test module with the gates above opened to `backend` (gloo: unchanged)."""
    from torch.testing._internal.common_distributed import DistTestCases

    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None and spec.loader is not None
    if backend == "gloo":
        return importlib.import_module(MODULE)
    for feature in FEATURES:
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


def _environment(argv: list[str]) -> list[str]:
    """Set the environment torch's suite reads at import (BACKEND, WORLD_SIZE, TEMP_DIR, INIT_METHOD),
    from the command line in the parent; spawned children inherit it. Returns unittest's arguments."""
    if "BACKEND" in os.environ and "TEMP_DIR" in os.environ:
        return argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="axonml")
    parser.add_argument("--world-size", type=int, default=2)
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
    return rest


_rest = _environment(sys.argv[1:])
_suite = _load_suite(os.environ["BACKEND"])


class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):  # type: ignore[name-defined,misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    sys.argv[1:] = _rest
    run_tests()
