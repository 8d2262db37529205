"""torch Work objects over native works, and the threads that complete their futures.

A blocking call from torch's Python API never gets here (it runs on the calling thread and returns no
Work). An asynchronous one gets a `Work`; whoever needs it finished first finishes it, once: a thread
in `wait()` (no hand-off), or, once torch asked for its future (DDP's reducer does for every bucket),
the lane's `Completer` thread, which then completes the future at once, running its callbacks there
(as gloo runs them on its worker threads) rather than handing them to yet another thread. A work
that is only waited for (the common `dist.all_reduce(t, async_op=True).wait()`) has nothing to finish
once: its native works settle themselves in the core, so it takes no lock and makes no future.
"""

# mypy: disable-error-code="override"

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from axonml_distributed.torch.profiling import Event


def _value(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()


_init = dist.Work.__init__  # looked up once: every asynchronous call makes a Work

# Makes a work's `_Settling` at most once (taken only on the way to a future or a profiler event).
_SETTLING = threading.Lock()


class _Settling:
    """What a work needs to run something once its native works finish (a copy-back, a profiler
    event's end, its future's completion): the first thread to finish it runs them; the others wait."""

    __slots__ = ("finish", "running", "state", "finished", "source", "future", "event")

    def __init__(self, finish: Callable[[], object] | None) -> None:
        self.finish = finish  # the copy-back, if any
        self.running = threading.Lock()  # held by the thread finishing it; the others wait on it
        self.state = threading.Lock()  # `finished`, `source` and `event` change together: settled once
        self.finished = False
        self.source: torch.futures.Future[Any] | None = None
        self.future: torch.futures.Future[Any] | None = None
        self.event: Event | None = None


class Work(dist.Work):
    """A torch Work over native works on one lane: `wait()` re-raises their errors; the future
    completes (with `result`) once they have finished and any copy-back has run. The future, and the
    completer's part, only when asked for.

    Every asynchronous call makes one, so it costs little: its fields are slots (made and read faster
    than a dict's; torch's own Works take no other attributes either). A work with nothing to run once
    its native works finish (no copy-back, no future asked for, no profiler event: an async call that
    is just waited for) takes no lock: each native work settles once by itself, in the core, and
    `wait()` only waits for them. The rest (`_Settling`) is made when first needed."""

    __slots__ = ("_natives", "_result", "_completer", "_error", "_settling")

    def __init__(
        self,
        natives: list[Any],
        result: Any,
        finish: Callable[[], object] | None,
        completer: Callable[[], Completer],
    ) -> None:
        _init(self)  # not super(): finding it costs as much as a field
        self._natives = natives
        self._result = result
        self._completer = completer
        self._error: BaseException | None = None
        self._settling = None if finish is None else _Settling(finish)

    @classmethod
    def done(cls, result: Any, error: Exception | None, completer: Callable[[], Completer]) -> Work:
        """A work that ran on the calling thread already, with its error if it failed."""
        work = cls([], result, None, completer)
        work._error = error
        return work

    @property
    def _finish(self) -> Callable[[], object] | None:
        """The copy-back it was made with (the coalesced calls chain their parts' into one work)."""
        settling = self._settling
        return None if settling is None else settling.finish

    def _settled(self) -> _Settling:
        """Its `_Settling`, made now if it has none yet."""
        settling = self._settling
        if settling is None:
            with _SETTLING:
                settling = self._settling
                if settling is None:
                    settling = self._settling = _Settling(None)
        return settling

    def _wait_natives(self, finish: Callable[[], object] | None = None) -> None:
        """Wait for the native works (our errors, raised there, are kept as the work's error; Ctrl-C
        ends the wait on the main thread), then run the copy-back `finish`. Not again once it failed
        (or a Ctrl-C ended a wait for it)."""
        if self._error is not None:
            return
        try:
            for w in self._natives:
                w.wait()
            if finish is not None:
                finish()
        except BaseException as e:  # the future and wait() report it
            if self._error is None:  # another thread waiting for the same works found it first
                self._error = e

    def _run(self) -> torch.futures.Future[Any] | None:
        """Finish it, unless done already (another thread doing it first: wait for it). Returns the
        future for this thread to settle, if any."""
        s = self._settled()
        if s.finished:
            return None
        with s.running:  # bounded: the thread inside waits with the group's timeout
            if s.finished:
                return None
            self._wait_natives(s.finish)
            with s.state:
                s.finished = True
                source, event = s.source, s.event
            if event is not None:  # finished: its profiler event ends, before the future's callbacks run
                event.end()
            return source

    def record(self, event: Event) -> None:
        """End the profiler event of the call that returned this work once the work has finished."""
        s = self._settled()
        with s.state:
            if not s.finished:
                s.event = event
                return
        event.end()

    def _settle(self, source: torch.futures.Future[Any]) -> None:
        """Complete the future: its callbacks run here."""
        if self._error is not None:
            source.set_exception(self._error)
        else:
            source.set_result(self._result)

    def _complete(self) -> None:
        """Finish it here, unless another thread does (then wait for that one), and settle the future."""
        source = self._run()
        if source is not None:
            self._settle(source)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the work finished (the group's timeout bounds it; torch's `timeout` argument is
        not used); re-raise its error."""
        s = self._settling
        if s is None and self._error is None:
            # Nothing else to run once: no lock (see the class docs), and `_wait_natives` inlined (a
            # call costs an asynchronous call as much as a field).
            try:
                for w in self._natives:
                    w.wait()
                return True
            except BaseException as e:  # kept, as `_wait_natives` keeps it
                if self._error is None:
                    self._error = e
        elif s is not None and not s.finished:
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def _natives_completed(self) -> bool:
        for w in self._natives:
            if not w.is_completed():
                return False
        return True

    def is_completed(self) -> bool:
        s = self._settling
        if s is None:
            if self._error is None and not self._natives_completed():
                return False
            self._wait_natives()  # returns at once: only to keep their error
            return True
        if not s.finished and self._natives_completed():
            self._complete()  # only the copy-back and the future are left
        return s.finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        s = self._settled()
        with s.state:
            if s.future is not None:
                return s.future
            # torch's Future.set_exception completes the future with a value that raises in Python
            # only; torch's C++ (DDP's reducer) would read it as the result. A callback that raises
            # errors its future in C++ too, so the public future is the source's continuation.
            source: torch.futures.Future[Any] = torch.futures.Future()
            s.source = source
            future = s.future = source.then(_value)
            finished = s.finished
        # Nobody but us has chained on it yet: settled here, no callbacks of others run here.
        if finished:
            self._settle(source)
        elif self._error is not None or self._natives_completed():
            self._complete()  # nothing to wait for: here, at once
        else:
            self._completer().put(self)
        return future


class AnySourceWork(Work):
    """The Work of a receive from any source: torch reads the sender from it (`dist.recv(t)` calls
    `_source_rank()` once the work finished)."""

    __slots__ = ("_ranks",)

    def __init__(
        self,
        native: Any,
        ranks: list[int],
        result: Any,
        finish: Callable[[], object] | None,
        completer: Callable[[], Completer],
    ) -> None:
        super().__init__([native], result, finish, completer)
        self._ranks = ranks

    def source_rank(self) -> int:
        """The sender's rank in the group, once the receive finished (waits for it; re-raises its error)."""
        self.wait()
        return self._ranks.index(self._natives[0].source_rank())

    _source_rank = source_rank


class Completer:
    """Finishes the works of one lane whose futures torch asked for, in order, on a thread of its own,
    and completes each future there. A future's callback may wait for a later work of the lane (torch's
    PowerSGD hook does): whenever every thread serving the lane is inside callbacks while works wait,
    one more thread starts, and ends once the others are free again."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Work] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._free = 0  # serving threads not inside a future's callbacks
        with self._lock:
            self._start()

    def _start(self) -> None:
        """One more serving thread (called with the lock held)."""
        self._free += 1
        threading.Thread(target=self._serve, name="axonml-completer", daemon=True).start()

    def put(self, work: Work) -> None:
        self._queue.put(work)
        with self._lock:  # after the put: a thread entering callbacks now sees the work queued
            if self._free == 0:
                self._start()

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            source = work._run()
            if source is None:  # another thread finished and settled it
                continue
            with self._lock:
                self._free -= 1
                if self._free == 0 and not self._queue.empty():
                    self._start()
            work._settle(source)
            with self._lock:
                self._free += 1
                if self._free > 1:  # another thread serves the queue: one is enough
                    self._free -= 1
                    return
