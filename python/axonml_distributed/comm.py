"""The seed's communication helpers, on numpy arrays or CPU torch tensors (in place and zero-copy when
contiguous; helpers that return a new tensor return the caller's type). The group comes second and may be
omitted: None means the default group (`init_process_group`, or the rank's group under `spawn`). Ranks
are global. In-place helpers return None, or a `Work` with ``async_op=True``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axonml_distributed._core import ReduceOp
from axonml_distributed.init import get_default_group


def _group(pg: Any) -> Any:
    if pg is None:
        return get_default_group()
    if not hasattr(pg, "ranks"):
        # Checked here: a bad argument reaching a collective aborts the whole world.
        raise TypeError(
            f"the second argument is the process group (None: the default group), got "
            f"{type(pg).__name__} {pg!r}"
        )
    return pg


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _numpy(t: Any) -> tuple[Any, Callable[[np.ndarray], Any]]:
    """``t`` as numpy over the same memory, and how to give a result back in ``t``'s type.

    The native groups take CPU tensors themselves; this serves the groups that take numpy only (MPI)
    and the helpers that compute with numpy (`scatter_tensor`, `gather_tensor`, `sync_gradients`).
    """
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise ValueError(f"collectives run on CPU tensors; got one on {t.device}")
        return t.detach().numpy(), torch.from_numpy
    return t, _same


def all_reduce_sum(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Sum `t` across the group, in place."""
    return _group(pg).all_reduce(_numpy(t)[0], ReduceOp.SUM, async_op=async_op)


def all_reduce_mean(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Average `t` across the group, in place (floating-point dtypes)."""
    return _group(pg).all_reduce(_numpy(t)[0], ReduceOp.AVERAGE, async_op=async_op)


def all_reduce_min(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise minimum of `t` across the group, in place (NaN propagates)."""
    return _group(pg).all_reduce(_numpy(t)[0], ReduceOp.MIN, async_op=async_op)


def all_reduce_max(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise maximum of `t` across the group, in place (NaN propagates)."""
    return _group(pg).all_reduce(_numpy(t)[0], ReduceOp.MAX, async_op=async_op)


def all_reduce_product(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise product of `t` across the group, in place."""
    return _group(pg).all_reduce(_numpy(t)[0], ReduceOp.PRODUCT, async_op=async_op)


def broadcast(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Overwrite `t` with the group's first rank's `t`."""
    if isinstance(pg, int):
        raise TypeError(
            f"broadcast(t, pg) takes the process group second and sends from the group's first rank; "
            f"to send from global rank {pg}, call broadcast_from(t, {pg})"
        )
    return _group(pg).broadcast(_numpy(t)[0], None, async_op=async_op)


def broadcast_from(t: Any, src: int, pg: Any = None, *, async_op: bool = False) -> Any:
    """Overwrite `t` with global rank `src`'s `t`."""
    return _group(pg).broadcast(_numpy(t)[0], src, async_op=async_op)


def all_gather(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Every member's `t`, stacked in group order: shape ``(group size, *t.shape)``."""
    array, like = _numpy(t)
    result = _group(pg).all_gather_tensor(np.ascontiguousarray(array), async_op=async_op)
    return result if async_op else like(result)


def reduce_scatter_sum(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """This member's chunk (dimension 0 split in group-size parts, which must divide) of the sum of `t`."""
    array, like = _numpy(t)
    result = _group(pg).reduce_scatter_tensor(np.ascontiguousarray(array), ReduceOp.SUM, async_op=async_op)
    return result if async_op else like(result)


def reduce_scatter_mean(t: Any, pg: Any = None, *, async_op: bool = False) -> Any:
    """Like `reduce_scatter_sum`, averaged."""
    array, like = _numpy(t)
    result = _group(pg).reduce_scatter_tensor(
        np.ascontiguousarray(array), ReduceOp.AVERAGE, async_op=async_op
    )
    return result if async_op else like(result)


def _split_len(t: np.ndarray, dim: int, parts: int) -> tuple[int, int]:
    if not -t.ndim <= dim < t.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {t.ndim} dimensions")
    dim %= t.ndim
    if t.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of shape {t.shape} does not divide into {parts} equal parts")
    return dim, t.shape[dim] // parts


def scatter_tensor(t: Any, dim: int, pg: Any = None) -> Any:
    """This member's chunk of `t` split in group-size equal parts along `dim` (a copy; no communication:
    every member already holds `t`)."""
    g = _group(pg)
    array, like = _numpy(t)
    dim, part = _split_len(array, dim, g.size())
    i = g.group_rank(g.rank())
    return like(np.take(array, np.arange(i * part, (i + 1) * part), axis=dim))


def gather_tensor(t: Any, dim: int, pg: Any = None) -> Any:
    """Every member's `t` concatenated along `dim`, in group order (the inverse of `scatter_tensor`)."""
    g = _group(pg)
    array, like = _numpy(t)
    if not -array.ndim <= dim < array.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {array.ndim} dimensions")
    stacked = g.all_gather_tensor(np.ascontiguousarray(array))
    return like(np.concatenate(list(stacked), axis=dim))


def barrier(pg: Any = None) -> None:
    """Block until every member arrives."""
    _group(pg).barrier()


def rank(pg: Any = None) -> int:
    """This process's global rank."""
    return int(_group(pg).rank())


def world_size(pg: Any = None) -> int:
    """Number of ranks in the group."""
    return int(_group(pg).size())


def get_rank(group: Any = None) -> int:
    """As torch.distributed's: this process's rank within `group` (the default group when None), -1 when
    it is not a member."""
    g = _group(group)
    me = g.rank()
    return int(g.group_rank(me)) if g.contains(me) else -1


def get_world_size(group: Any = None) -> int:
    """As torch.distributed's: the number of ranks in `group` (the default group when None)."""
    return int(_group(group).size())


def is_main_process(pg: Any = None) -> bool:
    """True on the group's first rank."""
    g = _group(pg)
    return bool(g.rank() == g.ranks()[0])


def sync_gradient(g: Any, pg: Any = None) -> None:
    """Average one gradient across the group, in place."""
    _group(pg).all_reduce(_numpy(g)[0], ReduceOp.AVERAGE)


def sync_gradients(gradients: Sequence[Any], pg: Any = None) -> None:
    """Average many gradients across the group, in place, with one all-reduce per dtype (flattened
    together, so small gradients do not each pay a collective's latency)."""
    group = _group(pg)
    by_dtype: dict[np.dtype[Any], list[np.ndarray]] = {}
    for grad in (_numpy(g)[0] for g in gradients):
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = np.concatenate([grad.ravel() for grad in grads])
        group.all_reduce(flat, ReduceOp.AVERAGE)
        offset = 0
        for grad in grads:
            grad[...] = flat[offset : offset + grad.size].reshape(grad.shape)
            offset += grad.size
