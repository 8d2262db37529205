"""`torch.hosts_signature` in one process: the rows four ranks' calls make, as torch hands each gloo
method its arguments (simulated hosts run the real thing: tests/test_hosts_torch.py). Calls torch and
gloo accept, uneven ones included, make equal rows on every rank; a size one off on one rank does not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
c10d = pytest.importorskip("torch._C._distributed_c10d")  # every options class (torch.distributed: some)

from axonml_distributed.torch.hosts_signature import Signature, forwarded  # noqa: E402

W = 4


def opts(kind: str, **fields: Any) -> Any:
    made = getattr(c10d, kind)()
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def t(n: int) -> Any:
    return torch.zeros(n)


# gloo's method -> rank r's arguments, given the size `n` rank r uses (its own buffers consistent).
CALLS: dict[str, Callable[[int, int], list[Any]]] = {
    "broadcast": lambda r, n: [[t(n)], opts("BroadcastOptions", rootRank=1)],
    "reduce": lambda r, n: [[t(n)], opts("ReduceOptions", rootRank=2)],
    "allgather": lambda r, n: [[[t(n) for _ in range(W)]], [t(n)], opts("AllgatherOptions")],
    "allgather_coalesced": lambda r, n: [[[t(n), t(3)] for _ in range(W)], [t(n), t(3)]],
    "all_gather_single": lambda r, n: [t(W * n), t(n), opts("AllgatherOptions")],
    "all_gather_single_coalesced": lambda r, n: [
        [t(W * n), t(W * 2)],
        [t(n), t(2)],
        opts("AllgatherOptions"),
    ],
    "reduce_scatter_single": lambda r, n: [t(n), t(W * n), opts("ReduceScatterOptions")],
    "reduce_scatter_single_coalesced": lambda r, n: [[t(n)], [t(W * n)], opts("ReduceScatterOptions")],
    "gather": lambda r, n: [
        [[t(n) for _ in range(W)]] if r == 1 else [],
        [t(n)],
        opts("GatherOptions", rootRank=1),
    ],
    "scatter": lambda r, n: [
        [t(n)],
        [[t(n) for _ in range(W)]] if r == 3 else [],
        opts("ScatterOptions", rootRank=3),
    ],
    "alltoall": lambda r, n: [[t(n) for _ in range(W)], [t(n) for _ in range(W)], opts("AllToAllOptions")],
}


def rows(name: str, sizes: list[int]) -> list[list[int]]:
    return [forwarded(name, CALLS[name](r, sizes[r]), W, r)[0] for r in range(W)]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_alike_calls_agree_and_one_size_off_does_not(name: str) -> None:
    alike = rows(name, [5] * W)
    assert all(row == alike[0] for row in alike) and alike[0][6] != -1, alike
    off = rows(name, [5, 5, 6, 5])
    assert off[2] != off[0], off


def test_uneven_reduce_scatter_lists_agree_and_a_list_that_differs_does_not() -> None:
    """gloo allows rank r's output its own size, entry r of every rank's list being that size."""

    def call(r: int, sizes: list[int]) -> list[int]:
        args = [[t(sizes[r])], [[t(s) for s in sizes]], opts("ReduceScatterOptions")]
        return forwarded("reduce_scatter", args, W, r)[0]

    uneven = [2, 3, 4, 5]
    made = [call(r, uneven) for r in range(W)]
    assert all(row == made[0] for row in made) and made[0][6] != -1, made
    assert call(2, [2, 3, 4, 6]) != made[0]  # rank 2's list says rank 3's output is another size


def test_all_to_all_single_leaves_splits_to_the_pairing_and_refuses_splits_that_do_not_add_up() -> None:
    sends = [[s + p + 1 for p in range(W)] for s in range(W)]
    made = [
        forwarded(
            "all_to_all_single",
            [
                t(sum(sends[p][r] for p in range(W))),
                t(sum(sends[r])),
                [sends[p][r] for p in range(W)],
                sends[r],
                opts("AllToAllOptions"),
            ],
            W,
            r,
        )
        for r in range(W)
    ]
    assert all(row == made[0][0] for row, _ in made) and made[0][0][6] != -1, made
    assert made[1][1] == (sends[1], [sends[p][1] for p in range(W)])
    bad = forwarded(
        "all_to_all_single", [t(4), t(5), [1, 1, 1, 1], [1, 1, 1, 1], opts("AllToAllOptions")], W, 0
    )
    assert bad[0][6] == -1


def test_a_root_whose_list_does_not_fit_says_so() -> None:
    args = [[[t(5) for _ in range(W - 1)]], [t(5)], opts("GatherOptions", rootRank=0)]
    assert forwarded("gather", args, W, 0)[0][6] == -1


def test_all_to_all_single_counts_splits_in_rows_of_dim_0_as_torch_does() -> None:
    """Splits count rows (torch's and gloo's unit), the pairing compares the elements they move; a rank
    leaving the even default pairs with one that spells it out."""
    row = 3
    sends = [[s + p + 1 for p in range(W)] for s in range(W)]

    def call(r: int, spelled: bool) -> Any:
        out, inp = torch.zeros(sum(sends[p][r] for p in range(W)), row), torch.zeros(sum(sends[r]), row)
        splits = ([sends[p][r] for p in range(W)], sends[r]) if spelled else ([], [])
        return forwarded("all_to_all_single", [out, inp, *splits, opts("AllToAllOptions")], W, r)

    made = [call(r, True) for r in range(W)]
    assert all(row_ == made[0][0] for row_, _ in made) and made[0][0][6] != -1, made
    assert made[1][1] == ([s * row for s in sends[1]], [sends[p][1] * row for p in range(W)])
    even = torch.zeros(2 * W, row)
    spelled = forwarded("all_to_all_single", [even, even, [2] * W, [2] * W, opts("AllToAllOptions")], W, 0)
    default = forwarded("all_to_all_single", [even, even, [], [], opts("AllToAllOptions")], W, 1)
    assert spelled[0][6] != -1 and spelled[1] == default[1] == ([2 * row] * W, [2 * row] * W)


class _Gathered:
    """A flat group whose all-gather hands every rank `rows` (what the ranks' rows would gather to)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self._rows = rows

    def _allgather_base(self, out: Any, _mine: Any) -> Any:
        out.copy_(torch.tensor(self._rows, dtype=torch.int64).view(-1))
        return self

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("which", ["output", "input"])
def test_a_strided_all_to_all_single_tensor_on_one_rank_is_refused_on_every_rank(which: str) -> None:
    """gloo refuses a strided input on its rank alone (the others wait) and writes a strided output
    wrongly: the rank's row says so, and every rank, seeing the rows, raises one host's ValueError."""

    def args(r: int) -> list[Any]:
        out, inp = t(2 * W), t(2 * W)
        if r == 3:
            out, inp = (out[::2], inp[:W]) if which == "output" else (out[:W], inp[::2])
        else:
            out, inp = out[:W], inp[:W]
        return [out, inp, [], [], opts("AllToAllOptions")]

    made = [forwarded("alltoall_base", args(r), W, r)[0] for r in range(W)]
    assert made[3] != made[0] and all(row == made[0] for row in made[:3]), made
    for r in range(W):
        with pytest.raises(ValueError, match=r"Tensors must be contiguous.*rank\(s\) \[3\]"):
            Signature(made[r], _Gathered(made), W).check(list(range(W)))
