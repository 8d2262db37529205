"""monitored_barrier on the "axonml" torch backend, under torchrun at 2 ranks: ``monitored.py OUT``.
Both ranks pass a monitored barrier on the group; then rank 1 never arrives at the second one and rank 0
(1 s) gets the timeout naming it. Each rank writes what it saw to OUT/rank{r}.txt, then exits at once
(the world is aborted)."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import axonml_distributed.torch  # noqa: F401 (registers the backend)


def main(out: Path) -> None:
    dist.init_process_group("axonml", timeout=timedelta(seconds=120))
    rank, group = dist.get_rank(), dist.group.WORLD
    seen = []
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30))
        seen.append("dist.monitored_barrier passed")
    except ValueError as exc:  # torch asks for a registered CPU device backend, which ours cannot claim
        seen.append(f"dist.monitored_barrier refused: {exc}")
    group.monitored_barrier(timedelta(seconds=30))
    seen.append("group.monitored_barrier passed")
    if rank == 1:
        time.sleep(5)
    else:
        try:
            group.monitored_barrier(timedelta(seconds=1), wait_all_ranks=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen.append(f"{type(exc).__name__}: {exc}")
    (out / f"rank{rank}.txt").write_text("\n".join(seen))
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
