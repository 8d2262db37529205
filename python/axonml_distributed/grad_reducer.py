"""Averaging torch gradients over a group from inside backward: the hooks and buckets behind our torch DDP
(`ddp_torch`) and the Horovod-style `DistributedOptimizer` (`horovod`).

A hook on each parameter (``register_post_accumulate_grad_hook``) hands its owner the parameter's slot once
autograd has accumulated its gradient; the owner decides whether that gradient is to be reduced now (DDP:
outside ``no_sync()``; the optimizer: on the last of its backward passes) and calls `ready`, which puts the
gradient into its flat bucket and starts, at once and on the group's worker, the all-reduce of every bucket
now complete, in bucket order (the same collectives in the same order on every rank), except the last,
whose gradients come last. `finish` reduces what is left, waits, and writes the averages back into
``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from axonml_distributed._core import ReduceOp
from axonml_distributed.buckets import assign_buckets


class Slot:
    """One trainable parameter and the place of its gradient in its bucket."""

    def __init__(self, index: int, name: str, param: torch.nn.Parameter, bucket: int, view: torch.Tensor):
        self.index = index  # the owner's position for it (parameters() or the optimizer's param groups)
        self.name = name  # for messages
        self.param = param
        self.bucket = bucket
        self.view = view
        self.ready = False  # its gradient is in the bucket, for the reduction under way
        self.used = False  # a backward produced a gradient for it since the last reduction


class _Bucket:
    def __init__(self, flat: np.ndarray, slots: list[Slot]) -> None:
        self.flat = flat  # from the group's allocator, so the collective can reduce it in place
        self.slots = slots
        self.pending = len(slots)  # gradients still to come in this reduction
        self.work: Any = None


class Owner(Protocol):
    def _on_gradient(self, slot: Slot) -> None: ...


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"parameters of dtype {dtype} cannot be averaged (no numpy equivalent)") from None


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad is view or (
        grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()
    )


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _hook(owner: weakref.ref[Owner], slot: Slot) -> Callable[[torch.Tensor], None]:
    # A weak reference: a dropped owner must neither stay alive through its model nor keep reducing.
    def on_gradient(_: torch.Tensor) -> None:
        target = owner()
        if target is not None:
            slot.used = True
            target._on_gradient(slot)

    return on_gradient


class GradReducer:
    """The buckets of `params` ((index, name, parameter) in the owner's order) over `group`, with a hook on
    each parameter that reports to `owner` (held weakly; the hooks go when it does, or with `close`)."""

    def __init__(
        self,
        group: Any,
        params: list[tuple[int, str, torch.nn.Parameter]],
        cap_bytes: int,
        as_bucket_view: bool,
        owner: Owner,
    ) -> None:
        self.group = group
        self.as_bucket_view = as_bucket_view
        self._next_bucket = 0  # buckets start in order, the same on every rank
        layout = assign_buckets(
            [p.numel() * p.element_size() for _, _, p in params], [p.dtype for _, _, p in params], cap_bytes
        )
        self.buckets: list[_Bucket] = []
        self.slots: list[Slot] = []
        for members in layout:
            chosen = [params[k] for k in members]
            flat = group.empty((sum(p.numel() for _, _, p in chosen),), _numpy_dtype(chosen[0][2].dtype))
            flat.fill(0)
            flat_t = torch.from_numpy(flat)
            slots = []
            offset = 0
            for index, name, param in chosen:
                view = flat_t[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                slots.append(Slot(index, name, param, len(self.buckets), view))
            self.buckets.append(_Bucket(flat, slots))
            self.slots += slots
        self._handles: list[Any] = []
        weakref.finalize(owner, _remove_hooks, self._handles)
        me = weakref.ref(owner)
        for slot in self.slots:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(_hook(me, slot)))
            if as_bucket_view and slot.param.grad is not None:
                self.stage(slot)

    def close(self) -> None:
        """Remove the hooks (the owner rebuilds its buckets, or is done)."""
        _remove_hooks(self._handles)

    def in_flight(self) -> bool:
        """Whether a reduction has started and not finished."""
        return any(slot.ready for slot in self.slots)

    def ready(self, slot: Slot) -> None:
        """Bucket `slot`'s gradient for this reduction and start every bucket now complete."""
        self.stage(slot)
        slot.ready = True
        self.buckets[slot.bucket].pending -= 1
        self._start_ready_buckets()

    def finish(self, find_unused: bool) -> list[Slot]:
        """Reduce what is left, wait for every bucket, write the averages into ``.grad``; returns the slots
        no backward reached since the last reduction (they count as zeros on this rank). With
        `find_unused`, a gradient no rank produced is left as it was; without, every slot gets the average."""
        unused: list[Slot] = []
        try:
            for slot in self.slots:
                if slot.ready:
                    continue
                if slot.used:  # accumulated locally (no_sync(), or an earlier backward pass)
                    self.stage(slot)
                else:
                    slot.view.zero_()
                    unused.append(slot)
            for bucket in self.buckets:
                bucket.pending = 0
            self._start_ready_buckets(final=True)
            global_use = None
            if find_unused:
                global_use = self.group.empty((len(self.slots),), np.uint8)
                global_use[:] = [slot.used for slot in self.slots]
                self.group.all_reduce(global_use, ReduceOp.MAX)  # runs after the queued buckets
            for bucket in self.buckets[:-1]:
                bucket.work.wait()
            for i, slot in enumerate(self.slots):
                if global_use is None or global_use[i]:
                    self._write_back(slot)
        finally:
            for bucket in self.buckets:
                bucket.pending = len(bucket.slots)
                bucket.work = None
            for slot in self.slots:
                slot.ready = slot.used = False
            self._next_bucket = 0
        return unused

    def stage(self, slot: Slot) -> None:
        """Put the parameter's local gradient into its bucket (in view mode, make the gradient the view)."""
        grad = slot.param.grad
        if grad is None:  # zeroed to None after a backward that stayed local
            slot.view.zero_()
            return
        if _is_view(grad, slot.view):
            return
        if grad.layout != torch.strided:
            raise TypeError(f"{slot.name} has a {grad.layout} gradient; only dense ones can be averaged")
        with torch.no_grad():
            slot.view.copy_(grad)
        if self.as_bucket_view:
            slot.param.grad = slot.view

    def _start_ready_buckets(self, final: bool = False) -> None:
        # In bucket order only: every rank must issue the same collectives in the same order. The last
        # bucket waits for `finish`, which reduces it on this thread (after the queued ones: a group keeps
        # issue order): its gradients come last in backward, so there is nothing left to overlap with,
        # and a hand-off to the worker would only add a thread wake-up (most of a small model's step).
        last = len(self.buckets) - 1
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            if self._next_bucket < last:
                bucket.work = self.group.all_reduce(bucket.flat, ReduceOp.AVERAGE, async_op=True)
            elif final:
                self.group.all_reduce(bucket.flat, ReduceOp.AVERAGE)
            else:
                return
            self._next_bucket += 1

    def _write_back(self, slot: Slot) -> None:
        grad = slot.param.grad
        if self.as_bucket_view:
            if grad is None or not _is_view(grad, slot.view):
                slot.param.grad = slot.view
        elif grad is None:
            slot.param.grad = slot.view.clone()
        else:
            with torch.no_grad():
                grad.copy_(slot.view)
