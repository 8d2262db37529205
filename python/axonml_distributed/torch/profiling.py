"""torch profiler events for the backend's calls: one ``axonml:<op>`` event per call, named as torch's
tests and its own backends name them (``axonml:all_reduce``, ``axonml:send``, ...), carrying the input
tensors' shapes, and asynchronous, as c10d's are.

With the profiler off a call pays one check (``torch.autograd._profiler_enabled()``) and nothing else.

With it on, the event starts on the calling thread (torch records only events begun on a thread it
profiles) and ends once the call's work has finished. c10d marks its events asynchronous in C++, which
Python cannot; torch's profiler also calls an event asynchronous when it ends on another thread than it
began on. So it ends on another thread: the one that finished the Work when that is another one (a
completer), else the profiler thread here, which the finishing thread waits for, so the event is in
the profile once the call returns. That round trip is what profiling costs a blocking call.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

enabled = torch.autograd._profiler_enabled
_enter = torch.autograd._record_function_with_args_enter
_exit = torch.autograd._record_function_with_args_exit

# Ends events begun on the thread that finishes them (started on the first such event; a forked child
# has no thread behind its parent's, so it starts its own).
_ender: ThreadPoolExecutor | None = None
_ender_lock = threading.Lock()


def _forget_ender() -> None:
    global _ender, _ender_lock
    _ender, _ender_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_ender)

# Set while a profiled call runs on this thread: the calls it makes (coalesced forms call the plain
# ones) record no event of their own.
_inside = threading.local()


class Event:
    """One profiler event, begun on this thread; `end()` ends it, on another thread."""

    __slots__ = ("_handle", "_thread")

    def __init__(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        self._handle = _enter(name, *tensors)
        self._thread = threading.get_ident()

    def end(self) -> None:
        if threading.get_ident() != self._thread:
            _exit(self._handle)
            return
        global _ender
        with _ender_lock:
            if _ender is None:
                _ender = ThreadPoolExecutor(1, thread_name_prefix="axonml-profiler")
        _ender.submit(_exit, self._handle).result()


def profiled(name: str, inputs: Callable[..., Sequence[torch.Tensor]]) -> Callable[[F], F]:
    """A ProcessGroup method whose every call records one event `name` while the profiler is on;
    `inputs` picks the input tensors out of the method's arguments. The event ends when the call
    returns, or with the Work it returns (`Work.record`)."""

    def wrap(call: F) -> F:
        @functools.wraps(call)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not enabled() or getattr(_inside, "call", False):
                return call(self, *args, **kwargs)
            event = Event(name, inputs(*args, **kwargs))
            _inside.call = True
            try:
                work = call(self, *args, **kwargs)
            except BaseException:
                event.end()
                raise
            finally:
                _inside.call = False
            if work is None:
                event.end()
            else:
                work.record(event)
            return work

        return method  # type: ignore[return-value]

    return wrap
