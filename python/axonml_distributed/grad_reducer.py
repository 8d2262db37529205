"""Averaging torch gradients over a group from inside backward: the hooks behind our torch DDP
(`ddp_torch`) and the Horovod-style `DistributedOptimizer` (`horovod`), over the native engine
(`GradientSynchronizer.for_parameters`), which lays out the buckets and reduces them.

A hook on each parameter (``register_post_accumulate_grad_hook``) hands its owner the parameter's slot once
autograd has accumulated its gradient; the owner decides whether that gradient is to be reduced now (DDP:
outside ``no_sync()``; the optimizer: on the last of its backward passes) and calls `ready`, which copies
the gradient into its view of the bucket and tells the engine, which starts every bucket now complete, in
bucket order. `finish` brings in the gradients accumulated locally, lets the engine reduce what is left and
wait, and writes the averages back into ``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from axonml_distributed._core import GradientSynchronizer
from axonml_distributed.ddp_stats import DDPStats


class Slot:
    """One trainable parameter and its gradient's view into its bucket."""

    def __init__(self, index: int, name: str, param: torch.nn.Parameter, position: int, view: torch.Tensor):
        self.index = index  # the owner's position for it (parameters() or the optimizer's param groups)
        self.name = name  # for messages
        self.param = param
        self.position = position  # its gradient's position in the engine
        self.view = view
        self.used = False  # a backward produced a gradient for it since the last reduction


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
        self.as_bucket_view = as_bucket_view
        shapes = [(tuple(p.shape), _numpy_dtype(p.dtype)) for _, _, p in params]
        self.engine = GradientSynchronizer.for_parameters(group, shapes, cap_bytes)
        self.slots = [
            Slot(index, name, param, i, torch.from_numpy(view))
            for i, ((index, name, param), view) in enumerate(zip(params, self.engine.views(), strict=True))
        ]
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

    def buckets(self) -> list[list[Slot]]:
        """The slots of each bucket, in reduction order."""
        return [[self.slots[i] for i in bucket] for bucket in self.engine.bucket_assignment()]

    def begin_step(self) -> None:
        """The step begins now (a forward with gradients enabled), unless it already began."""
        self.engine.begin_step()

    def stats(self) -> DDPStats:
        """Where the reductions so far spent their time (`axonml_distributed.ddp_stats`)."""
        return DDPStats.from_native(self.engine.stats())

    def in_flight(self) -> bool:
        """Whether a reduction has started and not finished."""
        return self.engine.in_flight()

    def is_ready(self, slot: Slot) -> bool:
        """Whether `slot`'s gradient is in its bucket for the reduction under way."""
        return self.engine.is_ready(slot.position)

    def ready(self, slot: Slot) -> None:
        """Bucket `slot`'s gradient for this reduction (the engine starts every bucket now complete)."""
        self.stage(slot)
        self.engine.ready(slot.position)

    def finish(self, find_unused: bool) -> list[Slot]:
        """Reduce what is left, wait for every bucket, write the averages into ``.grad``; returns the slots
        no backward reached since the last reduction (they count as zeros on this rank). With
        `find_unused`, a gradient no rank produced is left as it was; without, every slot gets the average."""
        unused: list[Slot] = []
        try:
            for i in self.engine.waiting():
                slot = self.slots[i]
                if slot.used:  # accumulated locally (no_sync(), or an earlier backward pass)
                    self.stage(slot)
                else:
                    unused.append(slot)
            global_use = self.engine.finish([slot.used for slot in self.slots], find_unused)
            for i, slot in enumerate(self.slots):
                if global_use is None or global_use[i]:
                    self._write_back(slot)
        finally:
            for slot in self.slots:
                slot.used = False
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
        # detach() only for a gradient that is itself in a graph (create_graph=True): a no_grad() block
        # would cost three times the copy of a small gradient, every step.
        slot.view.copy_(grad.detach() if grad.requires_grad else grad)
        if self.as_bucket_view:
            slot.param.grad = slot.view

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
