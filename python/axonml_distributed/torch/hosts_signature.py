"""The signature check of a group over several hosts: before any data moves, every rank's call (which
collective, dtype, the element counts that must agree, root, op) is all-gathered over the group's flat
gloo group, so a call that differs across hosts is refused on every rank with CollectiveMismatchError
before any buffer changes (inside a host the core checks its own calls, but ranks on other hosts meet
only in gloo, which moves mismatched bytes, fails on one side, or waits for the timeout).

What must agree follows gloo's rules (torch 2.15, measured): broadcast, reduce, all_gather(_into_tensor),
gather, scatter and all_to_all (lists) need every rank's tensor of one size; reduce_scatter (lists) lets
each rank's output differ, but every rank's input list must have the same sizes (entry i being rank i's
output); all_to_all_single lets split sizes differ, as long as what rank s sends rank p is what p expects
from s: those are all-gathered in a second exchange (the splits matrix), after the first agreed. A rank
whose own buffers do not fit its call (an output of the wrong size, a root's list not one tensor per
rank of the input's size: where gloo would fail on that rank alone and leave the others waiting) says
so in its row, so every rank refuses the call. A strided tensor given to all_to_all_single (gloo refuses a
strided input on that rank alone and writes a strided output wrongly) is said so too: every rank raises
ValueError, as one host does (`torch.group.any_strided`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed.exceptions import CollectiveMismatchError
from axonml_distributed.torch.group import any_strided

# Dtypes and ops by their place here (-1: another).
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_DTYPES += (torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool)
_OPS = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.PREMUL_SUM,
    dist.ReduceOp.PRODUCT,
    dist.ReduceOp.MIN,
    dist.ReduceOp.MAX,
    dist.ReduceOp.BAND,
    dist.ReduceOp.BOR,
    dist.ReduceOp.BXOR,
)
# A row's fields: call, dtype, count (elements that must agree, -1: none), tensors, root (-1: none), op
# (-1: none), sizes (a digest of per-tensor sizes that must agree, 0 for one tensor; -1: this rank's own
# buffers do not fit its call; -2: it passed a strided tensor where the call takes none).
FIELDS = 7
_NO_FIT = -1
_STRIDED = -2


@dataclass(frozen=True)
class Call:
    """What a rank's call says of itself: the tensors whose count and sizes every rank must share
    (`shared`), whether its other buffers fit them, and (all_to_all_single) its send and receive splits
    and whether a tensor of it is strided."""

    shared: Sequence[torch.Tensor]
    fits: bool = True
    splits: tuple[list[int], list[int]] | None = None
    strided: bool = False


def _numel(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [t.numel() for t in tensors]


def _lists_fit(lists: Sequence[Sequence[torch.Tensor]], sizes: list[int]) -> bool:
    return all(_numel(tensors) == sizes for tensors in lists)


def _broadcast(tensors: list[torch.Tensor], *_: Any) -> Call:
    return Call(tensors)


def _allgather(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], size: int) -> Call:
    # outputs[i]: one tensor per rank, each of inputs[i]'s size
    fits = len(outputs) == len(inputs) and all(
        _numel(out) == [t.numel()] * size for out, t in zip(outputs, inputs, strict=False)
    )
    return Call(inputs, fits)


def _allgather_coalesced(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], size: int) -> Call:
    # outputs[r]: rank r's tensors, each of the matching input's size
    return Call(inputs, len(outputs) == size and _lists_fit(outputs, _numel(inputs)))


def _gather_single(output: torch.Tensor, input: torch.Tensor, size: int) -> Call:
    return Call([input], output.numel() == size * input.numel())


def _gather_single_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], size: int) -> Call:
    fits = len(outputs) == len(inputs) and all(
        o.numel() == size * i.numel() for o, i in zip(outputs, inputs, strict=False)
    )
    return Call(inputs, fits)


def _reduce_scatter(
    outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], size: int, me: int
) -> Call:
    # Each rank's output may differ in size: entry i of every rank's input list is rank i's output, so
    # the lists agree across ranks and this rank's entry is its output's size.
    fits = len(outputs) == len(inputs) and all(
        len(lst) == size and lst[me].numel() == out.numel() for out, lst in zip(outputs, inputs, strict=False)
    )
    return Call([t for lst in inputs for t in lst], fits)


def _scatter_single(output: torch.Tensor, input: torch.Tensor, size: int) -> Call:
    return Call([output], input.numel() == size * output.numel())


def _scatter_single_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], size: int) -> Call:
    fits = len(outputs) == len(inputs) and all(
        i.numel() == size * o.numel() for o, i in zip(outputs, inputs, strict=False)
    )
    return Call(outputs, fits)


def _gather(
    outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], size: int, me: int, root: int
) -> Call:
    # Only the root has a list (one tensor per rank of the input's size); gloo wants none elsewhere.
    fits = _lists_fit(outputs, [inputs[0].numel()] * size) if me == root and inputs else not outputs
    return Call(inputs, fits and len(outputs) == (me == root))


def _gather_into(output: torch.Tensor, input: torch.Tensor, size: int, me: int, root: int) -> Call:
    return Call([input], me != root or output.numel() == size * input.numel())


def _scatter(
    outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], size: int, me: int, root: int
) -> Call:
    fits = _lists_fit(inputs, [outputs[0].numel()] * size) if me == root and outputs else not inputs
    return Call(outputs, fits and len(inputs) == (me == root))


def _alltoall(outputs: list[torch.Tensor], inputs: list[torch.Tensor], size: int) -> Call:
    # gloo's list form moves one size everywhere (uneven lists are its own error on every rank).
    sizes = _numel(inputs)
    return Call(
        inputs[:1], len(inputs) == len(outputs) == size and _numel(outputs) == sizes == sizes[:1] * size
    )


def _alltoall_base(
    output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], size: int
) -> Call:
    def splits(t: torch.Tensor, given: list[int]) -> tuple[list[int], bool]:
        """In elements: torch and gloo count splits in rows (along dim 0), which ranks may give or leave
        to the even default."""
        rows = t.size(0) if t.dim() else t.numel()
        row = t.numel() // rows if rows else 0
        if given:
            fits = len(given) == size and sum(given) == rows and min(given) >= 0
            return [s * row for s in given], fits
        return [rows // size * row] * size, rows % size == 0

    sends, send_ok = splits(input, in_splits)
    receives, receive_ok = splits(output, out_splits)
    # One host's check, whose ValueError every rank then raises (`check`).
    return Call([], send_ok and receive_ok, (sends, receives), any_strided(input, output))


# gloo's method -> what its call says of itself, from the call's arguments (options last) and the group
# (its size; rank and root where they matter).
_CALLS: dict[str, Callable[..., Call]] = {
    "broadcast": _broadcast,
    "reduce": _broadcast,
    "allgather": _allgather,
    "allgather_coalesced": _allgather_coalesced,
    "all_gather_single": _gather_single,
    "_allgather_base": _gather_single,
    "all_gather_single_coalesced": _gather_single_coalesced,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_single": _scatter_single,
    "_reduce_scatter_base": _scatter_single,
    "reduce_scatter_single_coalesced": _scatter_single_coalesced,
    "gather": _gather,
    "gather_single": _gather_into,
    "gather_into_tensor": _gather_into,
    "scatter": _scatter,
    "alltoall": _alltoall,
    "alltoall_base": _alltoall_base,
    "all_to_all_single": _alltoall_base,
    "barrier": lambda *_: Call([]),
}
_NEEDS_RANK = {"reduce_scatter"}
_NEEDS_ROOT = {"gather", "gather_single", "gather_into_tensor", "scatter"}
NAMES = ("all_reduce", *sorted(_CALLS))


def all_reduce_row(kind: Any, tensors: list[torch.Tensor]) -> list[int]:
    """all_reduce: the op, dtype, element count, tensor count (and their sizes, for several)."""
    return _row("all_reduce", tensors, Call(tensors), -1, _op_code(kind))


def forwarded(
    theirs: str, args: list[Any], size: int, me: int
) -> tuple[list[int], tuple[list[int], list[int]] | None]:
    """Another collective's row (gloo's method `theirs`, its arguments as torch passed them) and its
    splits (all_to_all_single), for `Signature`."""
    opts: Any = next((a for a in args if type(a).__name__.endswith("Options")), None)
    root = int(opts.rootRank) if hasattr(opts, "rootRank") else -1
    op = _op_code(opts.reduceOp) if hasattr(opts, "reduceOp") else -1
    data = [a for a in args if a is not opts]
    extra = [me] if theirs in _NEEDS_RANK else [me, root] if theirs in _NEEDS_ROOT else []
    try:
        call = _CALLS[theirs](*data, size, *extra)
    except (IndexError, TypeError, ValueError):  # arguments gloo itself will refuse on this rank
        call = Call([], False)
    return _row(theirs, tensors_in(data), call, root, op), call.splits


def _row(name: str, tensors: list[torch.Tensor], call: Call, root: int, op: int) -> list[int]:
    dtype = tensors[0].dtype if tensors else None
    shared = _numel(call.shared)
    count = -1 if call.splits is not None else sum(shared)
    if call.strided:
        sizes = _STRIDED
    elif not call.fits:
        sizes = _NO_FIT
    elif len(shared) > 1:
        digest = hashlib.blake2b(repr(shared).encode(), digest_size=8).digest()
        sizes = int.from_bytes(digest, "little") >> 2  # non-negative in an int64
    else:
        sizes = 0
    return [NAMES.index(name), _dtype_code(dtype), count, len(shared), root, op, sizes]


def tensors_in(args: list[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, list | tuple):
            found += tensors_in(list(a))
    return found


class Signature:
    """Every rank's row, all-gathered over the flat group (started when the call is made; `check`
    waits), then, for all_to_all_single, every rank's splits."""

    def __init__(
        self, row: list[int], flat: Any, size: int, splits: tuple[list[int], list[int]] | None = None
    ) -> None:
        self._mine = torch.tensor(row, dtype=torch.int64)
        self._all = torch.empty(size * FIELDS, dtype=torch.int64)
        self._work = flat._allgather_base(self._all, self._mine)
        self._flat, self._size, self._splits = flat, size, splits

    def check(self, ranks: list[int]) -> None:
        self._work.wait()
        rows = self._all.view(-1, FIELDS).tolist()
        strided = [ranks[i] for i, row in enumerate(rows) if row[6] == _STRIDED]
        if strided:  # every rank sees the same rows: each refuses it alike
            name = NAMES[rows[ranks.index(strided[0])][0]]
            raise ValueError(
                f"Tensors must be contiguous: {name} across hosts takes no strided view (as gloo and nccl), "
                f"and rank(s) {strided} of group {ranks} passed one; pass .contiguous() of it"
            )
        unfit = [ranks[i] for i, row in enumerate(rows) if row[6] == _NO_FIT]
        if all(row == rows[0] for row in rows) and not unfit:
            if self._splits is not None:
                self._check_splits(ranks)
            return
        calls = {ranks[i]: describe(row) for i, row in enumerate(rows)}
        odd = sorted({ranks[i] for i, row in enumerate(rows) if row != rows[0]} | set(unfit))
        theirs = "; ".join(f"rank {rank} called {call}" for rank, call in calls.items())
        raise CollectiveMismatchError(
            f"collective mismatch across hosts in group {ranks}: {theirs}; no buffer was changed",
            calls=calls,
            ranks=odd,
            call=calls[ranks[0]],
            group=ranks,
        )

    def _check_splits(self, ranks: list[int]) -> None:
        """What each rank sends each other is what that one expects from it (all_to_all_single)."""
        assert self._splits is not None
        n = self._size
        mine = torch.tensor([*self._splits[0], *self._splits[1]], dtype=torch.int64)
        every = torch.empty(n * 2 * n, dtype=torch.int64)
        self._flat._allgather_base(every, mine).wait()
        table = every.view(n, 2 * n).tolist()
        pairs = [(s, p) for s in range(n) for p in range(n) if table[s][p] != table[p][n + s]]
        if not pairs:
            return
        wrong = "; ".join(
            f"rank {ranks[s]} sends {table[s][p]} element(s) to rank {ranks[p]}, "
            f"which expects {table[p][n + s]}"
            for s, p in pairs
        )
        raise CollectiveMismatchError(
            f"collective mismatch across hosts in group {ranks}: all_to_all_single split sizes do not pair "
            f"up: {wrong}; no buffer was changed",
            calls={
                ranks[i]: f"all_to_all_single(sends {r[:n]}, receives {r[n:]})" for i, r in enumerate(table)
            },
            ranks=sorted({ranks[s] for s, _ in pairs}),
            call="all_to_all_single",
            group=ranks,
        )


def _dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _op_code(kind: Any) -> int:
    kind = kind.op if hasattr(kind, "op") else kind
    return _OPS.index(kind) if kind in _OPS else -1


def describe(row: list[int]) -> str:
    what, code, count, tensors, root, op, sizes = row
    name = NAMES[what] if 0 <= what < len(NAMES) else f"call {what}"
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "another dtype"
    parts = [str(_OPS[op]).rsplit(".", 1)[-1]] if 0 <= op < len(_OPS) else []
    if count >= 0:
        parts.append(f"{count} x {dtype}" + (f" in {tensors} tensor(s)" if tensors != 1 else ""))
    else:
        parts.append(dtype)
    if root >= 0:
        parts.append(f"root {root}")
    if sizes == _NO_FIT:
        parts.append("buffers that do not fit the call on this rank")
    return f"{name}({', '.join(parts)})"
