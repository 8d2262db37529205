"""DistributedDataParallel: keep model replicas in step by averaging their gradients over a process group.

Wraps either a numpy duck-typed model (``parameters()`` yields objects with numpy ``.data`` and ``.grad``),
implemented here, or a CPU ``torch.nn.Module``, for which the constructor returns the torch-style
`axonml_distributed.ddp_torch.TorchDistributedDataParallel`. torch stays optional: it is only looked at
when the caller has imported it.
"""

from __future__ import annotations

import abc
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from axonml_distributed._core import GradientSynchronizer
from axonml_distributed._types import ProcessGroupLike
from axonml_distributed.buckets import broadcast_arrays, bucket_bytes, raw_bytes
from axonml_distributed.ddp_stats import DDPStats
from axonml_distributed.init import get_default_group


class _NumpyParam:
    """One parameter of a numpy model: an object with numpy ``.data`` and ``.grad`` (None or an array)."""

    def __init__(self, param: Any) -> None:
        self._param = param
        self.requires_grad = bool(getattr(param, "requires_grad", True))

    def data(self) -> np.ndarray:
        return self._param.data  # type: ignore[no-any-return]

    def grad(self) -> np.ndarray | None:
        return self._param.grad  # type: ignore[no-any-return]

    def set_grad(self, grad: np.ndarray) -> None:
        self._param.grad = grad


class _Slot:
    """Where one parameter's gradient lives inside its bucket."""

    def __init__(self, index: int, ref: _NumpyParam, view: np.ndarray) -> None:
        self.index = index  # position in parameters()
        self.ref = ref
        self.view = view
        self.address = _address(view)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _is_view(grad: np.ndarray, slot: _Slot) -> bool:
    # A model may hand out a fresh array object over the same memory, so identity alone misses.
    view = slot.view
    return grad is view or (
        _address(grad) == slot.address
        and grad.shape == view.shape
        and grad.strides == view.strides
        and grad.dtype == view.dtype
    )


def check_group(process_group: Any) -> Any:
    """The group DDP runs on: ``process_group``, or the default group when it is None."""
    if process_group is None:
        return get_default_group()
    if not hasattr(process_group, "all_reduce"):
        # torch's DDP takes device_ids second; ours takes the group there.
        raise TypeError(
            f"the second argument of DistributedDataParallel is the process group, got "
            f"{type(process_group).__name__} {process_group!r}; pass device_ids= (None on CPU) by keyword"
        )
    return process_group


class _Snapshot:
    """Checksums of the gradients (None for no gradient) and, when needed, of the parameters."""

    def __init__(self, grads: list[int | None], params: list[int] | None) -> None:
        self.grads = grads
        self.params = params

    def stepped_to(self, now: _Snapshot) -> bool:
        """Whether a step (a backward, or an optimizer step over zeroed gradients) separates the two, with
        some gradient existing now."""
        if all(g is None for g in now.grads):
            return False
        new_grads = any(g not in (None, 0, then) for g, then in zip(now.grads, self.grads, strict=True))
        return new_grads or (self.params is not None and now.params != self.params)


def _checksum(array: np.ndarray) -> int:
    """The wrapping sum of the array's bytes read as 64-bit words (the tail as bytes): one cheap pass, about
    6 ms per 100 MB, that new gradients or new weights change."""
    raw = raw_bytes(array)
    whole = raw.size - raw.size % 8
    return int(raw[:whole].view(np.uint64).sum(dtype=np.uint64)) + int(raw[whole:].sum())


def _is_torch_module(module: Any) -> bool:
    # A torch module can only exist if torch is already imported, so DDP never imports it itself.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(module, torch.nn.Module)


class DistributedDataParallel(metaclass=abc.ABCMeta):  # noqa: B024 - ABCMeta for register() only
    """Data-parallel wrapper: every rank holds a replica and the constructor broadcasts the first rank's
    parameters (and buffers) to the others.

    For a ``torch.nn.Module`` this returns a `TorchDistributedDataParallel` (a torch module that averages
    gradients inside ``backward()``, as torch's DDP does). For a numpy model there is no autograd to hook,
    so the step is explicit: ``out = ddp(x)``, backward, ``ddp.sync_gradients()``, optimizer step. A new
    training forward while the previous step's gradients were never synced (outside ``no_sync()``) raises.
    """

    def __new__(cls, module: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is DistributedDataParallel and _is_torch_module(module):
            from axonml_distributed.ddp_torch import TorchDistributedDataParallel

            return TorchDistributedDataParallel(module, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: Any,
        process_group: ProcessGroupLike | None = None,
        *,
        bucket_cap_mb: float = 25,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
        init_sync: bool = True,
    ) -> None:
        cap = bucket_bytes(bucket_cap_mb)
        self.module = module
        self._pg: ProcessGroupLike = check_group(process_group)
        self._broadcast_buffers = broadcast_buffers
        self._gradient_as_bucket_view = gradient_as_bucket_view
        self._require_grad_sync = True
        # What the last training forward outside no_sync() saw, until sync_gradients() or sync_parameters()
        # runs: its step's gradients are still to be averaged.
        self._awaiting_sync: _Snapshot | None = None
        self._training = bool(getattr(module, "training", True))
        self._params = self._param_refs()
        # The engine lays out the buckets (in the group's shared memory when it has some) and reduces them.
        trainable = [(i, ref) for i, ref in enumerate(self._params) if ref.requires_grad]
        shapes = [(ref.data().shape, ref.data().dtype) for _, ref in trainable]
        self._engine = GradientSynchronizer.for_parameters(self._pg, shapes, cap)
        views = self._engine.views()
        self._slots = [_Slot(i, ref, view) for (i, ref), view in zip(trainable, views, strict=True)]
        if gradient_as_bucket_view:
            self._install_views()
        if init_sync:
            self.sync_parameters()

    # -- builders (chainable) --------------------------------------------------------------

    def broadcast_buffers(self, flag: bool) -> DistributedDataParallel:
        """Whether ``sync_parameters()`` and training forwards also broadcast the module's buffers."""
        self._broadcast_buffers = flag
        return self

    def gradient_as_bucket_view(self, flag: bool) -> DistributedDataParallel:
        """Whether gradients are views into the flat buckets (zero-copy sync) or separate arrays."""
        if flag != self._gradient_as_bucket_view:
            self._gradient_as_bucket_view = flag
            if flag:
                self._install_views()
            else:
                self._detach_views()
        return self

    # -- accessors ----------------------------------------------------------------------------------------

    def process_group(self) -> ProcessGroupLike:
        return self._pg

    def parameters(self) -> Iterator[Any]:
        return iter(self.module.parameters())

    def bucket_assignment(self) -> list[list[int]]:
        """Parameter indices (positions in ``parameters()``) of each bucket, in reduction order."""
        return [[self._slots[k].index for k in bucket] for bucket in self._engine.bucket_assignment()]

    def stats(self) -> DDPStats:
        """Where the steps so far spent their time: each step's compute (from its first training forward
        until ``sync_gradients()`` reduces), visible sync (that reduction, waited for) and overlapped sync
        (none here: a numpy model's buckets all start inside ``sync_gradients()``), with its bytes and
        buckets; the last 100 steps and the totals. `axonml_distributed.ddp_stats` defines each figure."""
        return DDPStats.from_native(self._engine.stats())

    def is_training(self) -> bool:
        return self._training

    def train(self, mode: bool = True) -> DistributedDataParallel:
        self._training = mode
        method = getattr(self.module, "train" if mode else "eval", None)
        if method is not None:
            method()
        return self

    def eval(self) -> DistributedDataParallel:
        return self.train(False)

    # -- the step -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._training:
            self._engine.begin_step()
            self._check_prior_sync()
        if self._training and self._require_grad_sync:
            # Like torch: buffers (e.g. batch-norm statistics) follow the first rank before each synced
            # training forward. A module without buffers issues no collective here.
            if self._broadcast_buffers:
                broadcast_arrays(self._pg, self._buffer_arrays())
        if callable(self.module):
            return self.module(*args, **kwargs)
        return self.module.forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, ``sync_gradients()`` does nothing: gradients accumulate locally (the model must add into
        them), and the first sync after the block averages the accumulated totals."""
        previous = self._require_grad_sync
        self._require_grad_sync = False
        try:
            yield
        finally:
            self._require_grad_sync = previous

    def sync_parameters(self) -> None:
        """Overwrite every rank's parameters (and buffers, if broadcast_buffers) in place with the first
        rank's. The constructor already does this; calling it again is harmless."""
        arrays = [ref.data() for ref in self._params]
        if self._broadcast_buffers:
            arrays += self._buffer_arrays()
        broadcast_arrays(self._pg, arrays)
        self._awaiting_sync = None  # new weights (a checkpoint, say) start a new step

    def sync_gradients(self) -> None:
        """Average the gradients over the group, in place (bucketed: one all-reduce per bucket).

        A gradient that is None on every rank stays None; None on some ranks only counts as zeros there.
        """
        if not self._require_grad_sync:
            return
        self._awaiting_sync = None
        if not self._slots:
            return
        grads = [self._fill_bucket(slot) for slot in self._slots]
        # The engine zeros the views of missing gradients, agrees with the other ranks on which gradients
        # some rank has (a MAX of flags), then reduces every bucket in order.
        some_rank_has = self._engine.finish([grad is not None for grad in grads], True)
        assert some_rank_has is not None  # asked for
        for slot, grad, some in zip(self._slots, grads, some_rank_has, strict=True):
            if some:
                self._write_back(slot, grad)

    # -- internals ----------------------------------------------------------------------------------------

    def _check_prior_sync(self) -> None:
        # torch's "Expected to have finished reduction in the prior iteration" check: without it a loop that
        # forgets sync_gradients() trains a different model on every rank without a word. A step since the
        # last training forward shows as gradients that hold something new (a backward) or, when the
        # gradients are zeros (zero_grad() before the forward), as new parameters (an optimizer step). It
        # only counts while some gradient exists: new weights with no gradient anywhere are a checkpoint
        # loaded, not a step (and sync_parameters() after a load forgets the step too).
        then = self._awaiting_sync
        now = self._snapshot(then is not None and then.params is not None)
        if then is not None and then.stepped_to(now):
            raise RuntimeError(
                "DistributedDataParallel: a new training forward started while the previous step's "
                "gradients were never averaged over the group, so the replicas would drift apart. Call "
                "ddp.sync_gradients() after backward and before the optimizer step; gradients meant to "
                "stay local go inside `with ddp.no_sync():`, evaluation forwards after ddp.eval(), and "
                "weights changed on purpose (a checkpoint) are followed by ddp.sync_parameters()."
            )
        # Inside no_sync() only the first forward checks (the step before the block); the gradients of
        # the micro-batches after it are meant to accumulate.
        self._awaiting_sync = now if self._require_grad_sync else None

    def _snapshot(self, with_params: bool) -> _Snapshot:
        grads = [None if (g := ref.grad()) is None else _checksum(g) for ref in self._params]
        # The parameters are read only when they are the one sign of a step to come: gradients exist and
        # all are zeros (a zero sum of the words). With no gradient at all nothing can count as a step.
        zeros = any(g is not None for g in grads) and all(g in (None, 0) for g in grads)
        params = [_checksum(ref.data()) for ref in self._params] if with_params or zeros else None
        return _Snapshot(grads, params)

    def _param_refs(self) -> list[_NumpyParam]:
        seen: set[int] = set()
        refs: list[_NumpyParam] = []
        for param in self.module.parameters():
            if id(param) in seen:  # tied weights appear once, or they would be averaged twice
                continue
            seen.add(id(param))
            refs.append(_NumpyParam(param))
        return refs

    def _install_views(self) -> None:
        for slot in self._slots:
            grad = slot.ref.grad()
            if grad is not None and not _is_view(grad, slot):
                self._copy_in(slot, grad)
                slot.ref.set_grad(slot.view)

    def _detach_views(self) -> None:
        for slot in self._slots:
            grad = slot.ref.grad()
            if grad is not None and _is_view(grad, slot):
                slot.ref.set_grad(slot.view.copy())

    def _fill_bucket(self, slot: _Slot) -> np.ndarray | None:
        """Put this rank's gradient into the bucket; returns the gradient seen (None: the engine zeros it)."""
        grad = slot.ref.grad()
        if grad is not None and not (self._gradient_as_bucket_view and _is_view(grad, slot)):
            # Copy mode, or the model replaced .grad with a new array instead of writing into the view.
            self._copy_in(slot, grad)
            if self._gradient_as_bucket_view:
                slot.ref.set_grad(slot.view)
        return grad

    def _write_back(self, slot: _Slot, grad: np.ndarray | None) -> None:
        if self._gradient_as_bucket_view:
            if grad is None:
                slot.ref.set_grad(slot.view)
        elif grad is None:
            slot.ref.set_grad(slot.view.copy())
        else:
            np.copyto(grad, slot.view)

    def _copy_in(self, slot: _Slot, grad: np.ndarray) -> None:
        if grad.shape != slot.view.shape:
            raise ValueError(
                f"parameter {slot.index}: gradient shape {grad.shape} does not match the parameter's "
                f"shape {slot.view.shape}"
            )
        np.copyto(slot.view, grad)

    def _buffer_arrays(self) -> list[np.ndarray]:
        buffers = getattr(self.module, "buffers", None)
        if buffers is None:
            return []
        # A numpy array also has a .data attribute (a memoryview), so test for arrays first.
        return [b if isinstance(b, np.ndarray) else b.data for b in buffers()]


DDP = DistributedDataParallel
