"""torch Work objects over native works, and the threads that complete their futures.

A blocking call from torch's Python API never gets here (it runs on the calling thread and returns no
Work). An asynchronous one gets a `Work`; whoever needs it finished first finishes it, once: a thread
in `wait()` (no hand-off), or, once torch asked for its future (DDP's reducer does for every bucket),
the lane's `Completer` thread, which then completes the future at once, running its callbacks there
(as gloo runs them on its worker threads) rather than handing them to yet another thread.
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


class Work(dist.Work):
    """A torch Work over native works on one lane: `wait()` re-raises their errors; the future
    completes (with `result`) once they have finished and any copy-back has run. The future, and the
    completer's part, only when asked for.

    Every asynchronous call makes one, so it costs little: its fields are slots (made and read faster
    than a dict's; torch's own Works take no other attributes either), and `wait()` on a finished one
    returns at once."""

    __slots__ = (
        "_natives",
        "_result",
        "_finish",
        "_completer",
        "_running",
        "_state",
        "_finished",
        "_error",
        "_source",
        "_future",
        "_event",
    )

    def __init__(
        self,
        natives: list[Any],
        result: Any,
        finish: Callable[[], object] | None,
        completer: Callable[[], Completer],
    ) -> None:
        dist.Work.__init__(self)  # not super(): finding it costs as much as a field
        self._natives = natives
        self._result = result
        self._finish = finish
        self._completer = completer
        self._running = threading.Lock()  # held by the thread finishing it; the others wait on it
        self._state = threading.Lock()  # `_finished` and `_source` change together: settled once
        self._finished = False
        self._error: BaseException | None = None
        self._source: torch.futures.Future[Any] | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._event: Event | None = None

    @classmethod
    def done(cls, result: Any, error: Exception | None, completer: Callable[[], Completer]) -> Work:
        """A work that ran on the calling thread already, with its error if it failed."""
        work = cls([], result, None, completer)
        work._finished, work._error = True, error
        return work

    def _run(self) -> torch.futures.Future[Any] | None:
        """Wait for the native works and copy results back, unless done already (another thread
        doing it first: wait for it). Returns the future for this thread to settle, if any."""
        if self._finished:
            return None
        with self._running:  # bounded: the thread inside waits with the group's timeout
            if self._finished:
                return None
            try:
                for w in self._natives:
                    w.wait()  # our errors, raised here; Ctrl-C ends it on the main thread
                if self._finish is not None:
                    self._finish()
            except BaseException as e:  # the future and wait() report it
                self._error = e
            with self._state:
                self._finished = True
                source, event = self._source, self._event
            if event is not None:  # finished: its profiler event ends, before the future's callbacks run
                event.end()
            return source

    def record(self, event: Event) -> None:
        """End the profiler event of the call that returned this work once the work has finished."""
        with self._state:
            if not self._finished:
                self._event = event
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
        if not self._finished:
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._finished and all(w.is_completed() for w in self._natives):
            self._complete()  # only the copy-back and the future are left
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        with self._state:
            if self._future is not None:
                return self._future
            # torch's Future.set_exception completes the future with a value that raises in Python
            # only; torch's C++ (DDP's reducer) would read it as the result. A callback that raises
            # errors its future in C++ too, so the public future is the source's continuation.
            source: torch.futures.Future[Any] = torch.futures.Future()
            self._source = source
            self._future = source.then(_value)
            finished = self._finished
        if finished:
            self._settle(source)  # nobody but us has chained on it yet: no callbacks of others run here
        else:
            self._completer().put(self)
        return self._future


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
