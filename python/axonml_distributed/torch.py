"""A torch.distributed backend, "axonml": unchanged PyTorch scripts on the shared-memory world.

torch finds it through this package's ``torch.distributed.backends`` entry point the first time a
script names it (torch 2.15 reads that group), so scripts need no import of ours; ``import
axonml_distributed.torch`` registers it explicitly (for a torch that does not). Importing
``axonml_distributed`` alone registers nothing and never loads torch. Then
``torch.distributed.init_process_group("axonml")`` (or ``"cpu:axonml"``) joins the shared-memory world
of this host with any init method (``env://`` under torchrun or axonml-run, ``tcp://``, ``file://``),
and torch's DDP, object collectives and the rest of ``torch.distributed`` run on our core.

Rendezvous goes through the Store torch hands the backend, never through a socket of ours: every rank
publishes its host identity; rank 0 refuses a job spread over several hosts, creates the segment and
puts its token (name, session nonce, world size) in the store; every rank joins with it. The Store is
the trust boundary: torch's TCPStore is unauthenticated, so whoever reaches it learns the segment's
name, but the segment is a 0600 file of this user (checked on attach) and the nonce ties it to this
job. Under axonml-run the token also carries an HMAC with the job secret (AXONML_JOB_SECRET), which
every rank checks: a token another job or user wrote into the store is refused.

Tensors: CPU tensors of float32, float64, float16, bfloat16, int8, uint8, int32, int64 and bool are
handed to the core in place (zero copy). Non-contiguous tensors work (gloo refuses them): they go
through a contiguous copy that is copied back before the Work completes. List forms (``all_gather``
into a list, ``reduce_scatter`` from a list, ``gather``, ``scatter``) stage through one contiguous
buffer. Subgroups (``new_group``, ``new_subgroups``) are native subgroups of the same world.

Errors: a mismatch, timeout or dead peer raises our CollectiveMismatchError, CollectiveTimeoutError or
PeerFailureError (subclasses of RuntimeError) from ``Work.wait()`` and so from every blocking
``torch.distributed`` call; torch's C++ (DDP's reducer waiting on a bucket's future) re-raises them as a
plain RuntimeError with our message.
"""

# The overrides follow the signatures torch's C++ trampolines call, not every overload of its stubs.
# mypy: disable-error-code="override,assignment"

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import hmac
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed._core import (
    Backend,
    DistributedError,
    MockBackend,
    ProcessGroup,
    ReduceOp,
    ShmSegment,
)
from axonml_distributed.init import install_excepthook

__all__ = ["BACKEND", "AxonmlProcessGroup", "register"]

BACKEND = "axonml"

_ALL_TO_ALL = (
    "all_to_all / all_to_all_single are not implemented by the axonml backend yet: they come with the "
    "collectives issue (all-to-all in the core); use gloo for them until then"
)
_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVERAGE,
}
# The world of this process's default group: subgroups are native subgroups over it.
_world: Backend | None = None
# Where torch futures are completed: never a thread our own progress needs, so a future's callback may
# issue and wait on further collectives (torch's PowerSGD hook does) without blocking a lane.
_settlers = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="axonml-future")


def _host_identity() -> str:
    """This host: its name and its boot id (containers share the kernel's boot id, not the name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()} (boot {boot})"


def _mac(token: str) -> str:
    secret = os.environ.get("AXONML_JOB_SECRET", "")
    return hmac.new(secret.encode(), token.encode(), hashlib.sha256).hexdigest() if secret else ""


def _get(store: dist.Store, key: str, timeout: datetime.timedelta) -> str:
    store.wait([key], timeout)
    return store.get(key).decode()


def _join_world(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Backend:
    """The shared-memory world of `size` ranks, met through `store` (see the module docs)."""
    store.set(f"axonml/host/{rank}", _host_identity())
    if rank == 0:
        hosts = [_get(store, f"axonml/host/{r}", timeout) for r in range(size)]
        if len(set(hosts)) > 1:
            where = ", ".join(f"rank {r} on {h}" for r, h in enumerate(hosts))
            problem = (
                f"the axonml backend runs the ranks of one host only ({where}); jobs over several hosts "
                "come with the hierarchical (multi-host) issue: use gloo for them until then"
            )
            store.set("axonml/token", "error: " + problem)
            raise DistributedError(problem)
        arena = os.environ.get("AXONML_SHM_ARENA_MB")
        segment = ShmSegment(size, int(float(arena) * (1 << 20)) if arena else None)
        try:
            store.set("axonml/token", f"{segment.token}\n{_mac(segment.token)}")
            world = ShmSegment.join(segment.token, 0, size, timeout.total_seconds())
        finally:
            segment.close()
        # Every rank has joined, so none reads these again: a later init over the same store (torchrun
        # keeps one per agent) must not find this job's token.
        for key in ["axonml/token", *(f"axonml/host/{r}" for r in range(size))]:
            store.delete_key(key)
        return world
    token, _, mac = _get(store, "axonml/token", timeout).partition("\n")
    if token.startswith("error: "):
        raise DistributedError(token.removeprefix("error: "))
    if not hmac.compare_digest(mac, _mac(token)):
        raise DistributedError(
            "the shared-memory token in the store does not carry this job's AXONML_JOB_SECRET: the store "
            "is shared with another job, or its ranks were started with different secrets"
        )
    return ShmSegment.join(token, rank, size, timeout.total_seconds())


def _create(opts: Any, _backend_options: Any) -> AxonmlProcessGroup:
    """torch's creator (extended API): the default group joins the world, subgroups split it."""
    global _world
    ranks = list(opts.global_ranks_in_group)
    if not ranks:
        _world = _join_world(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        native = ProcessGroup(_world)
        # As our own init_process_group does: an exception that ends this process's main thread aborts
        # the world at once (and leaves the launcher's error file), even if the process lingers.
        install_excepthook(native)
    elif _world is None:
        raise DistributedError(
            "an axonml subgroup needs an axonml default group: init_process_group('axonml')"
        )
    elif len(ranks) == 1:
        # Nothing to exchange: a world of its own, which costs none of the segment's subgroup space.
        native = ProcessGroup(MockBackend.single(opts.timeout.total_seconds()))
    else:
        native = ProcessGroup(_world, ranks)
    return AxonmlProcessGroup(native, opts.group_rank, opts.group_size)


def register() -> None:
    """Register "axonml" with torch.distributed (again is harmless). Importing this module does it;
    torch also calls it through the package's ``torch.distributed.backends`` entry point the first time
    a script names "axonml", so scripts need no import of ours."""
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()


def _value(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()


class _Work(dist.Work):
    """A torch Work over native works on one lane: `wait()` re-raises their errors; the future
    completes (with `result`) once they have finished and any copy-back has run. The future is made
    only when asked for: a blocking call never pays for one."""

    def __init__(self, natives: list[Any], result: Any, finish: Callable[[], object] | None) -> None:
        super().__init__()
        self._natives = natives
        self._result = result
        self._finish = finish
        self._settling = threading.Lock()
        self._claimed = False  # a thread is waiting for the native works (the others wait for it)
        self._done = threading.Event() if natives else None
        self._finished = False
        self._error: BaseException | None = None
        self._source: torch.futures.Future[Any] | None = None
        self._future: torch.futures.Future[Any] | None = None

    def _settle(self, source: torch.futures.Future[Any], inline: bool) -> None:
        if self._error is not None:
            settle, value = source.set_exception, self._error
        else:
            settle, value = source.set_result, self._result
        if inline:
            settle(value)
        else:
            _settlers.submit(settle, value)

    def _complete(self, inline: bool = False) -> None:
        """Wait for the native works and copy results back, once (on the lane's completion thread, or
        on the thread that waits first); then complete the future, if one was asked for, elsewhere
        (`_settlers`), or here when `inline` (nobody can have chained on it yet)."""
        with self._settling:
            mine, self._claimed = not self._claimed, True
        if not mine:
            if self._done is not None:
                self._done.wait()
            return
        try:
            for w in self._natives:
                w.wait()  # our errors, raised here; Ctrl-C ends it on the main thread
            if self._finish is not None:
                self._finish()
        except BaseException as e:  # the future and wait() report it
            self._error = e
        with self._settling:  # never held across a wait: get_future() must return at once
            self._finished = True
            source = self._source
        if self._done is not None:
            self._done.set()
        if source is not None:
            self._settle(source, inline)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the work finished (the group's timeout bounds it; torch's `timeout` argument is
        not used); re-raise its error."""
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        with self._settling:
            if self._future is None:
                # torch's Future.set_exception completes the future with a value that raises in Python
                # only; torch's C++ (DDP's reducer) would read it as the result. A callback that raises
                # errors its future in C++ too, so the public future is the source's continuation.
                self._source = torch.futures.Future()
                self._future = self._source.then(_value)
                if self._finished:
                    self._settle(self._source, inline=True)
            return self._future


class _Completer:
    """One daemon thread per lane completes its works' futures in order (works on a lane finish in
    order, so no future waits behind another lane's)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="axonml-completer", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._queue.get()._complete()

    def put(self, work: _Work) -> None:
        self._queue.put(work)


def _blocking(opts: Any) -> bool:
    """True for a blocking call from torch's Python API, which sets ``asyncOp=False`` and waits at
    once: it then runs on the calling thread, with no hand-off to a lane's thread and back (torch's own
    C++ callers, DDP's reducer among them, leave it True)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


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

    def run() -> None:
        for s in todo:
            s()

    return run


class AxonmlProcessGroup(dist.ProcessGroup):
    """torch's ProcessGroup interface over a native `ProcessGroup`: torch passes group ranks, the core
    takes global ones."""

    def __init__(self, native: ProcessGroup, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._native: Any = native  # takes CPU tensors where its stub says arrays
        self._ranks = native.ranks()
        self._completers: dict[Any, _Completer] = {}
        self._lock = threading.Lock()
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    # torch names every group (destroy_process_group(g), functional collectives and DeviceMesh look
    # groups up by name) through methods that only reach registered C++ backends: keep them here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def size(self) -> int:
        return len(self._ranks)

    def __repr__(self) -> str:
        return f"AxonmlProcessGroup(rank={self.rank()}, ranks={self._ranks})"

    def _get_backend(self, device: Any) -> AxonmlProcessGroup:
        """This group is its own CPU backend: torch asks for it (batch_isend_irecv does, and a Python
        ProcessGroup has none registered), and a RuntimeError means none, as torch expects."""
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"the axonml backend has no backend for device {device} (CPU only)")
        return self

    # -- plumbing -----------------------------------------------------------------------------------

    def _work(
        self, lane: Any, natives: list[Any], result: Any, finish: Callable[[], object] | None = None
    ) -> _Work:
        natives = [n for n in natives if n is not None]  # None: run already (a blocking call)
        work = _Work(natives, result, finish)
        if not natives:
            work._complete(inline=True)
            return work
        with self._lock:
            completer = self._completers.get(lane) or self._completers.setdefault(lane, _Completer())
        completer.put(work)
        return work

    def _op(self, opts: Any, t: torch.Tensor) -> tuple[ReduceOp, torch.Tensor | None]:
        """Our op for torch's, and for PREMUL_SUM the factor to scale by first."""
        op = opts.reduceOp
        if op.op == dist.ReduceOp.PREMUL_SUM:
            factor = op.factor if isinstance(op.factor, torch.Tensor) else torch.tensor(op.factor)
            return ReduceOp.SUM, factor.to(t.dtype)
        ours = _OPS.get(op.op)
        if ours is None:
            raise ValueError(
                f"the axonml backend does not implement {op.op} (use SUM, PRODUCT, MIN, MAX, AVG)"
            )
        return ours, None

    def _scaled(self, t: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
        return t if factor is None else t * factor

    def _global(self, group_rank: int) -> int:
        return self._ranks[group_rank]

    def _stage(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([t.detach() for t in tensors]) if tensors else torch.empty(0)

    # -- collectives ----------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        detached = not _blocking(opts)
        opts = opts or dist.AllreduceOptions()
        natives, finishes = [], []
        for t in tensors:
            op, factor = self._op(opts, t)
            buf, back = _dense(t)
            if factor is not None:
                buf.mul_(factor)
            natives.append(self._native.all_reduce(buf, op, async_op=detached))
            finishes.append(back)
        return self._work("coll", natives, tensors, _chain(*finishes))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        detached = not _blocking(opts)
        opts = opts or dist.BroadcastOptions()
        root = self._global(opts.rootRank)
        natives, finishes = [], []
        for t in tensors:
            buf, back = _dense(t)
            natives.append(self._native.broadcast(buf, root, async_op=detached))
            finishes.append(back)
        return self._work("coll", natives, tensors, _chain(*finishes))

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        natives, finishes = [], []
        for outs, t in zip(output_lists, inputs, strict=True):
            staged = torch.empty((len(outs), *t.shape), dtype=t.dtype)
            natives.append(self._native.all_gather(_dense(t)[0], staged, async_op=True))
            finishes.append(
                lambda outs=outs, staged=staged: [o.copy_(s) for o, s in zip(outs, staged, strict=True)]
            )
        return self._work("coll", natives, output_lists, _chain(*finishes))

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        out, back = _dense(output)
        native = self._native.all_gather(_dense(input)[0], out.view(self.size(), *input.shape), async_op=True)
        return self._work("coll", [native], [output], back)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(
            "coll", [n for w in works for n in w._natives], outputs, _chain(*(w._finish for w in works))
        )

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        opts = opts or dist.ReduceScatterOptions()
        natives, finishes = [], []
        for out, ins in zip(outputs, input_lists, strict=True):
            op, factor = self._op(opts, out)
            buf, back = _dense(out)
            natives.append(
                self._native.reduce_scatter(self._scaled(self._stage(ins), factor), buf, op, async_op=True)
            )
            finishes.append(back)
        return self._work("coll", natives, outputs, _chain(*finishes))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        opts = opts or dist.ReduceScatterOptions()
        op, factor = self._op(opts, output)
        buf, back = _dense(output)
        send = self._scaled(_dense(input)[0], factor)
        native = self._native.reduce_scatter(send, buf, op, async_op=True)
        return self._work("coll", [native], [output], back)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(
            "coll", [n for w in works for n in w._natives], outputs, _chain(*(w._finish for w in works))
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        opts = opts or dist.ReduceOptions()
        root = self._global(opts.rootRank)
        natives, finishes = [], []
        for t in tensors:
            op, factor = self._op(opts, t)
            buf, back = _dense(t)
            if factor is not None:  # scale a copy: off the root the tensor stays as it was
                buf = buf * factor
                back = (lambda t=t, buf=buf: t.copy_(buf)) if self.rank() == opts.rootRank else None
            natives.append(self._native.reduce(buf, root, op, async_op=True))
            finishes.append(back)
        return self._work("coll", natives, tensors, _chain(*finishes))

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        opts = opts or dist.GatherOptions()
        (t,) = inputs
        outs = output_lists[0] if output_lists else []
        root = self._global(opts.rootRank)
        staged = torch.empty((self.size(), *t.shape), dtype=t.dtype) if self.rank() == opts.rootRank else None
        native = self._native.gather(_dense(t)[0], staged, root, async_op=True)
        finish = None if staged is None else (lambda: [o.copy_(s) for o, s in zip(outs, staged, strict=True)])
        return self._work("coll", [native], output_lists, finish)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        opts = opts or dist.GatherOptions()
        root = self._global(opts.rootRank)
        out, back = (None, None)
        if self.rank() == opts.rootRank:
            out, back = _dense(output)
            out = out.view(self.size(), *input.shape)
        native = self._native.gather(_dense(input)[0], out, root, async_op=True)
        return self._work("coll", [native], [output], back)

    gather_into_tensor = gather_single

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        opts = opts or dist.ScatterOptions()
        (out,) = outputs
        root = self._global(opts.rootRank)
        send = self._stage(input_lists[0]) if self.rank() == opts.rootRank else None
        buf, back = _dense(out)
        native = self._native.scatter(send, buf, root, async_op=True)
        return self._work("coll", [native], outputs, back)

    def barrier(self, opts: Any = None) -> _Work:
        return self._work("coll", [self._native.barrier(async_op=not _blocking(opts))], None)

    def alltoall(self, *args: Any, **kwargs: Any) -> _Work:
        raise NotImplementedError(_ALL_TO_ALL)

    all_to_all_single = alltoall
    alltoall_base = alltoall

    # -- point to point -------------------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        peer = self._global(dst)
        natives = [self._native.send(_dense(t)[0], peer, tag, async_op=True) for t in tensors]
        return self._work(("send", peer, tag), natives, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        peer = self._global(src)
        natives, finishes = [], []
        for t in tensors:
            buf, back = _dense(t)
            natives.append(self._native.recv(buf, peer, tag, async_op=True))
            finishes.append(back)
        return self._work(("recv", peer, tag), natives, tensors, _chain(*finishes))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise NotImplementedError("the axonml backend needs the source rank of a recv (src=...)")
