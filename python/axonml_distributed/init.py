"""The default process group: `init_process_group`, `get_default_group`, `destroy_process_group`.

A process started by the launcher (or by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) calls
`init_process_group` once. Rank threads under `spawn` get their own group as a thread-local default, so
code written against the default group runs unchanged in both worlds.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from axonml_distributed import _core, settings

_default: Any = None
_local = threading.local()
# The sys.excepthook that `init_process_group("shm")` installed and the one it replaced, which
# `destroy_process_group` restores.
_excepthooks: tuple[Any, Any] | None = None
# The group the hook aborts when it is not the default group (the torch backend's world).
_hook_group: Any = None


def _set_default_group(pg: Any) -> None:
    """Make `pg` the default group of the calling thread (used by `spawn`), or clear it with None."""
    _local.group = pg


def _given_or_env(given: int | None, read: Callable[[], int | None], name: str) -> int:
    """`given`, else the setting `read` returns (from the environment variable `name`)."""
    if given is not None and given != -1:  # -1: torch's "not given"
        return given
    value = read()
    if value is None:
        raise ValueError(f"{name} is not set: pass it to init_process_group or start the job with axonml-run")
    return value


def _seconds(timeout: float | datetime.timedelta | None) -> float:
    """Seconds, checked as the native timeouts are (a clear ValueError for absurd values)."""
    from axonml_distributed._core import checked_timeout

    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return checked_timeout(None if timeout is None else float(timeout))


def init_process_group(
    backend: str = "shm",
    init_method: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    world_size: int | None = None,
    rank: int | None = None,
) -> Any:
    """Join the job's world and make its group the default; returns the group.

    Arguments in torch.distributed's order. ``backend``: "shm" (processes on one host, through shared
    memory) or "mpi" (under mpiexec, any number of hosts; across hosts, large all_reduces go through
    shared memory inside each host and MPI between hosts). ``init_method``: None or "env://" (the same:
    MASTER_ADDR/MASTER_PORT). ``timeout`` bounds every wait (seconds or a ``datetime.timedelta``; default
    300 s). ``world_size``/``rank`` default to the WORLD_SIZE/RANK environment variables (ignored by "mpi",
    which asks MPI).
    """
    global _default
    if init_method is not None and init_method != "env://":
        if not isinstance(init_method, str):
            raise TypeError(
                f"init_process_group's second argument is init_method (None or 'env://'), got "
                f"{init_method!r}; pass rank= and world_size= by keyword"
            )
        raise ValueError(
            f"init_method {init_method!r} is not supported: use None or 'env://' (MASTER_ADDR/MASTER_PORT)"
        )
    if _default is not None:
        raise RuntimeError(
            "the default process group is already initialised; call destroy_process_group first"
        )
    seconds = _seconds(timeout)
    if backend == "mpi":
        from axonml_distributed.mpi import init_mpi_process_group

        _default = init_mpi_process_group(timeout=seconds)
    elif backend == "shm":
        from axonml_distributed.shm import init_shm_process_group

        _default = init_shm_process_group(
            _given_or_env(rank, settings.rank, settings.RANK),
            _given_or_env(world_size, settings.world_size, settings.WORLD_SIZE),
            seconds,
        )
        install_excepthook()
    elif backend in ("gloo", "nccl"):
        raise ValueError(
            f"backend {backend!r} is torch.distributed's: on this API use 'shm' (processes on one host) or "
            f"'mpi'; for torch.distributed scripts import axonml_distributed.torch and use backend 'axonml'"
        )
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'shm' or 'mpi' (threads: use spawn())")
    return _default


def is_initialized() -> bool:
    """True when the calling thread has a default group."""
    return getattr(_local, "group", None) is not None or _default is not None


def get_default_group() -> Any:
    """The calling thread's default group (set by `spawn`), else the process's (`init_process_group`)."""
    pg = getattr(_local, "group", None) or _default
    if pg is None:
        raise RuntimeError("no default process group: call init_process_group() first, or run under spawn()")
    return pg


# The native GradientSynchronizer.sync_all() without a group asks this (the native module never imports
# the package).
_core.set_default_group_source(get_default_group)


def destroy_process_group() -> None:
    """Forget the process's default group and the calling thread's (their resources go with the last
    reference)."""
    global _default, _excepthooks
    _default = None
    _set_default_group(None)
    if _excepthooks is not None:
        ours, previous = _excepthooks
        _excepthooks = None
        if sys.excepthook is ours:  # unless someone replaced it since
            sys.excepthook = previous


def install_excepthook(group: Any = None) -> None:
    """Abort the shm world when an exception ends this process's main thread, so the peers fail at once
    even if the process lingers (a non-daemon thread keeps it alive), and report it as before. Under
    axonml-run it first leaves an error file (see `error_file`), from which the launcher names the rank
    that failed first. ``group``: the world's group (default: the default group); the torch backend
    passes its own. MPI needs none: its jobs run under ``python -m mpi4py``, which aborts the job. Under
    axonml-run it also dumps this process's flight records (see `trace`), which the launcher merges."""
    from axonml_distributed import error_file, trace

    global _excepthooks, _hook_group
    _hook_group = group
    if _excepthooks is not None and sys.excepthook is _excepthooks[0]:
        return  # installed: it now reports for `group`
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        pg = _hook_group if _hook_group is not None else _default
        path = settings.error_file()
        record = None
        # Reporting the original exception matters more than a failure to record it or to abort.
        if pg is not None and path is not None:
            with contextlib.suppress(Exception):
                record = error_file.record_of(pg.rank(), kind, value, tb)
                error_file.write(path, record)  # before the abort: the peers' records come after it
        flights = settings.flight_record_file()
        if flights is not None:
            with contextlib.suppress(Exception):
                trace.dump_flight_recorder(flights, error=f"{kind.__name__}: {value}")

        def abort() -> None:
            if pg is not None:
                with contextlib.suppress(Exception):
                    pg.backend().abort(f"{kind.__name__} in rank {pg.rank()}: {value}")

        # The interpreter's own hook only prints, quickly: printing first puts the root cause's traceback
        # ahead of the tracebacks of the peers it aborts. Any other hook (a post-mortem debugger) may take
        # long, so the peers are aborted before it runs.
        if previous is sys.__excepthook__:
            try:
                previous(kind, value, tb)
            finally:
                abort()
        else:
            abort()
            previous(kind, value, tb)
        if record is not None and path is not None:
            with contextlib.suppress(Exception):
                error_file.write(path, record.as_reported())

    sys.excepthook = hook
    _excepthooks = (hook, previous)
