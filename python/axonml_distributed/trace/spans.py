"""The timeline's spans recorded in Python: the user's (`trace_span`) on the calling rank's "user" track,
and the gradient buckets of torch's own DDP over the "axonml" backend (`torch_bucket`). The collectives
and our DDPs' buckets are recorded by the engine (`_core.take_timeline`); these are kept here, on the
engine's clock (`_core.wall_ns`), only while a timeline is on (`timeline`).

A span is a plain dict, the form the timeline's writer takes for every span (`chrome`): "rank", "track",
"order" (tracks of a rank are shown in this order), "name", "cat", "start_ns", "end_ns", "args" and
"phases" (child spans: [name, start_ns, end_ns] each).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from axonml_distributed import _core, settings

# The track of the user's spans, first on each rank; then the buckets', in reduction order (a track
# each: they overlap one another).
USER_TRACK = "user"
USER_ORDER = 0
BUCKETS_ORDER = 1
# Phases of a gradient bucket: complete but behind an earlier bucket, then its all-reduce.
QUEUED = "queued"
REDUCING = "reducing"

Span = dict[str, Any]

# Whether a timeline is on (the engine's switch is set alongside, by `timeline`), and the spans kept
# since it was turned on. list.append is atomic, so rank threads append without a lock.
_on = False
_spans: list[Span] = []


def on() -> bool:
    """Whether a timeline is on."""
    return _on


def start() -> None:
    """Keep spans from now on (what was kept before is dropped)."""
    global _on, _spans
    _spans = []
    _on = True


def stop() -> list[Span]:
    """Keep no more spans; returns those kept."""
    global _on, _spans
    _on = False
    kept, _spans = _spans, []  # one swap: a span ending meanwhile goes to one list or the other
    return kept


def calling_rank() -> int | None:
    """The global rank of the calling thread: its group's (a rank thread under `spawn`; the process's
    default group), else torch.distributed's (the torch backend), else RANK; None when none says (the
    timeline then takes the one rank the process's groups hold: `timeline.finish`)."""
    from axonml_distributed.init import _default, _local

    group = getattr(_local, "group", None) or _default
    if group is not None:
        return int(group.rank())
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return settings.rank()


def bucket_span(
    rank: int | None, bucket: int, ready: int, launched: int, done: int, args: dict[str, Any]
) -> Span:
    """The span of gradient bucket `bucket` (its position in reduction order) of one step, on its own
    track, from ready through launched to done (nanoseconds)."""
    track = f"ddp bucket {bucket}"
    return {
        "rank": rank,
        "track": track,
        "order": BUCKETS_ORDER + bucket,
        "name": track,
        "cat": "ddp",
        "start_ns": ready,
        "end_ns": done,
        "args": {"bucket": bucket, **args},
        "phases": [[QUEUED, ready, launched], [REDUCING, launched, done]],
    }


def torch_bucket(rank: int | None, bucket: int, nbytes: int, future: Any) -> None:
    """torch's DDP launched bucket `bucket` (its position in this backward) of `nbytes` now; it is done
    when `future` (its Work's) completes. torch's reducer launches a bucket once it is ready, so ready
    and launched are one instant here."""
    launched = _core.wall_ns()

    def done(fut: Any) -> None:
        try:
            fut.value()
            state = "completed"
        except Exception:  # noqa: BLE001 - the reducer reports it; the span only says it failed
            state = "failed"
        args = {"bytes": nbytes, "state": state, "source": "torch DDP"}
        _spans.append(bucket_span(rank, bucket, launched, launched, _core.wall_ns(), args))

    future.then(done)


@contextlib.contextmanager
def trace_span(name: str, **args: Any) -> Iterator[None]:
    """Record the block as a span `name` (with `args`, JSON values) on the "user" track of the calling
    rank (`calling_rank`: under `spawn`, the rank of the calling thread; in a process of one rank, that
    rank; otherwise, such as the thread that called `spawn`, rank 0) in the timeline, when one is on
    (`timeline`, AXONML_TIMELINE); otherwise it costs one test of a flag."""
    if not _on:
        yield
        return
    rank = calling_rank()
    begin = _core.wall_ns()
    try:
        yield
    finally:
        _spans.append(
            {
                "rank": rank,
                "track": USER_TRACK,
                "order": USER_ORDER,
                "name": name,
                "cat": "user",
                "start_ns": begin,
                "end_ns": _core.wall_ns(),
                "args": args,
                "phases": [],
            }
        )
