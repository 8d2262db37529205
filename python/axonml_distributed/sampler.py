"""Split a dataset's indices into one shard per rank, with torch.utils.data.DistributedSampler's semantics."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sized
from typing import SupportsIndex

import numpy as np

from axonml_distributed._types import ProcessGroupLike
from axonml_distributed.init import get_default_group


class DistributedSampler:
    """Yields the dataset indices that belong to one rank, a different shuffle each epoch.

    Every rank builds the same permutation (``numpy.random.default_rng(seed + epoch)``) and takes every
    ``num_replicas``-th index starting at its rank, so shards are disjoint and all ranks get the same count.
    When the size does not divide, ``drop_last=False`` pads by repeating indices from the start of the
    permutation (a few samples are seen twice); ``drop_last=True`` drops the tail instead.

    ``num_replicas`` and ``rank`` default to ``process_group.size()`` and the caller's rank within it
    (``process_group`` None: the default group, as torch's sampler uses the default process group).
    """

    def __init__(
        self,
        dataset_len_or_sized: SupportsIndex | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        process_group: ProcessGroupLike | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            # As torch's: what is not given comes from the group (the default group when None).
            group = get_default_group() if process_group is None else process_group
            if num_replicas is None:
                num_replicas = group.size()
            if rank is None:
                rank = group.group_rank(group.rank())
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
        if isinstance(dataset_len_or_sized, Sized):
            self.dataset_len = len(dataset_len_or_sized)
        else:
            self.dataset_len = operator.index(dataset_len_or_sized)
        if self.dataset_len < 0:
            raise ValueError(f"dataset length must be >= 0, got {self.dataset_len}")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(self.dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle for the next pass; call it with the same value on every rank."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len)
        # np.resize repeats the array cyclically when growing (padding) and truncates when shrinking
        # (drop_last), which is exactly torch's rule in both cases.
        order = np.resize(order, self.total_size)
        return iter(order[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples
