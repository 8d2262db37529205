"""Flight records as JSON: what `dump_flight_recorder` writes, what `axonml-run` merges, what `analyze`
reads. Never pickle.

A file holds the dumps of one or more ranks: ``{"format": FORMAT, "version": VERSION, "world_size": N,
"ranks": {"0": DUMP, ...}}``. Each DUMP has the shape of one rank's dump of torch's flight recorder
(``version``, ``rank``, ``pg_config``, ``entries``), its entries torch's fields where they mean the same
(``record_id``, ``pg_id``, ``process_group``, ``collective_seq_id``, ``profiling_name``,
``input_sizes``, ``input_dtypes``, ``output_sizes``, ``output_dtypes``, ``state``, ``time_created_ns``,
``time_discovered_started_ns``, ``time_discovered_completed_ns``, ``is_p2p``, ``p2p_seq_id``,
``frames``, ...) and ours beside them (``call``, ``kind``, ``dtype``, ``count``, ``root``, ``op``,
``route``; for a send or receive ``peer``, its global rank, and ``tag``). A send or receive is named
as torch names them, by group ranks ("axonml:send 0->1", "axonml:recv 1<-0", "axonml:recv 1<-?" for a
receive from any source still waiting), numbered by ``p2p_seq_id`` (this rank's n-th on the group),
with the group's last collective as ``collective_seq_id``. ``frames`` is the caller's Python stack,
innermost first, when AXONML_FLIGHT_RECORDER_STACKS is on (else empty). Torch's analyzer
(``torch.distributed.flight_recorder.fr_trace``) loads only pickled dumps, so it cannot open these
files; its matcher (``build_db``) takes the ``ranks`` dumps as they are (tested) when they hold
collectives only: it takes a send or receive whose ``p2p_seq_id`` equals the ``collective_seq_id`` of the
collective before it for one coalesced call with it and fails (filter ``is_p2p`` entries out to use it;
``trace analyze`` reads both). Standard library only:
the launcher merges these files (written with `error_file.write_json`, atomically).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

FORMAT = "axonml-flight-recorder"
VERSION = 1
# The version of torch's dump format whose fields the entries carry (torch's matcher reads it as
# "major.minor").
TORCH_VERSION = "2.10"
# The communication library in `profiling_name` ("axonml:all_reduce"), as torch writes "nccl:...".
LIBRARY = "axonml"

# Our dtype names -> torch's ScalarType names, which torch's entries list in input_dtypes/output_dtypes.
_TORCH_DTYPES = {
    "float16": "Half",
    "float32": "Float",
    "float64": "Double",
    "bfloat16": "BFloat16",
    "int8": "Char",
    "uint8": "Byte",
    "int16": "Short",
    "uint16": "UInt16",
    "int32": "Int",
    "uint32": "UInt32",
    "int64": "Long",
    "uint64": "UInt64",
    "bool": "Bool",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
}

Dump = dict[str, Any]


def group_name(world: int, ranks: Iterable[int], occurrence: int) -> str:
    """A communicator's name, alike on every member: its world's ordinal in the process (worlds that
    live in one process at once differ by it), its ranks and which communicator over those ranks it is
    (members make them in the same order): "w1:0,1,2#1"."""
    return f"w{world}:" + ",".join(map(str, ranks)) + f"#{occurrence}"


def _profiling_name(native: Mapping[str, Any], rank: int, ranks: Sequence[int]) -> str:
    """torch's name of a call: its kind, and for a send or receive the group ranks at either end."""
    if not native["p2p"]:
        return f"{LIBRARY}:{native['kind']}"
    index = {r: i for i, r in enumerate(ranks)}
    me, peer = index.get(rank, rank), native["peer"]
    other = "?" if peer is None else str(index.get(peer, peer))
    return f"{LIBRARY}:send {me}->{other}" if native["kind"] == "send" else f"{LIBRARY}:recv {me}<-{other}"


def _entry(
    native: Mapping[str, Any], pg: tuple[str, str], pg_id: int, rank: int, ranks: Sequence[int], last_seq: int
) -> dict[str, Any]:
    """One native entry in torch's shape; `last_seq`: the group's last collective on this rank before it."""
    dtype = native["dtype"]
    dtypes = [_TORCH_DTYPES.get(dtype, dtype)] if dtype is not None else []
    state = native["state"]
    p2p = native["p2p"]
    seq = native["seq"]
    return {
        "record_id": native["record_id"],
        "pg_id": pg_id,
        "process_group": list(pg),
        "collective_seq_id": last_seq if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "op_id": seq,
        "profiling_name": _profiling_name(native, rank, ranks),
        "time_created_ns": native["created_ns"],
        "time_discovered_started_ns": native["started_ns"],
        "time_discovered_completed_ns": native["completed_ns"],
        "input_sizes": [[native["input_elems"]]],
        "input_dtypes": dtypes,
        "output_sizes": [[native["output_elems"]]],
        "output_dtypes": dtypes,
        "state": state,
        "retired": state in ("completed", "failed"),
        "is_p2p": p2p,
        "frames": native["frames"] or [],
        "call": native["call"],
        "kind": native["kind"],
        "dtype": dtype,
        "count": native["count"],
        "root": native["root"],
        "op": native["op"],
        "route": native["route"],
        **({"peer": native["peer"], "tag": native["tag"]} if p2p else {}),
    }


def _entries(record: Mapping[str, Any], pg: tuple[str, str]) -> list[dict[str, Any]]:
    """A native record's entries in torch's shape (oldest first, as the record lists them)."""
    out, last_seq = [], 0
    for native in record["entries"]:
        out.append(_entry(native, pg, record["index"], record["rank"], record["ranks"], last_seq))
        if not native["p2p"]:
            last_seq = native["seq"]
    return out


def to_job_ranks(records: list[dict[str, Any]]) -> int | None:
    """Under torch.distributed's "axonml" backend, give the native `records` of this process the job's
    ranks (rank, group members, each entry's root and peer, and its call's text): a world of one rank
    (torch's one-member groups, `ThreadBackend.single`) is this process's rank; across several hosts,
    each host's world numbers its ranks from 0 (so do its recorders), mapped through the host's ranks
    (the recorders of the calls gloo carries between hosts, world "hosts", have the job's ranks
    already). Returns the job's size across several hosts; None otherwise (then the recorders' other
    ranks are the job's)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    layout = getattr(sys.modules.get("axonml_distributed.torch"), "_hosts", None)
    if layout is None:
        return None
    across = len(layout.hosts) > 1
    for record in records:
        if record["world"] == "hosts":
            continue
        if record["world_size"] == 1:
            _map_ranks(record, (layout.rank,))
        elif across:
            _map_ranks(record, layout.local_ranks)
    return int(dist.get_world_size()) if across else None


def _map_ranks(record: dict[str, Any], ranks: Sequence[int]) -> None:
    """Give `record` the global ranks `ranks` (ranks[i] for its rank i) in place."""
    record["rank"] = ranks[record["rank"]]
    record["ranks"] = [ranks[r] for r in record["ranks"]]
    for entry in record["entries"]:
        root, peer = entry["root"], entry.get("peer")
        if root is not None:
            entry["root"] = ranks[root]
            entry["call"] = _with_rank(entry["call"], f", root={root})", f", root={ranks[root]})")
        if peer is not None:
            entry["peer"] = ranks[peer]
            tail = f", tag {entry['tag']})"
            entry["call"] = _with_rank(entry["call"], f"rank {peer}{tail}", f"rank {ranks[peer]}{tail}")


def _with_rank(call: str | None, old: str, new: str) -> str | None:
    """The core's text of a call (`rust/flight.rs`, `Recorded`'s Display), its rank's ending `old` as
    `new`; None when it does not end so: no text rather than one naming the wrong rank."""
    if call is None or not call.endswith(old):
        return None
    return call[: len(call) - len(old)] + new


def build(records: Sequence[Mapping[str, Any]], error: str | None = None) -> dict[str, Any]:
    """The file of the native records `records` (`_core.flight_records()`), one dump per rank in them;
    `error`, when given, is what ended this process (every rank in it)."""
    dumps: dict[str, Dump] = {}
    world_size = 0
    for record in records:
        rank = record["rank"]
        world_size = max(world_size, record["world_size"])
        dump = dumps.setdefault(
            str(rank),
            {
                "version": TORCH_VERSION,
                "rank": rank,
                "host_name": socket.gethostname(),
                "pid": os.getpid(),
                "world": record["world"],
                "error": error,
                "pg_config": {},
                "entries": [],
            },
        )
        name = group_name(record["world_ordinal"], record["ranks"], record["occurrence"])
        desc = "default_pg" if record["index"] == 0 else "undefined"
        dump["pg_config"][name] = {"name": name, "desc": desc, "ranks": str(list(record["ranks"]))}
        dump["entries"] += _entries(record, (name, desc))
    for dump in dumps.values():
        dump["entries"].sort(key=lambda e: e["record_id"])
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "ranks": dumps}


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The flight-record file at `path`; ValueError when it is not one."""
    content = json.loads(Path(path).read_text())
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{path} is not a flight record of axonml-distributed (no format {FORMAT!r})")
    if content.get("version") != VERSION:
        raise ValueError(f"{path}: flight record version {content.get('version')!r}, this reads {VERSION}")
    return content


def merge(contents: Iterable[Mapping[str, Any]], world_size: int = 0) -> dict[str, Any]:
    """One file of the dumps of `contents` (a rank in several keeps its last), for a world of at least
    `world_size` ranks."""
    dumps: dict[str, Dump] = {}
    for content in contents:
        world_size = max(world_size, int(content.get("world_size", 0)))
        dumps.update(content["ranks"])
    ordered = dict(sorted(dumps.items(), key=lambda item: int(item[0])))
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "ranks": ordered}


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The records of a file, or merged from every flight-record file (``*.json``) in a directory."""
    path = Path(path)
    if not path.is_dir():
        return read(path)
    contents = []
    for file in sorted(path.glob("*.json")):
        try:
            contents.append(read(file))
        except ValueError:
            continue
    if not contents:
        raise ValueError(f"{path} holds no flight record")
    return merge(contents)
