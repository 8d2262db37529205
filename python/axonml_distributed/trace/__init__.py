"""The flight recorder, seen from Python: every rank's handle on every group keeps its last calls
(AXONML_FLIGHT_RECORDER_ENTRIES, default 64) as the native engine records them;
`dump_flight_recorder(path)` writes this process's records as JSON (`record`), and
``python -m axonml_distributed.trace analyze DIR_OR_FILE`` says which rank was where and where they
diverged (`analysis`). The timeline (`timeline`, AXONML_TIMELINE) writes every call of every rank, the
DDPs' gradient buckets and the user's spans (`trace_span`) as one Chrome trace."""

from __future__ import annotations

import os
from typing import Any

from axonml_distributed.error_file import write_json
from axonml_distributed.trace.analysis import Analysis, GroupAnalysis, analyze
from axonml_distributed.trace.record import build, load, merge, read, to_job_ranks
from axonml_distributed.trace.spans import trace_span
from axonml_distributed.trace.timeline_file import timeline


def flight_record(error: str | None = None) -> dict[str, Any]:
    """This process's flight records (every rank it holds, every group), as `dump_flight_recorder`
    writes them; `error`: what ended the process, when it is failing."""
    from axonml_distributed import _core

    records = _core.flight_records()
    to_job_ranks(records)
    return build(records, error)


def dump_flight_recorder(path: str | os.PathLike[str], error: str | None = None) -> None:
    """Write this process's flight records (`flight_record`) to `path` as JSON, atomically."""
    write_json(path, flight_record(error))


__all__ = [
    "Analysis",
    "GroupAnalysis",
    "analyze",
    "dump_flight_recorder",
    "flight_record",
    "load",
    "merge",
    "read",
    "timeline",
    "trace_span",
]
