"""A group whose members torch orders otherwise than by ascending global rank (`new_group(ranks,
sort_ranks=False)`, pytorch's test_c10d_common `test_new_group_ordered`): the core numbers a one-host
group's members ascending, so the backend refuses it on every member instead of putting gathered data and
group ranks elsewhere than torch expects; in ascending order, `sort_ranks=False` changes nothing."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import axonml_distributed.torch  # noqa: F401 (registers the backend)

pytestmark = pytest.mark.timeout(120)


def _rank(fn: Callable[[int, int], Any], rank: int, size: int, store: str, results: Any) -> None:
    try:
        dist.init_process_group("axonml", store=dist.FileStore(store, size), rank=rank, world_size=size)
        results.put((rank, fn(rank, size)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))
    results.close()
    results.join_thread()  # the put is sent by a thread, which os._exit would not wait for
    os._exit(0)


def ranks(size: int, fn: Callable[[int, int], Any]) -> list[Any]:
    """`fn(rank, size)` on each of `size` ranks of an "axonml" default group, forked from this process."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    directory = tempfile.mkdtemp(prefix="torch_group_order_")
    store = os.path.join(directory, "store")
    procs = [context.Process(target=_rank, args=(fn, r, size, store, results)) for r in range(size)]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        shutil.rmtree(directory, ignore_errors=True)
    return [got[r] for r in range(size)]


def ordered_groups(rank: int, size: int) -> list[str]:
    seen = []
    ascending = dist.new_group([0, 1], sort_ranks=False)
    assert isinstance(ascending, dist.ProcessGroup)  # both ranks are members
    gathered = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=ascending)
    seen.append(f"ascending: {[t.item() for t in gathered]}")
    try:
        dist.new_group([1, 0], sort_ranks=False)
        seen.append("descending: accepted")
    except ValueError as exc:
        seen.append(f"descending: {exc}")
    return seen


def test_a_group_in_another_order_than_ascending_ranks_is_refused_on_every_member() -> None:
    for seen in ranks(2, ordered_groups):
        assert seen[0] == "ascending: [0.0, 1.0]", seen
        assert seen[1].startswith("descending: the axonml backend numbers a group's members"), seen
        assert "new_group(ranks=[1, 0], sort_ranks=False)" in seen[1], seen
