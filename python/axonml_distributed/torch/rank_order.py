"""torch's order of a group's members against the core's.

torch numbers a group's members by their place in the ranks given to ``new_group`` (``sort_ranks=False``
keeps the order given); the core numbers a one-host group's members by ascending global rank. When the
two differ, a `RankOrder` translates between them: group ranks, lists with one item per member, and
tensors whose chunks along their first dimension are one per member.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


class RankOrder:
    """A permutation of a group's members: torch's group rank i is the core's group rank ``_native[i]``,
    and the core's p is torch's ``_torch[p]``."""

    __slots__ = ("_native", "_torch", "_native_index", "_torch_index")

    def __init__(self, ranks: Sequence[int]) -> None:
        """`ranks`: the group's global ranks in torch's order."""
        place = {r: p for p, r in enumerate(sorted(ranks))}
        self._native = [place[r] for r in ranks]
        self._torch = [0] * len(ranks)
        for i, p in enumerate(self._native):
            self._torch[p] = i
        self._native_index = torch.tensor(self._native, dtype=torch.long)
        self._torch_index = torch.tensor(self._torch, dtype=torch.long)

    @staticmethod
    def of(ranks: Sequence[int]) -> RankOrder | None:
        """The order of a group of global `ranks` (torch's order), or None when it is the core's."""
        ranks = list(ranks)
        return None if ranks == sorted(ranks) else RankOrder(ranks)

    def _count(self, items: Sequence[object], what: str) -> None:
        if len(items) != len(self._native):
            raise ValueError(f"{what} has {len(items)} entries, one per member needs {len(self._native)}")

    def reorder(self, items: Sequence[T], what: str = "a per-rank list") -> list[T]:
        """Items in torch's order (one per member) in the core's: the same objects, no copy."""
        self._count(items, what)
        return [items[i] for i in self._torch]

    def restore(self, items: Sequence[T], what: str = "a per-rank list") -> list[T]:
        """Items in the core's order in torch's (`reorder`'s inverse)."""
        self._count(items, what)
        return [items[p] for p in self._native]

    def reorder_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of shape (members, ...) in torch's order as a new one in the core's (one copy)."""
        return t.index_select(0, self._torch_index)

    def restore_rows(self, native: torch.Tensor, into: torch.Tensor) -> None:
        """Copy the rows of `native`, of shape (members, ...) in the core's order, into `into` in
        torch's (one copy)."""
        torch.index_select(native, 0, self._native_index, out=into)
