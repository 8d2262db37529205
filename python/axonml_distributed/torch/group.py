"""The "axonml" ProcessGroup: torch's ProcessGroup interface over a native `ProcessGroup`.

Blocking calls from torch's Python API (``asyncOp=False``: ``dist.all_reduce(t)`` and the like) run on
the calling thread and return no Work (torch then knows the backend has synchronised), so they pay for
no Work, future or thread hand-off. Every other call returns a `Work` (see `work`).

An asynchronous all-reduce of at most `INLINE_IN_BACKWARD` bytes issued from inside an autograd
backward pass (DDP's reducer issues its buckets there; the first bucket is 1 MiB by default, and small
models have no other) runs on the calling thread too and returns a finished Work: the backward pass
waits for every bucket before it ends anyway, and handing a small bucket to the lane's thread and its
future back costs several thread wake-ups per step, more than the reduction. Larger buckets still
overlap with the rest of the backward pass.

While torch's profiler runs, every call records one ``axonml:<op>`` event, as c10d's backends do (see
`profiling`); otherwise a call pays one check for it. A sparse COO all_reduce (SUM) is summed as gloo
sums it (see `sparse`), on the calling thread.
"""

# The overrides follow the signatures torch's C++ trampolines call, not every overload of its stubs.
# mypy: disable-error-code="override,assignment"

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed._core import ProcessGroup, ReduceOp
from axonml_distributed.exceptions import CollectiveTimeoutError
from axonml_distributed.hosts.host_group import HostGroup
from axonml_distributed.torch.named import NamedGroup
from axonml_distributed.torch.profiling import enabled as _profiling
from axonml_distributed.torch.profiling import profiled
from axonml_distributed.torch.rank_order import RankOrder
from axonml_distributed.torch.sparse import all_reduce_sparse
from axonml_distributed.torch.work import AnySourceWork, Completer, Work
from axonml_distributed.torch_entry import BACKEND
from axonml_distributed.trace import spans

_SUM = dist.ReduceOp.SUM
_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVERAGE,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}
INLINE_IN_BACKWARD = 1 << 20
# torch's id of the backward pass running on this thread, -1 outside one (a private API: without it,
# every asynchronous all-reduce goes to the lane).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _seconds(timeout: Any) -> float:
    """A timeout torch hands over (a ``timedelta``, or seconds) in seconds."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _async(opts: Any) -> bool:
    """False for a blocking call from torch's Python API, which sets ``asyncOp=False`` and waits at
    once (torch's own C++ callers, DDP's reducer among them, leave it True)."""
    return opts is None or getattr(opts, "asyncOp", True) is not False


def _op(op: Any) -> tuple[ReduceOp, float]:
    """Our op for torch's `op` (a ``dist.ReduceOp``, or the bare ``RedOpType`` it holds, as the shards'
    op between hosts is), and the factor to scale each input by first (PREMUL_SUM's; 1.0 for the
    others)."""
    if op == _SUM:  # the common case first: torch's op enum hashes slowly
        return ReduceOp.SUM, 1.0
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        return ReduceOp.SUM, float(op.factor)
    ours = _OPS.get(kind)
    if ours is None:
        raise ValueError(
            f"the axonml backend does not implement {kind} (use SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, "
            "BXOR or PREMUL_SUM)"
        )
    return ours, 1.0


def _dense(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object] | None]:
    """`t` itself when contiguous, else a contiguous copy and the step that copies the result back."""
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, lambda: t.copy_(c)


def _chain(*steps: Callable[[], object] | None) -> Callable[[], object] | None:
    todo = [s for s in steps if s is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for s in todo:
            s()

    return run


def _stage(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors]) if tensors else torch.empty(0)


def _unstage(outputs: Sequence[torch.Tensor], flat: torch.Tensor, counts: list[int]) -> None:
    """Copy consecutive pieces of `flat` (`counts` elements each) into `outputs`."""
    for o, piece in zip(outputs, flat.split(counts), strict=True):
        o.copy_(piece.view(o.shape))


_DENSE_FORMATS = (torch.channels_last, torch.channels_last_3d)


def any_strided(*tensors: torch.Tensor) -> bool:
    """Whether any of `tensors` is contiguous in no memory format (channels last too): what c10d's check
    of all_to_all_single's tensors refuses (`_refuse_strided`)."""
    return any(
        not t.is_contiguous() and not any(t.is_contiguous(memory_format=f) for f in _DENSE_FORMATS)
        for t in tensors
    )


def _refuse_strided(*tensors: torch.Tensor) -> None:
    """c10d's check of all_to_all_single's tensors (gloo's and nccl's ValueError, which torch's tests
    expect)."""
    if any_strided(*tensors):
        raise ValueError(
            "Tensors must be contiguous: all_to_all_single takes no strided view (as gloo and nccl); "
            "pass .contiguous() of it"
        )


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """For the collectives whose core call takes no factor (reduce_scatter): a scaled copy."""
    return t if factor == 1.0 else t * factor


def _event(op: str, inputs: Callable[..., Sequence[torch.Tensor]]) -> Callable[[Any], Any]:
    """The method records a profiler event ``axonml:<op>`` per call (see `profiling`)."""
    return profiled(f"{BACKEND}:{op}", inputs)


# Which arguments of a method are its input tensors, for its profiler event: c10d's choice (a list
# form's every input tensor; none for the ranks that only receive).
def _first(tensors: Sequence[torch.Tensor], *_: Any, **__: Any) -> Sequence[torch.Tensor]:
    return tensors


def _second(_: Any, inputs: Sequence[torch.Tensor], *__: Any, **___: Any) -> Sequence[torch.Tensor]:
    return inputs


def _single(_: Any, input: torch.Tensor, *__: Any, **___: Any) -> Sequence[torch.Tensor]:
    return [input]


def _lists(_: Any, lists: Sequence[Sequence[torch.Tensor]], *__: Any, **___: Any) -> list[torch.Tensor]:
    return [t for ins in lists for t in ins]


def _none(*_: Any, **__: Any) -> Sequence[torch.Tensor]:
    return ()


class AxonmlProcessGroup(NamedGroup):
    """torch's ProcessGroup interface over a native `ProcessGroup`: torch passes group ranks, the core
    takes global ones."""

    def __init__(self, native: ProcessGroup | HostGroup, rank: int, size: int) -> None:
        super().__init__(rank, native.ranks())
        self._native: Any = native  # takes CPU tensors where its stub says arrays
        self._rank = rank
        self._completers: dict[Any, Completer] = {}
        self._lock = threading.Lock()
        # Looked up once: `allreduce`'s short way pays for no lookup it can avoid.
        self._all_reduce = native.all_reduce
        self._coll = self._completer("coll")
        # The backward (autograd graph task) of the last bucket of torch's DDP seen, and its position in
        # it, for the timeline (`trace.spans.torch_bucket`).
        self._buckets = (-1, -1)

    def _get_sequence_number_for_group(self) -> int:
        """The engine's number of the last collective this rank entered on the group: equal on every
        member between calls, as torch's sequence numbers are."""
        return self._native.sequence_number()

    def __repr__(self) -> str:
        return f"AxonmlProcessGroup(rank={self.rank()}, ranks={self._ranks})"

    # -- plumbing -----------------------------------------------------------------------------------

    def _completer(self, lane: Any) -> Callable[[], Completer]:
        def get() -> Completer:
            with self._lock:
                completer = self._completers.get(lane)
                if completer is None:
                    completer = self._completers[lane] = Completer()
                return completer

        return get

    def _done(
        self, lane: Any, natives: list[Any], result: Any, finish: Callable[[], object] | None = None
    ) -> Work | None:
        """What a call returns once its native calls are issued: nothing for a blocking call (they ran
        already; the copy-back runs here), else a Work over them."""
        if natives and natives[0] is None:
            if finish is not None:
                finish()
            return None
        if isinstance(result, list) and len(result) == 1 and isinstance(result[0], list):
            # gloo's futures hold a call's outputs as a list of lists, but one list alone flat (an
            # all_gather's or a gather's outputs for its one input).
            result = result[0]
        return Work(natives, result, finish, self._coll if lane == "coll" else self._completer(lane))

    def _root(self, opts: Any) -> tuple[int, bool]:
        """The global rank of the call's root, and whether it is this rank."""
        return self._ranks[opts.rootRank], opts.rootRank == self._rank

    # -- collectives ----------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | None:
        """The call torch makes most (``dist.all_reduce(t)``, DDP's buckets) takes the short way: one
        contiguous dense tensor, SUM, the profiler off. The rest takes `_allreduce_any`, as it would.
        A sparse COO tensor is never contiguous to torch (and a sparse CSR one raises there, as it
        would on the long way), so the short way asks nothing else about the layout."""
        if opts is not None and len(tensors) == 1 and not _profiling():
            t = tensors[0]
            if t.is_contiguous() and opts.reduceOp == _SUM:
                if opts.asyncOp is False:
                    self._all_reduce(t)
                    return None
                if _graph_task_id() < 0:  # else inline in backward (see the module docs)
                    return Work([self._all_reduce(t, async_op=True)], tensors, None, self._coll)
        work = self._allreduce_any(tensors, opts)
        if spans.on() and work is not None and (task := _graph_task_id()) >= 0:
            # In backward, asynchronous: a bucket of torch's DDP (its reducer launches them in order).
            count = self._buckets[1] + 1 if self._buckets[0] == task else 0
            self._buckets = (task, count)
            # Rank None: the process's (it holds one), as the timeline numbers it; the group's numbering
            # is its host's when the job spans several (`trace.timeline_file`).
            spans.torch_bucket(None, count, sum(t.nbytes for t in tensors), work.get_future())
        return work

    @_event("all_reduce", _first)
    def _allreduce_any(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | None:
        op = (opts or dist.AllreduceOptions()).reduceOp
        if tensors and tensors[0].is_sparse:
            return self._allreduce_sparse(tensors, op, _async(opts))
        if not _async(opts):
            return self._allreduce(tensors, op, detached=False)
        if _graph_task_id() < 0 or sum(t.nbytes for t in tensors) > INLINE_IN_BACKWARD:
            return self._allreduce(tensors, op, detached=True)
        try:  # inside a backward pass (see the module docs): here, and its error goes to the Work
            self._allreduce(tensors, op, detached=False)
        except Exception as e:
            return Work.done(tensors, e, self._coll)
        return Work.done(tensors, None, self._coll)

    def _allreduce(self, tensors: list[torch.Tensor], op: Any, detached: bool) -> Work | None:
        natives, finishes = [], []
        for t in tensors:
            ours, factor = _op(op)
            buf, back = _dense(t)
            # PREMUL_SUM's factor is the core's prescale factor: applied as each input is read.
            natives.append(self._native.all_reduce(buf, ours, prescale_factor=factor, async_op=detached))
            finishes.append(back)
        return self._done("coll", natives, tensors, _chain(*finishes))

    def _allreduce_sparse(self, tensors: list[torch.Tensor], op: Any, detached: bool) -> Work | None:
        """Sparse COO tensors (see `sparse`): on the calling thread, as a blocking call (the pieces'
        sizes are known only as it goes); an asynchronous call gets a finished Work with any error."""
        if op != _SUM or not all(t.is_sparse for t in tensors):
            raise ValueError(
                "the axonml backend reduces sparse tensors with SUM only, and not mixed with dense ones "
                f"(got {getattr(op, 'op', op)} over layouts {[str(t.layout) for t in tensors]})"
            )
        try:
            for t in tensors:
                all_reduce_sparse(self._native, t)
        except Exception as e:
            if not detached:
                raise
            return Work.done(tensors, e, self._coll)
        return Work.done(tensors, None, self._coll) if detached else None

    @_event("all_reduce", _first)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | None:
        return self.allreduce(tensors, opts)

    @_event("broadcast", _first)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | None:
        detached = _async(opts)
        root, _ = self._root(opts or dist.BroadcastOptions())
        natives, finishes = [], []
        for t in tensors:
            buf, back = _dense(t)
            natives.append(self._native.broadcast(buf, root, async_op=detached))
            finishes.append(back)
        return self._done("coll", natives, tensors, _chain(*finishes))

    @_event("all_gather", _second)
    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        return self._gather_each(output_lists, inputs, output_lists, opts)

    @_event("all_gather", _second)
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        """torch's lists run the other way round from `allgather`'s: ``output_lists[r][j]`` receives
        rank r's ``inputs[j]``. One all_gather per input, into its column of the outputs."""
        return self._gather_coalesced(output_lists, inputs, output_lists, opts)

    def _gather_coalesced(
        self, per_rank: list[list[torch.Tensor]], inputs: list[torch.Tensor], result: Any, opts: Any
    ) -> Work | None:
        """`allgather_coalesced` into ``per_rank`` (the output lists in the core's order of ranks)."""
        if len(per_rank) != self.size() or any(len(o) != len(inputs) for o in per_rank):
            raise ValueError(
                f"all_gather_coalesced needs {self.size()} output lists (one per rank) of {len(inputs)} "
                "tensors (one per input)"
            )
        columns = [[outs[j] for outs in per_rank] for j in range(len(inputs))]
        return self._gather_each(columns, inputs, result, opts)

    def _gather_each(
        self, per_input: list[list[torch.Tensor]], inputs: list[torch.Tensor], result: Any, opts: Any
    ) -> Work | None:
        """All_gather ``inputs[j]`` into ``per_input[j]`` (one tensor per rank) for every j."""
        detached = _async(opts)
        natives: list[Any] = []
        finishes: list[Callable[[], object] | None] = []
        for outs, t in zip(per_input, inputs, strict=True):
            if any(o.shape != t.shape for o in outs):  # uneven sizes: all_gather_v
                counts = [o.numel() for o in outs]
                flat = torch.empty(sum(counts), dtype=t.dtype)
                natives.append(self._native.all_gather_v(_dense(t)[0], flat, counts, async_op=detached))
                finishes.append(partial(_unstage, outs, flat, counts))
                continue
            staged = torch.empty((len(outs), *t.shape), dtype=t.dtype)
            natives.append(self._native.all_gather(_dense(t)[0], staged, async_op=detached))
            finishes.append(partial(_unstage, outs, staged.view(-1), [t.numel()] * len(outs)))
        return self._done("coll", natives, result, _chain(*finishes))

    @_event("all_gather_into_tensor", _single)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work | None:
        out, back = _dense(output)
        send, into = _dense(input)[0], out.view(self.size(), *input.shape)
        native = self._native.all_gather(send, into, async_op=_async(opts))
        return self._done("coll", [native], [output], back)

    _allgather_base = all_gather_single

    @_event("all_gather_into_tensor", _second)
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        return self._coalesced(self.all_gather_single, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _coalesced(
        self,
        one: Callable[..., Work | None],
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any,
    ) -> Work | None:
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        if not _async(opts):
            return None
        natives = [n for w in works if w is not None for n in w._natives]
        return self._done("coll", natives, outputs, _chain(*(w._finish for w in works if w is not None)))

    @_event("reduce_scatter", _lists)
    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Work | None:
        detached = _async(opts)
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        natives, finishes = [], []
        for out, ins in zip(outputs, input_lists, strict=True):
            ours, factor = _op(op)
            buf, back = _dense(out)
            if any(x.shape != out.shape for x in ins):  # uneven sizes: reduce_scatter_v
                counts = [x.numel() for x in ins]
                send = _scaled(torch.cat([x.detach().reshape(-1) for x in ins]), factor)
                natives.append(self._native.reduce_scatter_v(send, buf, counts, ours, async_op=detached))
                finishes.append(back)
                continue
            send = _scaled(_stage(ins), factor)
            natives.append(self._native.reduce_scatter(send, buf, ours, async_op=detached))
            finishes.append(back)
        return self._done("coll", natives, outputs, _chain(*finishes))

    @_event("reduce_scatter_tensor", _single)
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work | None:
        ours, factor = _op((opts or dist.ReduceScatterOptions()).reduceOp)
        buf, back = _dense(output)
        send = _scaled(_dense(input)[0], factor)
        native = self._native.reduce_scatter(send, buf, ours, async_op=_async(opts))
        return self._done("coll", [native], [output], back)

    _reduce_scatter_base = reduce_scatter_single

    @_event("reduce_scatter_tensor", _second)
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        return self._coalesced(self.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_event("reduce", _first)
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work | None:
        detached = _async(opts)
        opts = opts or dist.ReduceOptions()
        root, here = self._root(opts)
        natives, finishes = [], []
        for t in tensors:
            ours, factor = _op(opts.reduceOp)
            buf, back = _dense(t)
            # The core scales as it reads: off the root the tensor stays as it was.
            natives.append(self._native.reduce(buf, root, ours, prescale_factor=factor, async_op=detached))
            finishes.append(back)
        return self._done("coll", natives, tensors, _chain(*finishes))

    @_event("gather", _second)
    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        return self._gather_into(output_lists, inputs, output_lists, opts)

    def _gather_into(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], result: Any, opts: Any
    ) -> Work | None:
        """`gather` into ``output_lists`` (the root's list in the core's order of ranks)."""
        detached = _async(opts)
        (t,) = inputs
        outs = output_lists[0] if output_lists else []
        root, here = self._root(opts or dist.GatherOptions())
        staged = torch.empty((self.size(), *t.shape), dtype=t.dtype) if here else None
        native = self._native.gather(_dense(t)[0], staged, root, async_op=detached)
        finish = None if staged is None else (lambda: [o.copy_(s) for o, s in zip(outs, staged, strict=True)])
        return self._done("coll", [native], result, finish)

    @_event("gather", _single)
    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work | None:
        root, here = self._root(opts or dist.GatherOptions())
        out, back = (None, None)
        if here:
            out, back = _dense(output)
            out = out.view(self.size(), *input.shape)
        native = self._native.gather(_dense(input)[0], out, root, async_op=_async(opts))
        return self._done("coll", [native], [output], back)

    gather_into_tensor = gather_single

    @_event("scatter", _lists)
    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Work | None:
        (out,) = outputs
        root, here = self._root(opts or dist.ScatterOptions())
        send = _stage(input_lists[0]) if here else None
        buf, back = _dense(out)
        native = self._native.scatter(send, buf, root, async_op=_async(opts))
        return self._done("coll", [native], outputs, back)

    @_event("monitored_barrier", _none)
    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """torch's ``ProcessGroup.monitored_barrier``, which the native group's carries out (naming
        every missing rank). torch's ``dist.monitored_barrier`` never gets here: it asks for a group
        with a CPU device backend registered, which a backend that is a ProcessGroup has not (and
        claiming one would have torch attach its flight recorder, which fails on such a group; torch
        2.13 and older refuse every backend but gloo by name, and 2.15 forwards the call only to a
        backend written as a subclass of its private C++ ``Backend``); call it on the group:
        ``dist.group.WORLD.monitored_barrier(timeout)``. A zero timeout times out at
        once, as gloo's does (the native group refuses it as no timeout at all)."""
        if timeout is not None and _seconds(timeout) == 0:
            raise self._timed_out_at_once()
        self._native.monitored_barrier(timeout, wait_all_ranks)

    def _timed_out_at_once(self) -> CollectiveTimeoutError:
        """A monitored barrier with a zero timeout: it waits for no member, so every other one counts as
        missing, in torch's words; the world is aborted, as by any timeout, so none waits for this rank."""
        me, members = self._native.rank(), self._native.ranks()
        others = [r for r in members if r != me]
        message = (
            f"Rank {me} timed out in monitoredBarrier after 0 ms: a zero timeout waits for no member, so "
            f"rank(s) {others} of group {members} never arrived"
        )
        self._native.backend().abort(message)
        return CollectiveTimeoutError(
            message, rank=me, ranks=others, call="monitored_barrier", group=members, waited=0.0
        )

    @_event("barrier", _none)
    def barrier(self, opts: Any = None) -> Work | None:
        return self._done("coll", [self._native.barrier(async_op=_async(opts))], None)

    @_event("all_to_all", _second)
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        """Lists of tensors of any sizes: one all_to_all_single over their concatenations."""
        return self._alltoall(outputs, inputs, outputs, opts)

    def _alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], result: Any, opts: Any
    ) -> Work | None:
        """`alltoall` of ``inputs`` into ``outputs`` (both in the core's order of ranks)."""
        outs, ins = [o.numel() for o in outputs], [t.numel() for t in inputs]
        send = torch.cat([t.detach().reshape(-1) for t in inputs])
        flat = torch.empty(sum(outs), dtype=send.dtype)
        native = self._native.all_to_all_single(send, flat, outs, ins, async_op=_async(opts))
        return self._done("coll", [native], result, lambda: _unstage(outputs, flat, outs))

    @_event("all_to_all", _single)
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work | None:
        _refuse_strided(output, input)
        views = self._member_views(output, input, output_split_sizes, input_split_sizes)
        if views is not None:
            return self._alltoall(*views, [output], opts)
        # torch passes [] for an equal split, which the core spells None. A tensor dense in another
        # memory format (channels last) goes through a copy in the usual one.
        out, back = _dense(output)
        outs, ins = list(output_split_sizes) or None, list(input_split_sizes) or None
        native = self._native.all_to_all_single(_dense(input)[0], out, outs, ins, async_op=_async(opts))
        return self._done("coll", [native], [output], back)

    alltoall_base = all_to_all_single

    def _member_views(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """For `all_to_all_single`: per-member views of `output` and `input` in the core's order, when
        the group orders its members otherwise (then the list form runs over them); None to hand both
        tensors to the core as they are."""
        return None

    # -- point to point (no options: always a Work, which torch waits on) ---------------------------

    @_event("send", _first)
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work | None:
        peer = self._ranks[dst]
        natives = [self._native.send(_dense(t)[0], peer, tag, async_op=True) for t in tensors]
        return self._done(("send", peer, tag), natives, tensors)

    @_event("recv", _first)
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work | None:
        peer = self._ranks[src]
        natives, finishes = [], []
        for t in tensors:
            buf, back = _dense(t)
            natives.append(self._native.recv(buf, peer, tag, async_op=True))
            finishes.append(back)
        return self._done(("recv", peer, tag), natives, tensors, _chain(*finishes))

    @_event("recvAnySource", _first)
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """The first message with `tag` from any member; the Work's `_source_rank()` is the sender's
        group rank (torch's `dist.recv(t)` maps it to the global rank it returns). One tensor, as gloo:
        each tensor could come from another sender."""
        if len(tensors) != 1:
            raise ValueError(f"recv from any source takes one tensor, got {len(tensors)}")
        buf, back = _dense(tensors[0])
        native = self._native.recv_any(buf, tag, async_op=True)
        return AnySourceWork(native, self._ranks, tensors, back, self._completer(("recv_any", tag)))


class OrderedProcessGroup(AxonmlProcessGroup):
    """A one-host group whose members torch orders otherwise than the core (``new_group(ranks,
    sort_ranks=False)``, ranks not ascending): torch's group rank of a member is its place in `order`'s
    ranks, and every call follows that order, as on gloo. A group in ascending order is an
    `AxonmlProcessGroup`, which pays for none of this.

    Roots and peers go through ``_ranks``, here in torch's order (so do the senders that a receive from
    any source reports); the calls with one item or chunk per member hand the core their items in its
    order (`RankOrder`), and write what it returns back in torch's."""

    def __init__(self, native: ProcessGroup | HostGroup, rank: int, size: int, order: RankOrder) -> None:
        super().__init__(native, rank, size)
        self._order = order
        self._ranks = order.restore(native.ranks())

    @_event("all_gather", _second)
    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        per_input = [self._order.reorder(outs, "all_gather's output list") for outs in output_lists]
        return self._gather_each(per_input, inputs, output_lists, opts)

    @_event("all_gather", _second)
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        per_rank = self._order.reorder(output_lists, "all_gather_coalesced's output lists")
        return self._gather_coalesced(per_rank, inputs, output_lists, opts)

    @_event("all_gather_into_tensor", _single)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work | None:
        staged, finish = self._staged(output, input.shape)
        native = self._native.all_gather(_dense(input)[0], staged, async_op=_async(opts))
        return self._done("coll", [native], [output], finish)

    _allgather_base = all_gather_single

    def _staged(
        self, output: torch.Tensor, shape: torch.Size
    ) -> tuple[torch.Tensor, Callable[[], object] | None]:
        """A buffer for the core to write one `shape` chunk per member into, in its order, and the step
        that copies them into `output` in torch's."""
        out, back = _dense(output)
        staged = torch.empty((self.size(), *shape), dtype=output.dtype)
        restore = partial(self._order.restore_rows, staged, out.view(self.size(), *shape))
        return staged, _chain(restore, back)

    @_event("reduce_scatter", _lists)
    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Work | None:
        reordered = [self._order.reorder(ins, "reduce_scatter's input list") for ins in input_lists]
        return super().reduce_scatter(outputs, reordered, opts)

    @_event("reduce_scatter_tensor", _single)
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work | None:
        if input.numel() % self.size():  # not one chunk per member: the core refuses it, as in order
            return super().reduce_scatter_single(output, input, opts)
        rows = self._order.reorder_rows(input.detach().reshape(self.size(), -1))
        return super().reduce_scatter_single(output, rows, opts)

    _reduce_scatter_base = reduce_scatter_single

    @_event("gather", _second)
    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        reordered = [self._order.reorder(outs, "gather's output list") for outs in output_lists]
        return self._gather_into(reordered, inputs, output_lists, opts)

    @_event("gather", _single)
    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work | None:
        root, here = self._root(opts or dist.GatherOptions())
        if not here:  # nothing comes back here
            return super().gather_single(output, input, opts)
        staged, finish = self._staged(output, input.shape)
        native = self._native.gather(_dense(input)[0], staged, root, async_op=_async(opts))
        return self._done("coll", [native], [output], finish)

    gather_into_tensor = gather_single

    @_event("scatter", _lists)
    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Work | None:
        reordered = [self._order.reorder(ins, "scatter's input list") for ins in input_lists]
        return super().scatter(outputs, reordered, opts)

    @_event("all_to_all", _second)
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work | None:
        outs = self._order.reorder(outputs, "all_to_all's output list")
        return self._alltoall(outs, self._order.reorder(inputs, "all_to_all's input list"), outputs, opts)

    def _member_views(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """all_to_all_single as the list form over per-member views of both tensors (no copy but the
        list form's), in the core's order; None when they do not make one chunk per member or their
        dtypes differ (the core refuses them, as in order)."""
        outs, ins = self._rows(output, output_splits), self._rows(input, input_splits)
        if outs is None or ins is None or output.dtype != input.dtype:
            return None
        return self._order.reorder(outs), self._order.reorder(ins)

    def _rows(self, t: torch.Tensor, split_sizes: list[int]) -> list[torch.Tensor] | None:
        """`t`'s chunks along its first dimension, one per member (`split_sizes` rows each, or equal when
        empty), as views; None if they do not make one per member."""
        if t.dim() == 0:
            return None
        rows = t.shape[0]
        sizes = list(split_sizes) or ([rows // self.size()] * self.size() if rows % self.size() == 0 else [])
        if len(sizes) != self.size() or sum(sizes) != rows or min(sizes) < 0:
            return None
        return list(t.split(sizes))
