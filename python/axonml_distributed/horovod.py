"""Horovod's three calls for torch scripts, on our process groups: `broadcast_parameters`,
`broadcast_optimizer_state` and `DistributedOptimizer`.

``pg`` is a process group (None: the default group) and ``root_rank`` a global rank, as everywhere in the
package. `DistributedOptimizer` averages gradients as Horovod's does: hooks start the all-reduces during
backward (the buckets of `grad_reducer`, as our DDP's), and ``step()`` waits for them before updating.

torch stays optional: nothing here imports it before a torch object is passed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from axonml_distributed.buckets import broadcast_arrays, bucket_bytes
from axonml_distributed.codec import DEFAULT_MAX_BYTES
from axonml_distributed.ddp import check_group
from axonml_distributed.objects import broadcast_object
from axonml_distributed.tensors import is_tensor, raw_memory


def broadcast_parameters(params: Any, root_rank: int, pg: Any = None) -> None:
    """Overwrite, in place, every rank's tensors with global rank `root_rank`'s: a ``state_dict()`` (its
    tensors, in sorted key order; every rank must hold the same keys), ``named_parameters()`` or
    ``parameters()``. Any dtype (raw bytes move)."""
    group = check_group(pg)
    if isinstance(params, dict):
        tensors = [value for _, value in sorted(params.items())]
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    for t in tensors:
        if not is_tensor(t):
            raise TypeError(f"broadcast_parameters: expected tensors, got {type(t).__name__}")
    broadcast_arrays(group, [raw_memory(t) for t in tensors], root_rank)


def broadcast_optimizer_state(
    optimizer: Any, root_rank: int, pg: Any = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> None:
    """Make every rank's torch optimizer state (its ``state_dict()``: per-parameter state such as momentum
    buffers and step counts, and the param groups' options such as ``lr``) global rank `root_rank`'s. Ranks
    whose optimizer never stepped get the root's state too.

    The state travels through the object codec (`broadcast_object`), never pickle: its tensors as arrays
    of their dtype, its numbers, strings, tuples and nested dicts and lists as themselves. A state whose
    encoding exceeds `max_bytes` (64 MiB by default; pass the same larger value on every rank) or holds
    anything else (a tensor requiring grad, an object of the optimizer's own) raises on every rank
    before anything moves."""
    group = check_group(pg)
    is_root = group.rank() == root_rank
    state = broadcast_object(
        optimizer.state_dict() if is_root else None, root_rank, group, max_bytes=max_bytes
    )
    if not is_root:
        optimizer.load_state_dict(state)


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see `DistributedOptimizer`)."""

    _reducer: Any
    _passes: int
    _delay: list[int]
    _skip: bool

    def _setup(self, named: list[tuple[int, str, Any]], group: Any, passes: int, cap: int) -> None:
        from axonml_distributed.grad_reducer import GradReducer

        self._passes = passes
        self._delay = [passes] * len(named)
        self._skip = False
        self._reducer = GradReducer(group, named, cap, True, self)

    def _on_gradient(self, slot: Any) -> None:
        if self._reducer.is_ready(slot):
            raise RuntimeError(
                f"DistributedOptimizer: {slot.name} received a gradient after its reduction started: "
                f"more than backward_passes_per_step={self._passes} backward passes before step(); "
                "raise backward_passes_per_step to accumulate more passes locally"
            )
        self._delay[slot.index] -= 1
        if self._delay[slot.index] == 0:
            self._reducer.ready(slot)

    def synchronize(self) -> None:
        """Wait for the gradients' averages (reducing those whose backward passes are not all in yet, and
        counting a gradient no backward produced on this rank as zeros). `step` calls it itself."""
        if any(slot.used for slot in self._reducer.slots):
            self._reducer.finish(find_unused=True)
        self._delay = [self._passes] * len(self._delay)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``synchronize()``, then gradient clipping, then ``step()`` in here (which then only steps)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._skip:
            self.synchronize()
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._reducer.in_flight():
            raise RuntimeError(
                "DistributedOptimizer: zero_grad() was called after backward() and before step() or "
                "synchronize(): the gradients' averages are still being computed"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


def _named(optimizer: Any, named_parameters: Iterable[tuple[str, Any]] | None) -> list[tuple[int, str, Any]]:
    """The optimizer's trainable parameters with their names, in param-group order (the same on every
    rank), as Horovod checks them: named ones must be unique and cover every parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    names: dict[int, str] = {}
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
            raise ValueError("named_parameters must be a sequence of (name, parameter) tuples")
        if len({name for name, _ in named}) != len(named):
            raise ValueError("named_parameters contains duplicate names")
        names = {id(p): name for name, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ValueError(
                f"named_parameters was given, but the optimizer's parameters at positions {missing} are not "
                "in it (pass model.named_parameters() of the model the optimizer trains)"
            )
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter appears in more than one of the optimizer's param groups")
    for p in params:
        if p.device.type != "cpu":
            raise ValueError(f"DistributedOptimizer runs on CPU tensors; a parameter is on {p.device}")
    return [(i, names.get(id(p), f"param.{i}"), p) for i, p in enumerate(params)]


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory of optimizer instances
    optimizer: Any,
    named_parameters: Iterable[tuple[str, Any]] | None = None,
    pg: Any = None,
    *,
    backward_passes_per_step: int = 1,
    bucket_cap_mb: float = 25,
) -> Any:
    """The torch `optimizer` (an instance of its own class still, sharing its state and param groups) whose
    ``step()`` first averages the gradients over `pg` (None: the default group). The all-reduces start
    during backward, from hooks, as soon as a bucket of gradients is complete; ``step()`` waits for them.

    With ``backward_passes_per_step=N`` gradients accumulate locally over N backward passes and are
    averaged (the accumulated sums, as Horovod) on the N-th; ``step()`` after fewer reduces what there is.
    A gradient no rank produced stays as it was (None); one produced on some ranks only counts as zeros on
    the others. ``synchronize()`` and ``skip_synchronize()`` as Horovod's, for gradient clipping.
    """
    passes = backward_passes_per_step
    if not (isinstance(passes, int) and passes >= 1):
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, not {passes!r}")
    named = _named(optimizer, named_parameters)
    group = check_group(pg)
    base = type(optimizer)
    cls: Any = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hooks
    wrapped._setup(named, group, passes, bucket_bytes(bucket_cap_mb))
    return wrapped
