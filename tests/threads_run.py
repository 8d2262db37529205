"""Running the thread world for the tests (as shm_run and mpi_run run the others)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import axonml_distributed as ad


def outcomes(world: int, fn: Callable[[ad.ProcessGroup], Any], timeout: float = 30) -> list[Any]:
    """Run `fn` on every rank and return each rank's result or the exception it raised."""

    def wrapped(pg: ad.ProcessGroup) -> Any:
        try:
            return fn(pg)
        except Exception as e:  # noqa: BLE001 - the test inspects every rank's exception
            return e

    return ad.spawn(wrapped, world, timeout=timeout)
