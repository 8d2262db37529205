"""DistributedSampler against shards built by hand, and against torch's documented outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from axonml_distributed import ProcessGroup, spawn
from axonml_distributed.sampler import DistributedSampler

pytestmark = pytest.mark.timeout(60)


def expected_shards(
    n: int, replicas: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> list[list[int]]:
    """Torch's algorithm written out step by step with plain lists."""
    order = np.random.default_rng(seed + epoch).permutation(n).tolist() if shuffle else list(range(n))
    if drop_last:
        total = (n // replicas) * replicas
        order = order[:total]
    else:
        total = math.ceil(n / replicas) * replicas
        padded = list(order)
        while len(padded) < total:
            padded += order[: total - len(padded)]
        order = padded
    return [order[r::replicas] for r in range(replicas)]


def shards(n: int, replicas: int, epoch: int = 0, **kwargs: object) -> list[list[int]]:
    out = []
    for r in range(replicas):
        sampler = DistributedSampler(n, replicas, r, **kwargs)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_matches_torch_outputs_without_shuffle() -> None:
    # What torch.utils.data.DistributedSampler(range(10), 4, r, shuffle=False) yields.
    assert shards(10, 4, shuffle=False) == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert shards(10, 4, shuffle=False, drop_last=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Fewer samples than ranks: padding wraps around more than once.
    assert shards(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]
    assert shards(2, 5, shuffle=False, drop_last=True) == [[], [], [], [], []]


@given(
    n=st.integers(0, 300),
    replicas=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_matches_reference(
    n: int, replicas: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> None:
    got = shards(n, replicas, epoch, seed=seed, shuffle=shuffle, drop_last=drop_last)
    assert got == expected_shards(n, replicas, seed, epoch, shuffle, drop_last)
    lengths = {len(s) for s in got}
    assert lengths == {len(DistributedSampler(n, replicas, 0, drop_last=drop_last))}
    assert all(type(i) is int for s in got for i in s)
    flat = [i for s in got for i in s]
    if drop_last:
        assert len(flat) == n - n % replicas
        assert len(set(flat)) == len(flat)  # disjoint
    else:
        assert set(flat) == set(range(n))  # covers the dataset
        assert len(flat) == math.ceil(n / replicas) * replicas  # padding tops up to a multiple
        if n % replicas == 0:
            assert len(set(flat)) == n  # nothing repeated, so shards are disjoint


def test_reshuffles_each_epoch_identically_on_every_rank() -> None:
    first = shards(1000, 4, epoch=0, seed=7)
    second = shards(1000, 4, epoch=1, seed=7)
    assert first != second
    assert sorted(i for s in first for i in s) == sorted(i for s in second for i in s) == list(range(1000))
    # Re-creating the samplers (as separate ranks would) reproduces the same epoch exactly.
    assert shards(1000, 4, epoch=1, seed=7) == second
    assert shards(1000, 4, epoch=1, seed=8) != second


def test_accepts_sized_objects() -> None:
    assert list(DistributedSampler(np.zeros((6, 3)), 2, 1, shuffle=False)) == [1, 3, 5]
    assert list(DistributedSampler(range(5), 1, 0, shuffle=False)) == [0, 1, 2, 3, 4]


class FakeSubgroup:
    """A group of global ranks [2, 5, 9] seen from global rank 5."""

    def rank(self) -> int:
        return 5

    def size(self) -> int:
        return 3

    def group_rank(self, global_rank: int) -> int:
        return [2, 5, 9].index(global_rank)


def test_defaults_from_process_group() -> None:
    sampler = DistributedSampler(9, shuffle=False, process_group=FakeSubgroup())
    assert (sampler.num_replicas, sampler.rank) == (3, 1)
    assert list(sampler) == [1, 4, 7]
    explicit = DistributedSampler(9, rank=0, shuffle=False, process_group=FakeSubgroup())
    assert list(explicit) == [0, 3, 6]


def test_defaults_from_a_real_subgroup() -> None:
    def shard(pg: ProcessGroup) -> list[int] | None:
        if pg.rank() == 1:
            return None
        subgroup = ProcessGroup.with_ranks(pg.backend(), [0, 2])
        return list(DistributedSampler(6, shuffle=False, process_group=subgroup))

    assert spawn(shard, 3, timeout=30) == [[0, 2, 4], None, [1, 3, 5]]


@pytest.mark.parametrize(
    ("replicas", "rank", "error"),
    [
        (0, 0, ValueError),
        (-1, 0, ValueError),
        (4, 4, ValueError),
        (4, -1, ValueError),
        (None, 0, RuntimeError),  # no default group to ask
    ],
)
def test_rejects_bad_arguments(replicas: int | None, rank: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        DistributedSampler(10, replicas, rank)


def test_rejects_negative_length() -> None:
    with pytest.raises(ValueError, match="length"):
        DistributedSampler(-1, 2, 0)


def test_defaults_from_the_default_group() -> None:
    # As torch's DistributedSampler(dataset): replicas and rank come from the default group.
    def shard(pg: ProcessGroup) -> list[int]:
        return list(DistributedSampler(range(6), shuffle=False))

    assert spawn(shard, 3, timeout=30) == [[0, 3], [1, 4], [2, 5]]
