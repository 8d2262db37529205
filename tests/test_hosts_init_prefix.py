"""`torch.hosts.init_prefix` in one process (threads as ranks, torch's HashStore as the job's store,
which keeps its keys across inits as torchrun's does across rounds): every rank of an init gets the same
prefix, a new one, however earlier inits over the same store went."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from axonml_distributed.exceptions import CollectiveTimeoutError  # noqa: E402
from axonml_distributed.torch.hosts import init_prefix  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=20)


def init(store: object, ranks: list[int], size: int, timeout: datetime.timedelta = TIMEOUT) -> list[object]:
    """Each of `ranks` (of a job of `size`) calls init_prefix at once: its prefix, or what it raised."""

    def one(rank: int) -> object:
        try:
            return init_prefix(store, rank, size, timeout)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 (returned for the test to look at)
            return e

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


@pytest.mark.timeout(60)
def test_an_init_that_one_rank_never_reached_does_not_split_the_next() -> None:
    store = dist.HashStore()
    first = init(store, [0, 1, 2, 3], 4)
    assert len(set(first)) == 1 and isinstance(first[0], str), first
    # Rank 3 never comes (a worker that died before init): rank 0 times out, as the init would anyway.
    short = init(store, [0, 1, 2], 4, datetime.timedelta(seconds=1))
    assert isinstance(short[0], CollectiveTimeoutError), short
    # The next round, every rank there: one prefix, not any earlier init's.
    again = init(store, [0, 1, 2, 3], 4)
    assert len(set(again)) == 1 and again[0] not in {*first, *short}, again


@pytest.mark.timeout(60)
def test_rounds_of_other_sizes_over_one_store_each_agree() -> None:
    """torchrun --nnodes 1:2: a round of one host's ranks, then of both (the store kept), then one."""
    store = dist.HashStore()
    seen: set[object] = set()
    for size in (2, 4, 2, 4, 3):
        got = init(store, list(range(size)), size)
        assert len(set(got)) == 1 and isinstance(got[0], str) and got[0] not in seen, (size, got)
        seen.add(got[0])
