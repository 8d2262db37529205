"""The seed's communication helpers, on numpy arrays. The group comes second and may be omitted: None
means the default group (`init_process_group`, or the rank's group under `spawn`). Ranks are global.
In-place helpers return None, or a `Work` with ``async_op=True``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from axonml_distributed._core import ReduceOp
from axonml_distributed.init import get_default_group


def _group(pg: Any) -> Any:
    return get_default_group() if pg is None else pg


def all_reduce_sum(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Sum `t` across the group, in place."""
    return _group(pg).all_reduce(t, ReduceOp.SUM, async_op=async_op)


def all_reduce_mean(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Average `t` across the group, in place (floating-point dtypes)."""
    return _group(pg).all_reduce(t, ReduceOp.AVERAGE, async_op=async_op)


def all_reduce_min(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise minimum of `t` across the group, in place (NaN propagates)."""
    return _group(pg).all_reduce(t, ReduceOp.MIN, async_op=async_op)


def all_reduce_max(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise maximum of `t` across the group, in place (NaN propagates)."""
    return _group(pg).all_reduce(t, ReduceOp.MAX, async_op=async_op)


def all_reduce_product(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Elementwise product of `t` across the group, in place."""
    return _group(pg).all_reduce(t, ReduceOp.PRODUCT, async_op=async_op)


def broadcast(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Overwrite `t` with the group's first rank's `t`."""
    return _group(pg).broadcast(t, None, async_op=async_op)


def broadcast_from(t: np.ndarray, src: int, pg: Any = None, *, async_op: bool = False) -> Any:
    """Overwrite `t` with global rank `src`'s `t`."""
    return _group(pg).broadcast(t, src, async_op=async_op)


def all_gather(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Every member's `t`, stacked in group order: shape ``(group size, *t.shape)``."""
    return _group(pg).all_gather_tensor(np.ascontiguousarray(t), async_op=async_op)


def reduce_scatter_sum(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """This member's chunk (dimension 0 split in group-size parts, which must divide) of the sum of `t`."""
    return _group(pg).reduce_scatter_tensor(np.ascontiguousarray(t), ReduceOp.SUM, async_op=async_op)


def reduce_scatter_mean(t: np.ndarray, pg: Any = None, *, async_op: bool = False) -> Any:
    """Like `reduce_scatter_sum`, averaged."""
    return _group(pg).reduce_scatter_tensor(np.ascontiguousarray(t), ReduceOp.AVERAGE, async_op=async_op)


def _split_len(t: np.ndarray, dim: int, parts: int) -> tuple[int, int]:
    if not -t.ndim <= dim < t.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {t.ndim} dimensions")
    dim %= t.ndim
    if t.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of shape {t.shape} does not divide into {parts} equal parts")
    return dim, t.shape[dim] // parts


def scatter_tensor(t: np.ndarray, dim: int, pg: Any = None) -> np.ndarray:
    """This member's chunk of `t` split in group-size equal parts along `dim` (a copy; no communication:
    every member already holds `t`)."""
    g = _group(pg)
    dim, part = _split_len(t, dim, g.size())
    i = g.group_rank(g.rank())
    return np.take(t, np.arange(i * part, (i + 1) * part), axis=dim)


def gather_tensor(t: np.ndarray, dim: int, pg: Any = None) -> np.ndarray:
    """Every member's `t` concatenated along `dim`, in group order (the inverse of `scatter_tensor`)."""
    g = _group(pg)
    if not -t.ndim <= dim < t.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {t.ndim} dimensions")
    stacked = g.all_gather_tensor(np.ascontiguousarray(t))
    return np.concatenate(list(stacked), axis=dim)


def barrier(pg: Any = None) -> None:
    """Block until every member arrives."""
    _group(pg).barrier()


def rank(pg: Any = None) -> int:
    """This process's global rank."""
    return int(_group(pg).rank())


def world_size(pg: Any = None) -> int:
    """Number of ranks in the group."""
    return int(_group(pg).size())


def is_main_process(pg: Any = None) -> bool:
    """True on the group's first rank."""
    g = _group(pg)
    return bool(g.rank() == g.ranks()[0])


def sync_gradient(g: np.ndarray, pg: Any = None) -> None:
    """Average one gradient across the group, in place."""
    _group(pg).all_reduce(g, ReduceOp.AVERAGE)


def sync_gradients(gradients: Sequence[np.ndarray], pg: Any = None) -> None:
    """Average many gradients across the group, in place, with one all-reduce per dtype (flattened
    together, so small gradients do not each pay a collective's latency)."""
    group = _group(pg)
    by_dtype: dict[np.dtype[Any], list[np.ndarray]] = {}
    for grad in gradients:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = np.concatenate([grad.ravel() for grad in grads])
        group.all_reduce(flat, ReduceOp.AVERAGE)
        offset = 0
        for grad in grads:
            grad[...] = flat[offset : offset + grad.size].reshape(grad.shape)
            offset += grad.size
