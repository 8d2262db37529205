"""Communication helpers, on numpy arrays or CPU torch tensors (in place and zero-copy when
contiguous; helpers that return a new tensor return the caller's type). The group comes second and may be
omitted: None means the default group (`init_process_group`, or the rank's group under `spawn`). Ranks
are global. In-place helpers return None, or a `Work` with ``async_op=True``.

A call in torch.distributed's argument order that means something else here (``broadcast(t, 0)``,
``all_gather(tensor_list, t)``, ``all_reduce_sum(t, op)``, ``scatter_tensor(t, scatter_list)`` ...) is a
TypeError naming the call to make instead; it is raised before any communication, because a bad argument
reaching a collective aborts the whole world."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from axonml_distributed._core import ReduceOp
from axonml_distributed._types import ProcessGroupLike
from axonml_distributed.init import get_default_group
from axonml_distributed.tensors import as_numpy


def _is_op(value: object) -> bool:
    # Ours or its name, or torch.distributed's (ReduceOp or its RedOpType members), without importing torch.
    return isinstance(value, ReduceOp | str) or type(value).__name__ in ("ReduceOp", "RedOpType")


def _group(pg: Any, call: str) -> ProcessGroupLike:
    """`pg`, or the default group when None; a TypeError naming `call` (our signature) for anything that
    is not a group, with the fix for the torch-order argument it most likely is."""
    if pg is None:
        return get_default_group()
    if hasattr(pg, "ranks"):
        return pg
    if _is_op(pg):
        hint = (
            "; the reduction is in the helper's name (all_reduce_sum/mean/min/max/product(t, pg)), or call "
            "pg.all_reduce(t, op) on a group"
        )
    elif isinstance(pg, list | tuple):
        hint = "; it returns the result instead of filling a list as torch.distributed does"
    else:
        hint = ""
    raise TypeError(
        f"{call} takes the process group second (None: the default group), got {type(pg).__name__} "
        f"{pg!r}{hint}"
    )


def _all_reduce(t: Any, pg: ProcessGroupLike | None, op: ReduceOp, name: str, async_op: bool) -> Any:
    return _group(pg, f"{name}(t, pg)").all_reduce(t, op, async_op=async_op)


def all_reduce_sum(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Sum `t` across the group, in place."""
    return _all_reduce(t, pg, ReduceOp.SUM, "all_reduce_sum", async_op)


def all_reduce_mean(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Average `t` across the group, in place (floating-point dtypes)."""
    return _all_reduce(t, pg, ReduceOp.AVERAGE, "all_reduce_mean", async_op)


def all_reduce_min(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Elementwise minimum of `t` across the group, in place (NaN propagates)."""
    return _all_reduce(t, pg, ReduceOp.MIN, "all_reduce_min", async_op)


def all_reduce_max(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Elementwise maximum of `t` across the group, in place (NaN propagates)."""
    return _all_reduce(t, pg, ReduceOp.MAX, "all_reduce_max", async_op)


def all_reduce_product(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Elementwise product of `t` across the group, in place."""
    return _all_reduce(t, pg, ReduceOp.PRODUCT, "all_reduce_product", async_op)


def broadcast(
    t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False, src: int | None = None
) -> Any:
    """Overwrite `t` with the group's first rank's `t` (`src` exists only to name `broadcast_from`)."""
    if src is not None or isinstance(pg, int):
        root = pg if src is None else src
        raise TypeError(
            f"broadcast(t, pg) takes the process group second and sends from the group's first rank; "
            f"to send from global rank {root}, call broadcast_from(t, {root})"
        )
    return _group(pg, "broadcast(t, pg)").broadcast(t, None, async_op=async_op)


def broadcast_from(t: Any, src: int, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Overwrite `t` with global rank `src`'s `t`."""
    return _group(pg, "broadcast_from(t, src, pg)").broadcast(t, src, async_op=async_op)


def all_gather(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Every member's `t`, stacked in group order: shape ``(group size, *t.shape)``."""
    if isinstance(t, list | tuple):
        raise TypeError(
            "all_gather(t, pg) returns every member's t stacked in group order (out[i] is the i-th "
            "member's); torch.distributed's all_gather(tensor_list, tensor) order does not apply: call "
            "out = all_gather(t, pg) (pg None: the default group)"
        )
    g = _group(pg, "all_gather(t, pg)")
    array, like = as_numpy(t)
    result = g.all_gather_tensor(np.ascontiguousarray(array), async_op=async_op)
    return result if async_op else like(result)


def _reduce_scatter(t: Any, pg: ProcessGroupLike | None, op: ReduceOp, name: str, async_op: bool) -> Any:
    if isinstance(t, list | tuple) or isinstance(pg, list | tuple):
        raise TypeError(
            f"{name}(t, pg) returns this member's chunk of the reduced t (dimension 0 split in group-size "
            f"parts); torch.distributed's reduce_scatter(output, input_list) order does not apply: call "
            f"chunk = {name}(t, pg)"
        )
    g = _group(pg, f"{name}(t, pg)")
    array, like = as_numpy(t)
    result = g.reduce_scatter_tensor(np.ascontiguousarray(array), op, async_op=async_op)
    return result if async_op else like(result)


def reduce_scatter_sum(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """This member's chunk (dimension 0 split in group-size parts, which must divide) of the sum of `t`."""
    return _reduce_scatter(t, pg, ReduceOp.SUM, "reduce_scatter_sum", async_op)


def reduce_scatter_mean(t: Any, pg: ProcessGroupLike | None = None, *, async_op: bool = False) -> Any:
    """Like `reduce_scatter_sum`, averaged."""
    return _reduce_scatter(t, pg, ReduceOp.AVERAGE, "reduce_scatter_mean", async_op)


def _check_dim(dim: object, name: str) -> None:
    if not isinstance(dim, int | np.integer) or isinstance(dim, bool):
        raise TypeError(
            f"{name}(t, dim, pg) takes the dimension second, got {type(dim).__name__} {dim!r}; "
            f"torch.distributed's {name.split('_')[0]}(tensor, list, root) order does not apply: every "
            f"member calls {name}(t, dim, pg) and gets the result back"
        )


def _split_len(t: np.ndarray, dim: int, parts: int) -> tuple[int, int]:
    if not -t.ndim <= dim < t.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {t.ndim} dimensions")
    dim %= t.ndim
    if t.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of shape {t.shape} does not divide into {parts} equal parts")
    return dim, t.shape[dim] // parts


def scatter_tensor(t: Any, dim: int, pg: ProcessGroupLike | None = None) -> Any:
    """This member's chunk of `t` split in group-size equal parts along `dim` (a copy; no communication:
    every member already holds `t`)."""
    _check_dim(dim, "scatter_tensor")
    g = _group(pg, "scatter_tensor(t, dim, pg)")
    array, like = as_numpy(t)
    dim, part = _split_len(array, dim, g.size())
    i = g.group_rank(g.rank())
    return like(np.take(array, np.arange(i * part, (i + 1) * part), axis=dim))


def gather_tensor(t: Any, dim: int, pg: ProcessGroupLike | None = None) -> Any:
    """Every member's `t` concatenated along `dim`, in group order (the inverse of `scatter_tensor`)."""
    _check_dim(dim, "gather_tensor")
    g = _group(pg, "gather_tensor(t, dim, pg)")
    array, like = as_numpy(t)
    if not -array.ndim <= dim < array.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {array.ndim} dimensions")
    stacked = g.all_gather_tensor(np.ascontiguousarray(array))
    return like(np.concatenate(list(stacked), axis=dim))


def barrier(pg: ProcessGroupLike | None = None) -> None:
    """Block until every member arrives."""
    _group(pg, "barrier(pg)").barrier()


def monitored_barrier(
    timeout: float | timedelta | None = None,
    wait_all_ranks: bool = False,
    group: ProcessGroupLike | None = None,
) -> None:
    """As torch.distributed's: a barrier that waits at most `timeout` (seconds or a timedelta; None:
    the group's timeout). When members do not arrive in time, every member that did raises
    CollectiveTimeoutError naming all the missing ones (whatever `wait_all_ranks`: they are known at
    the deadline) and the world is aborted, as by any timeout (over MPI: the job ends)."""
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(
            f"monitored_barrier(timeout, wait_all_ranks, group) takes wait_all_ranks second, got "
            f"{type(wait_all_ranks).__name__}; pass the group as group="
        )
    g = _group(group, "monitored_barrier(timeout, wait_all_ranks, group)")
    g.monitored_barrier(timeout, wait_all_ranks)


def rank(pg: ProcessGroupLike | None = None) -> int:
    """This process's global rank."""
    return int(_group(pg, "rank(pg)").rank())


def world_size(pg: ProcessGroupLike | None = None) -> int:
    """Number of ranks in the group."""
    return int(_group(pg, "world_size(pg)").size())


def get_rank(group: ProcessGroupLike | None = None) -> int:
    """As torch.distributed's: this process's rank within `group` (the default group when None), -1 when
    it is not a member."""
    g = _group(group, "get_rank(group)")
    me = g.rank()
    return int(g.group_rank(me)) if g.contains(me) else -1


def get_world_size(group: ProcessGroupLike | None = None) -> int:
    """As torch.distributed's: the number of ranks in `group` (the default group when None)."""
    return int(_group(group, "get_world_size(group)").size())


def is_main_process(pg: ProcessGroupLike | None = None) -> bool:
    """True on the group's first rank."""
    g = _group(pg, "is_main_process(pg)")
    return bool(g.rank() == g.ranks()[0])


def sync_gradient(g: Any, pg: ProcessGroupLike | None = None) -> None:
    """Average one gradient across the group, in place."""
    _group(pg, "sync_gradient(g, pg)").all_reduce(g, ReduceOp.AVERAGE)


def sync_gradients(gradients: Sequence[Any], pg: ProcessGroupLike | None = None) -> None:
    """Average many gradients across the group, in place, with one all-reduce per dtype (flattened
    together, so small gradients do not each pay a collective's latency)."""
    group = _group(pg, "sync_gradients(gradients, pg)")
    by_dtype: dict[np.dtype[Any], list[np.ndarray]] = {}
    for grad in (as_numpy(g)[0] for g in gradients):
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = np.concatenate([grad.ravel() for grad in grads])
        group.all_reduce(flat, ReduceOp.AVERAGE)
        offset = 0
        for grad in grads:
            grad[...] = flat[offset : offset + grad.size].reshape(grad.shape)
            offset += grad.size


def new_group(
    ranks: Sequence[int], group: ProcessGroupLike | None = None, timeout: float | timedelta | None = None
) -> ProcessGroupLike:
    """A subgroup over `ranks` (global ranks, members of `group`; None: the default group), the same call
    on every backend (threads, shm, MPI): ``group.new_group(ranks, timeout)``. Call it on every rank of
    `group`, in the same order; a rank outside `ranks` gets a group it can query (``contains``, ``ranks``)
    but not use. Its operations wait `timeout` (seconds or a timedelta; None: the world's) before they
    raise CollectiveTimeoutError."""
    return _group(group, "new_group(ranks, group)").new_group(ranks, timeout)
