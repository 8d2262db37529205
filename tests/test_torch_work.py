"""The torch `Work` of an asynchronous call: a work that is only waited for takes no lock and makes no
future, so every way of finishing it (wait, is_completed, a future asked for before, during or after
that) must still see its one result or its one error, its copy-back run once, and a Ctrl-C or a
timeout end it as the native work's wait does."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import axonml_distributed as ad  # noqa: E402
from axonml_distributed.torch.group import AxonmlProcessGroup  # noqa: E402
from axonml_distributed.torch.work import Completer, Work  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from interrupts import sigint_once_in  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class _Pending:
    """A native work that finishes when told, failing then with a new `RuntimeError` at every wait
    (as the core raises a new exception object at every `Work.wait()`) when `fails`."""

    def __init__(self, fails: bool = False) -> None:
        self.done = threading.Event()
        self.fails = fails
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1
        assert self.done.wait(30)
        if self.fails:
            raise RuntimeError("peer rank 1 died")

    def is_completed(self) -> bool:
        return self.done.is_set()


def _work(native: Any, finish: Any = None) -> Work:
    completer = Completer()
    return Work([native], ["result"], finish, lambda: completer)


def _all_reduce_async(pg: AxonmlProcessGroup, tensors: list[Any]) -> Work:
    opts = dist.AllreduceOptions()
    opts.asyncOp = True
    work = pg.allreduce(tensors, opts)
    assert work is not None
    return work


def test_a_future_asked_for_after_the_wait_holds_the_output_tensors_at_once() -> None:
    """A work waited for without a future gets one afterwards: completed on the spot with the output
    tensors (torch's gloo returns them), and callbacks chained on it run."""
    pg = AxonmlProcessGroup(ad.ProcessGroup(ad.ThreadBackend.create_world(1)[0]), 0, 1)
    t = torch.arange(4.0)
    work = _all_reduce_async(pg, [t])
    assert work.wait() and work.is_completed() and work.exception() is None
    fut = work.get_future()
    assert fut.done(), "the work finished already: its future is complete as it is handed out"
    out = fut.wait()
    assert len(out) == 1 and out[0] is t and torch.equal(t, torch.arange(4.0))
    assert fut.then(lambda f: f.value()[0].sum().item()).wait() == 6.0
    assert work.get_future() is fut


def test_an_error_is_one_object_for_wait_exception_is_completed_and_a_later_future() -> None:
    """The first failed wait settles the work's error: later waits raise that object without waiting
    again, exception() returns it, and a future asked for afterwards fails with it."""
    native = _Pending(fails=True)
    work = _work(native)
    native.done.set()
    with pytest.raises(RuntimeError, match="peer rank 1 died") as first:
        work.wait()
    with pytest.raises(RuntimeError) as second:
        work.wait()
    assert second.value is first.value and work.exception() is first.value
    assert native.waits == 1, "a failed work is not waited for again"
    assert work.is_completed() and not work.is_success()
    fut = work.get_future()
    assert fut.done()
    with pytest.raises(RuntimeError, match="peer rank 1 died"):
        fut.wait()


def test_is_completed_keeps_the_error_of_a_work_never_waited_for() -> None:
    native = _Pending(fails=True)
    work = _work(native)
    assert not work.is_completed() and work.exception() is None
    native.done.set()
    assert work.is_completed() and not work.is_success()
    error = work.exception()
    assert isinstance(error, RuntimeError) and "peer rank 1 died" in str(error)
    with pytest.raises(RuntimeError) as raised:
        work.wait()
    assert raised.value is error


def test_an_error_after_the_future_was_asked_for_reaches_the_future_and_every_waiter() -> None:
    """The future is made while the work is pending (its completer thread finishes it); the error that
    ends the work later reaches the future, a thread already blocked in wait(), and later waits: one
    object for all but the future's (torch wraps a callback's error)."""
    native = _Pending(fails=True)
    work = _work(native)
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raised.append(e)

    blocked = threading.Thread(target=waiter)
    blocked.start()
    fut = work.get_future()
    assert not fut.done()
    native.done.set()
    with pytest.raises(RuntimeError, match="peer rank 1 died"):
        fut.wait()
    blocked.join(30)
    with pytest.raises(RuntimeError) as later:
        work.wait()
    assert raised == [later.value] and work.exception() is later.value


def test_a_waiter_and_a_future_asked_for_meanwhile_both_get_the_result() -> None:
    native = _Pending()
    work = _work(native)
    waited: list[bool] = []
    blocked = threading.Thread(target=lambda: waited.append(work.wait()))
    blocked.start()
    while native.waits == 0:  # the waiter is inside the native wait, holding nothing
        time.sleep(0.001)
    fut = work.get_future()
    native.done.set()
    assert fut.wait() == ["result"]
    blocked.join(30)
    assert waited == [True] and work.is_success()


def test_the_copy_back_runs_once_whoever_finishes_the_work() -> None:
    """Threads waiting, polling and asking for the future at once: the copy-back runs once, before
    any of them sees the work finished."""
    native, copies = _Pending(), []
    work = _work(native, finish=lambda: copies.append(threading.get_ident()))
    seen: list[Any] = []
    start = threading.Barrier(7)

    def waits() -> None:
        start.wait()
        work.wait()
        seen.append(len(copies))

    def polls() -> None:
        start.wait()
        while not work.is_completed():
            time.sleep(0.0005)
        seen.append(len(copies))

    def asks() -> None:
        start.wait()
        seen.append((work.get_future().wait(), len(copies)))

    threads = [threading.Thread(target=f) for f in (waits, waits, polls, polls, asks, asks)]
    for th in threads:
        th.start()
    start.wait()
    native.done.set()
    for th in threads:
        th.join(30)
    assert len(copies) == 1
    assert sorted(map(str, seen)) == sorted(["1"] * 4 + [str((["result"], 1))] * 2)


def test_a_timeout_fails_the_work_its_future_and_every_wait() -> None:
    """A rank whose peer never comes: the group's timeout ends wait() (torch's timeout argument is not
    used), with the core's timeout error, kept for exception() and a later future."""
    backends = ad.ThreadBackend.create_world(2, timeout=0.3)
    pg = AxonmlProcessGroup(ad.ProcessGroup(backends[0]), 0, 2)
    work = _all_reduce_async(pg, [torch.ones(3)])  # rank 1 never arrives
    with pytest.raises(ad.CollectiveTimeoutError) as raised:
        work.wait()
    assert work.exception() is raised.value and work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="CollectiveTimeoutError: rank 0: Timed out"):
        work.get_future().wait()  # torch wraps an error raised in a future's callback


def test_ctrl_c_ends_a_wait_and_the_work_stays_interrupted() -> None:
    backends = ad.ThreadBackend.create_world(2, timeout=60)
    pg = AxonmlProcessGroup(ad.ProcessGroup(backends[0]), 0, 2)
    work = _all_reduce_async(pg, [torch.ones(3)])  # rank 1 never arrives
    sigint_once_in("w.wait()")  # once inside Work.wait's wait for the native work
    with pytest.raises(KeyboardInterrupt) as raised:
        work.wait()  # interrupted (not the group's timeout, which would raise CollectiveTimeoutError)
    with pytest.raises(ad.PeerFailureError, match="interrupted"):
        ad.ProcessGroup(backends[1]).barrier()  # the peer is told
    with pytest.raises(KeyboardInterrupt) as again:
        work.wait()
    assert again.value is raised.value and work.exception() is raised.value and work.is_completed()


def test_a_coalesced_async_call_waits_for_every_part_and_copies_each_back() -> None:
    """The coalesced forms merge their parts' works into one: its native works and copy-backs (a
    non-contiguous output is gathered into a contiguous copy first) are every part's."""
    pg = AxonmlProcessGroup(ad.ProcessGroup(ad.ThreadBackend.create_world(1)[0]), 0, 1)
    inputs = [torch.arange(6.0), torch.arange(6.0) + 10]
    outputs = [torch.zeros(3, 2).t(), torch.zeros(6)]  # the first is not contiguous
    work = pg.allgather_into_tensor_coalesced(outputs, inputs, None)  # no options: asynchronous
    assert work is not None and work.wait()
    for out, inp in zip(outputs, inputs, strict=True):
        assert torch.equal(out.reshape(-1), inp)
