"""DistributedDataParallel over a CPU ``torch.nn.Module``, behaving as torch's own DDP does.

The constructor broadcasts the group's first rank's parameters and buffers; ``backward()`` averages the
gradients: a hook on each parameter puts its gradient into a flat bucket once autograd has accumulated
it, a bucket whose gradients are all in starts its all-reduce at once on the group's worker (so it
overlaps the rest of backward), and a callback at the end of backward waits for all of them. The wrapper
is itself a torch module: ``state_dict()`` keys carry torch DDP's ``module.`` prefix.

Imported only once a torch module is wrapped (`DistributedDataParallel` returns this class for one), so
torch stays an optional dependency of the package.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from axonml_distributed._core import ReduceOp
from axonml_distributed.ddp import (
    DistributedDataParallel,
    assign_buckets,
    broadcast_arrays,
    bucket_bytes,
    check_group,
)


class _Slot:
    """One trainable parameter and the place of its gradient in its bucket."""

    def __init__(self, index: int, name: str, param: torch.nn.Parameter, bucket: int, view: torch.Tensor):
        self.index = index  # position in parameters()
        self.name = name  # as the wrapper's named_parameters() say it, for messages
        self.param = param
        self.bucket = bucket
        self.view = view
        self.ready = False  # its gradient is in the bucket, for the reduction under way
        self.used = False  # a backward produced a gradient for it since the last reduction


class _Bucket:
    def __init__(self, flat: np.ndarray, slots: list[_Slot]) -> None:
        self.flat = flat  # from the group's allocator, so the collective can reduce it in place
        self.slots = slots
        self.pending = len(slots)  # gradients still to come in this backward
        self.work: Any = None


def _check_cpu(name: str, devices: Any) -> None:
    """``device_ids``/``output_device`` may only say CPU: None, "cpu", a CPU device, or a list of those."""
    if devices is None:
        return
    for device in devices if isinstance(devices, list | tuple) else [devices]:
        try:
            cpu = not isinstance(device, int) and torch.device(device).type == "cpu"
        except (RuntimeError, TypeError):
            cpu = False
        if not cpu:
            raise ValueError(
                f"{name}={devices!r}: this DistributedDataParallel runs on CPU only; pass {name}=None "
                f"(torch's DDP also wants None for CPU modules)"
            )


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"parameters of dtype {dtype} cannot be averaged (no numpy equivalent)") from None


def _memory_of(t: torch.Tensor) -> np.ndarray:
    """A numpy array over ``t``'s memory, to broadcast its raw bytes (any dtype)."""
    t = t.detach()
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
    return t.numpy()  # type: ignore[no-any-return]  # strided: `broadcast_arrays` copies it back


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad is view or (
        grad.data_ptr() == view.data_ptr() and grad.shape == view.shape and grad.stride() == view.stride()
    )


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _hook(ddp: weakref.ref[TorchDistributedDataParallel], slot: _Slot) -> Callable[[torch.Tensor], None]:
    # A weak reference: a dropped wrapper must neither stay alive through its model nor keep reducing.
    def on_gradient(_: torch.Tensor) -> None:
        owner = ddp()
        if owner is not None:
            owner._on_gradient(slot)

    return on_gradient


class TorchDistributedDataParallel(torch.nn.Module):
    """torch's ``DistributedDataParallel`` on our process groups, for CPU modules.

    Arguments as torch's, with the group second (``process_group``; None is the default group).
    ``device_ids``/``output_device`` must be None (or CPU). ``find_unused_parameters=False`` (the default,
    as torch) makes a backward that leaves a parameter without a gradient raise, after the reduction, so
    that the ranks stay in step; with True such gradients count as zeros on that rank, and a parameter no
    rank used keeps its gradient. ``static_graph`` is accepted and changes nothing. Unlike torch,
    ``gradient_as_bucket_view`` defaults to True (gradients are views into the buckets: no copies).
    ``no_sync()`` as torch: gradients of backwards whose forward, or which themselves, run inside it
    accumulate locally, and the first synced backward averages the totals.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        process_group: Any = None,
        *,
        device_ids: Any = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        _check_cpu("device_ids", device_ids)
        _check_cpu("output_device", output_device)
        self._bucket_cap = bucket_bytes(25 if bucket_cap_mb is None else bucket_cap_mb)
        self.module = module
        self.process_group = check_group(process_group)
        self.device_ids = None  # what torch's DDP holds for a CPU module
        self.output_device = None
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        # torch's flags: no_sync() clears the first; the second says the last forward was a synced one
        # (then the next forward broadcasts the buffers).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._local_step = False  # the last forward under autograd ran inside no_sync()
        self._reducing = False  # a synced backward started reducing; its end-of-backward callback is queued
        self._next_bucket = 0  # buckets start in order, the same on every rank
        self._handles: list[Any] = []
        weakref.finalize(self, _remove_hooks, self._handles)
        self._build()
        if init_sync:
            self.sync_parameters()

    # -- torch DDP's API ----------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._reducing:
            raise RuntimeError(
                "DistributedDataParallel: the previous backward raised before its gradients were averaged, "
                "so this rank is out of step with the others; the job cannot continue"
            )
        if self.require_forward_param_sync and self.broadcast_buffers:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._local_step = not self.require_backward_grad_sync
        self.require_forward_param_sync = grad_enabled and self.require_backward_grad_sync
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backwards in here (or of forwards run in here) accumulate locally; the first
        synced backward after the block averages the accumulated totals."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _apply(self, fn: Any, recurse: bool = True) -> TorchDistributedDataParallel:
        # to(), double(), ... may change the parameters' dtype or storage: the buckets follow.
        super()._apply(fn, recurse)
        self._build()
        return self

    # -- our explicit API, kept so loops written for it still work -----------------------------------------

    def sync_parameters(self) -> None:
        """Overwrite every rank's parameters (and buffers, if broadcast_buffers) in place with the first
        rank's. The constructor already did; calling it again is harmless."""
        with torch.no_grad():
            tensors: list[torch.Tensor] = list(self.module.parameters())
            if self.broadcast_buffers:
                tensors += list(self.module.buffers())
            broadcast_arrays(self.process_group, [_memory_of(t) for t in tensors])

    def sync_gradients(self) -> None:
        """Returns at once: ``backward()`` has averaged the gradients. Only gradients that backwards inside
        ``no_sync()`` left local are averaged here, when called outside it."""
        if self.require_backward_grad_sync and not self._reducing and any(s.used for s in self._slots):
            self._finish_reduction()

    def bucket_assignment(self) -> list[list[int]]:
        """Parameter indices (positions in ``parameters()``) of each bucket, in reduction order."""
        return [[slot.index for slot in bucket.slots] for bucket in self._buckets]

    # -- internals ----------------------------------------------------------------------------------------

    def _build(self) -> None:
        _remove_hooks(self._handles)
        self._reducing = False
        self._next_bucket = 0
        trainable: list[tuple[int, str, torch.nn.Parameter]] = []
        for i, (name, param) in enumerate(self.module.named_parameters()):
            if param.device.type != "cpu":
                raise ValueError(f"DistributedDataParallel runs on CPU tensors; {name} is on {param.device}")
            if param.requires_grad:
                trainable.append((i, f"module.{name}", param))
        layout = assign_buckets(
            [p.numel() * p.element_size() for _, _, p in trainable],
            [p.dtype for _, _, p in trainable],
            self._bucket_cap,
        )
        self._buckets: list[_Bucket] = []
        self._slots: list[_Slot] = []
        for members in layout:
            params = [trainable[k] for k in members]
            flat = self.process_group.empty(
                (sum(p.numel() for _, _, p in params),), _numpy_dtype(params[0][2].dtype)
            )
            flat.fill(0)
            flat_t = torch.from_numpy(flat)
            slots = []
            offset = 0
            for index, name, param in params:
                view = flat_t[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                slots.append(_Slot(index, name, param, len(self._buckets), view))
            self._buckets.append(_Bucket(flat, slots))
            self._slots += slots
        me = weakref.ref(self)
        for slot in self._slots:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(_hook(me, slot)))
            if self.gradient_as_bucket_view and slot.param.grad is not None:
                self._stage(slot)

    def _on_gradient(self, slot: _Slot) -> None:
        """Autograd has accumulated ``slot``'s gradient: bucket it, and start every bucket now complete."""
        slot.used = True
        if self._local_step or not self.require_backward_grad_sync or slot.ready:
            return  # no_sync(): the gradient stays local
        if not self._reducing:
            self._reducing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_reduction)
        self._stage(slot)
        slot.ready = True
        self._buckets[slot.bucket].pending -= 1
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        # In bucket order only: every rank must issue the same collectives in the same order.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.work = self.process_group.all_reduce(bucket.flat, ReduceOp.AVERAGE, async_op=True)
            self._next_bucket += 1

    def _stage(self, slot: _Slot) -> None:
        """Put the parameter's local gradient into its bucket (in view mode, make the gradient the view)."""
        grad = slot.param.grad
        if grad is None:  # zeroed to None after a backward inside no_sync()
            slot.view.zero_()
            return
        if _is_view(grad, slot.view):
            return
        if grad.layout != torch.strided:
            raise TypeError(
                f"DistributedDataParallel: {slot.name} has a {grad.layout} gradient; only dense ones"
            )
        with torch.no_grad():
            slot.view.copy_(grad)
        if self.gradient_as_bucket_view:
            slot.param.grad = slot.view

    def _finish_reduction(self) -> None:
        """End of a synced backward (or `sync_gradients`): reduce what is left, wait, write the averages."""
        unused: list[_Slot] = []
        try:
            for slot in self._slots:
                if slot.ready:
                    continue
                if slot.used:  # a gradient accumulated inside no_sync(), not touched by this backward
                    self._stage(slot)
                else:
                    slot.view.zero_()
                    unused.append(slot)
            for bucket in self._buckets:
                bucket.pending = 0
            self._start_ready_buckets()
            global_use = None
            if self.find_unused_parameters:
                global_use = self.process_group.empty((len(self._slots),), np.uint8)
                global_use[:] = [slot.used for slot in self._slots]
                self.process_group.all_reduce(global_use, ReduceOp.MAX)  # runs after the queued buckets
            for bucket in self._buckets:
                bucket.work.wait()
            for i, slot in enumerate(self._slots):
                if global_use is None or global_use[i]:
                    self._write_back(slot)
        finally:
            for bucket in self._buckets:
                bucket.pending = len(bucket.slots)
                bucket.work = None
            for slot in self._slots:
                slot.ready = slot.used = False
            self._next_bucket = 0
            self._reducing = False
        if unused and not self.find_unused_parameters:
            names = ", ".join(slot.name for slot in unused)
            raise RuntimeError(
                f"DistributedDataParallel: these parameters received no gradient in this backward: {names}. "
                "Their average counted zeros for this rank. If the model does not use every parameter in "
                "every step, pass find_unused_parameters=True to DistributedDataParallel"
            )

    def _write_back(self, slot: _Slot) -> None:
        grad = slot.param.grad
        if self.gradient_as_bucket_view:
            if grad is None or not _is_view(grad, slot.view):
                slot.param.grad = slot.view
        elif grad is None:
            slot.param.grad = slot.view.clone()
        else:
            with torch.no_grad():
                grad.copy_(slot.view)

    def _sync_buffers(self) -> None:
        with torch.no_grad():
            broadcast_arrays(self.process_group, [_memory_of(b) for b in self.module.buffers()])


DistributedDataParallel.register(TorchDistributedDataParallel)
