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
from collections.abc import Iterator
from typing import Any

import torch

from axonml_distributed.buckets import broadcast_arrays, bucket_bytes
from axonml_distributed.ddp import DistributedDataParallel, check_group
from axonml_distributed.ddp_stats import DDPStats
from axonml_distributed.grad_reducer import GradReducer, Slot
from axonml_distributed.tensors import raw_memory


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


class _StepState:
    """Flags that change every step, on a plain object (setting a torch module's attributes is slow)."""

    def __init__(self) -> None:
        self.local = False  # the last forward under autograd ran inside no_sync()
        self.reducing = False  # a synced backward started reducing; its end-of-backward callback is queued


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
        self._step = _StepState()
        self._reducer: GradReducer | None = None
        self._build()
        if init_sync:
            self.sync_parameters()

    # -- torch DDP's API ----------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._step.reducing:
            raise RuntimeError(
                "DistributedDataParallel: the previous backward raised before its gradients were averaged, "
                "so this rank is out of step with the others; the job cannot continue"
            )
        if self.require_forward_param_sync and self.broadcast_buffers and self._module_buffers:
            self._sync_buffers()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._grads().begin_step()
        output = self.module(*inputs, **kwargs)
        if grad_enabled:
            self._step.local = not self.require_backward_grad_sync
        param_sync = grad_enabled and self.require_backward_grad_sync
        if param_sync != self.require_forward_param_sync:  # torch.nn.Module.__setattr__ is slow
            self.require_forward_param_sync = param_sync
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
            broadcast_arrays(self.process_group, [raw_memory(t) for t in tensors])

    def sync_gradients(self) -> None:
        """Returns at once: ``backward()`` has averaged the gradients. Only gradients that backwards inside
        ``no_sync()`` left local are averaged here, when called outside it."""
        if self.require_backward_grad_sync and not self._step.reducing and any(s.used for s in self._slots()):
            self._finish_reduction()

    def bucket_assignment(self) -> list[list[int]]:
        """Parameter indices (positions in ``parameters()``) of each bucket, in reduction order."""
        return [[slot.index for slot in bucket] for bucket in self._grads().buckets()]

    def stats(self) -> DDPStats:
        """Where the steps so far spent their time: each step's compute (from its first forward with
        gradients enabled until the end of backward), visible sync (the wait for the reduction at the end
        of backward) and overlapped sync (bucket all-reduces that ran during backward), with its bytes and
        buckets; the last 100 steps and the totals, since the buckets were last built (the constructor,
        or ``to()``). `axonml_distributed.ddp_stats` defines each figure."""
        return self._grads().stats()

    # -- internals ----------------------------------------------------------------------------------------

    def _build(self) -> None:
        if self._reducer is not None:
            self._reducer.close()
        self._step.reducing = False
        # As torch's DDP: the buffers to broadcast are the module's when wrapped (or moved with to()).
        self._module_buffers = list(self.module.buffers())
        trainable: list[tuple[int, str, torch.nn.Parameter]] = []
        for i, (name, param) in enumerate(self.module.named_parameters()):
            if param.device.type != "cpu":
                raise ValueError(f"DistributedDataParallel runs on CPU tensors; {name} is on {param.device}")
            if param.requires_grad:
                trainable.append((i, f"module.{name}", param))
        self._reducer = GradReducer(
            self.process_group, trainable, self._bucket_cap, self.gradient_as_bucket_view, self
        )

    def _grads(self) -> GradReducer:
        assert self._reducer is not None  # built in the constructor
        return self._reducer

    def _slots(self) -> list[Slot]:
        return self._grads().slots

    def _on_gradient(self, slot: Slot) -> None:
        """Autograd has accumulated ``slot``'s gradient: reduce it now unless this backward stays local."""
        if self._step.local or not self.require_backward_grad_sync or self._grads().is_ready(slot):
            return  # no_sync(): the gradient stays local
        if not self._step.reducing:
            self._step.reducing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_reduction)
        self._grads().ready(slot)

    def _finish_reduction(self) -> None:
        """End of a synced backward (or `sync_gradients`): reduce what is left, wait, write the averages."""
        try:
            unused = self._grads().finish(self.find_unused_parameters)
        finally:
            self._step.reducing = False
        if unused and not self.find_unused_parameters:
            names = ", ".join(slot.name for slot in unused)
            raise RuntimeError(
                f"DistributedDataParallel: these parameters received no gradient in this backward: {names}. "
                "Their average counted zeros for this rank. If the model does not use every parameter in "
                "every step, pass find_unused_parameters=True to DistributedDataParallel"
            )

    def _sync_buffers(self) -> None:
        with torch.no_grad():
            broadcast_arrays(self.process_group, [raw_memory(b) for b in self._module_buffers])


DistributedDataParallel.register(TorchDistributedDataParallel)
