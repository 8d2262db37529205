"""The timeline as a Chrome trace (the JSON that chrome://tracing, https://ui.perfetto.dev and
Horovod's timeline use): one process per rank ("rank R"), one thread per track (a group's collectives,
each DDP gradient bucket, the user's spans), each span a complete event ("ph": "X", timestamps in
microseconds since the first span) and its phases complete events inside it.

The engine's records (`_core.take_timeline`) become spans here (`engine_spans`); spans recorded in
Python come as they are (`spans`). A group's sends and receives have a track of their own beside its
collectives' ("p2p w1:0,1#1"): they may overlap the collectives and each other (each runs on a lane of
its own), and they have no phases (the engine cannot tell when the peer came).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from axonml_distributed.trace.record import group_name
from axonml_distributed.trace.spans import Span, bucket_span

FORMAT = "axonml-timeline"
VERSION = 1
# Phases of a collective: before every member arrived, then until it returned.
WAITING = "waiting for peers"
MOVING = "moving data"
# Track order on a rank: the user's spans and the buckets' (`spans`), then the groups in the order the
# rank made them.
GROUPS_ORDER = 1 << 20


def engine_spans(records: Iterable[Mapping[str, Any]]) -> list[Span]:
    """The spans of the engine's timeline records: each finished collective on its group's track, with
    its phases (a call that failed before every member arrived only waited), each send and receive on
    the group's point-to-point track, and each reduced bucket."""
    spans: list[Span] = []
    for record in records:
        rank = record["rank"]
        name = group_name(record["world_ordinal"], record["ranks"], record["occurrence"])
        for e in record["entries"]:
            created, started, completed = e["created_ns"], e["started_ns"], e["completed_ns"]
            p2p = e["p2p"]
            phases = [] if p2p else [[WAITING, created, completed if started is None else started]]
            if started is not None:
                phases.append([MOVING, started, completed])
            args = {
                "kind": e["kind"],
                "dtype": e["dtype"],
                "bytes": e["bytes"],
                "count": e["count"],
                "route": e["route"],
                "seq": e["seq"],
                "state": e["state"],
                "op": e["op"],
                "root": e["root"],
                "group": name,
                "call": e["call"],
                **({"peer": e["peer"], "tag": e["tag"]} if p2p else {}),
            }
            spans.append(
                {
                    "rank": rank,
                    "track": f"p2p {name}" if p2p else f"group {name}",
                    "order": GROUPS_ORDER + record["index"],
                    "name": e["kind"],
                    "cat": "p2p" if p2p else "collective",
                    "start_ns": created,
                    "end_ns": completed,
                    "args": args,
                    "phases": phases,
                }
            )
        for b in record.get("buckets", []):
            state = "completed" if b["ok"] else "failed"
            args = {"bytes": b["bytes"], "group": name, "state": state}
            spans.append(bucket_span(rank, b["bucket"], b["ready_ns"], b["launched_ns"], b["done_ns"], args))
    return spans


def chrome_trace(spans: Sequence[Span], world_size: int) -> dict[str, Any]:
    """The Chrome trace of `spans` (any ranks, any order) of a world of `world_size` ranks: every rank a
    process named "rank R", every track of a rank a thread named after it, in track order."""
    origin = min((s["start_ns"] for s in spans), default=0)
    tracks: dict[int, dict[tuple[int, str], int]] = {}
    for s in sorted(spans, key=lambda s: (s["rank"], s["order"], s["track"])):
        of_rank = tracks.setdefault(s["rank"], {})
        of_rank.setdefault((s["order"], s["track"]), len(of_rank) + 1)
    events: list[dict[str, Any]] = []
    for rank in sorted(set(range(world_size)) | set(tracks)):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
        for (_, track), tid in tracks.get(rank, {}).items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}}
            )
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )

    def us(ns: int) -> float:
        return round((ns - origin) / 1000, 3)

    for s in sorted(spans, key=lambda s: (s["rank"], s["start_ns"], -s["end_ns"])):
        where = {"pid": s["rank"], "tid": tracks[s["rank"]][(s["order"], s["track"])]}
        start, end = s["start_ns"], s["end_ns"]
        events.append(
            {
                "ph": "X",
                "name": s["name"],
                "cat": s["cat"],
                "ts": us(start),
                "dur": round(us(end) - us(start), 3),
                **where,
                "args": s["args"],
            }
        )
        for phase, begin, finish in s["phases"]:
            events.append(
                {
                    "ph": "X",
                    "name": phase,
                    "cat": "phase",
                    "ts": us(begin),
                    "dur": round(us(finish) - us(begin), 3),
                    **where,
                    "args": {},
                }
            )
    other = {"format": FORMAT, "version": VERSION, "world_size": world_size, "origin_unix_ns": origin}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
