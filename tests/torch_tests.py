"""What our drivers of torch's own multi-process test classes share (tests/torch_suite.py for
`DistributedTest`, tests/c10d_common_driver.py for `test_c10d_common`): ranks forked rather than spawned,
accelerator skips decided in the parent, and each test's outcome.

torch's `MultiProcessTestCase` spawns its ranks: each child imports torch again (15-20 s a test on a loaded
machine) and, run from a script, the script too. A forked child inherits both, as the pytorch repository's
former `test_distributed_fork.py` ran the same classes.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable
from typing import Any


class ForkedRanks:
    """Mixin (first among the bases) for a `MultiProcessTestCase`: its ranks are forked from this process."""

    def _spawn_processes(self) -> None:
        import torch.multiprocessing

        self._start_processes(torch.multiprocessing.get_context("fork").Process)  # type: ignore[attr-defined]


def skip_decided(decorator: Callable[[Any], Any], skip: str | None) -> Callable[[Any], Any]:
    """`decorator`, and `unittest.skip` with torch's message for the `TEST_SKIPS` key `skip` if given: the
    test is skipped in this process, where the children would exit with that skip."""
    from torch.testing._internal import common_distributed as cd

    def apply(func: Any) -> Any:
        wrapped = decorator(func)
        return unittest.skip(cd.TEST_SKIPS[skip].message)(wrapped) if skip else wrapped

    return apply


def decide_accelerator_skips_in_parent(accelerators: int) -> None:
    """Make torch's `skip_if_lt_x_gpu` skip in this process when the machine has too few accelerators. Call
    before the test module is imported: its decorators bind the function then."""
    from torch.testing._internal import common_distributed as cd

    lt_x_gpu = cd.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Callable[[Any], Any]:
        runs = accelerators >= x or (allow_cpu and not accelerators)
        return skip_decided(lt_x_gpu(x, allow_cpu=allow_cpu), None if runs else f"multi-device-{x}")

    cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def accelerator_count() -> int:
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def short_name(test: unittest.TestCase) -> str:
    """The test's name within its class (`test_x`); `qualified_name` adds its class."""
    return test.id().rsplit(".", 1)[-1]


def qualified_name(test: unittest.TestCase) -> str:
    return ".".join(test.id().rsplit(".", 2)[-2:])


class Outcomes(unittest.TextTestResult):
    """unittest's text result that also keeps every started test, for `outcomes`."""

    naming: Callable[[unittest.TestCase], str] = staticmethod(short_name)  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: list[str] = []

    def startTest(self, test: unittest.TestCase) -> None:
        self.started.append(self.naming(test))
        super().startTest(test)

    def outcomes(self, known: dict[str, str]) -> dict[str, str]:
        """Each started test's outcome: "passed", "failed", "known failure" (failed, and in `known`) or
        "skipped"."""
        result = dict.fromkeys(self.started, "passed")
        failed = {self.naming(test) for test, _ in self.failures + self.errors}
        result.update((test, "known failure" if test in known else "failed") for test in failed)
        result.update((self.naming(test), "skipped") for test, _ in self.skipped)
        return result

    def reasons(self) -> dict[str, str]:
        """Each failed test's traceback (for a multi-process test, the failed ranks' tracebacks)."""
        return {self.naming(test): trace for test, trace in self.failures + self.errors}


def of(outcomes: dict[str, str], *kinds: str) -> list[str]:
    """The tests whose outcome is one of `kinds`, sorted."""
    return sorted(test for test, outcome in outcomes.items() if outcome in kinds)
