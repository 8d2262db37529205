"""Per-rank error files: how a failing worker tells the launcher what happened (as torchelastic's do).

`axonml-run` gives every worker AXONML_ERROR_FILE, a path of its own in a private directory of the job.
The excepthook of `init_process_group` writes a `Record` there before it aborts the world, so the
launcher can tell the rank whose failure aborted the others (the root cause) from the ranks that then
failed because of it, whatever order their processes exit in. Standard library only: the launcher
reads these files too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType


@dataclass(frozen=True)
class Record:
    rank: int
    type: str
    message: str
    traceback: str
    # time.time() when the exception reached the hook: comparable between the processes of one host.
    time: float
    # The rank whose abort or death raised this rank's PeerFailureError: set on secondary failures only.
    blames: int | None
    # False while the hook is still reporting the exception (printing its traceback).
    reported: bool

    def as_reported(self) -> Record:
        return replace(self, reported=True)


def record_of(rank: int, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> Record:
    """The record of an exception that ended rank `rank`'s main thread."""
    blames = None
    if kind.__name__ == "PeerFailureError":
        # The error's own facts (mapped once, in rust/bindings/exceptions.rs): the aborting or dead peer.
        ranks: list[int] = list(getattr(value, "ranks", None) or [])
        blames = ranks[0] if len(ranks) == 1 else None
    text = "".join(traceback.format_exception(kind, value, tb))
    # The message without where each rank was (its traceback keeps it): the launcher's summary groups
    # the ranks that failed alike by their messages.
    message, progress = str(value), getattr(value, "progress", None)
    if progress and message.endswith(progress):
        message = message[: -len(progress)].rstrip("; ")
    return Record(rank, kind.__name__, message, text, time.time(), blames, reported=False)


def write(path: str, record: Record) -> None:
    """Replace the file at `path` with `record` atomically, so that a reader never sees half of it."""
    write_json(path, asdict(record))


def write_json(path: str | os.PathLike[str], content: object) -> None:
    """Replace the file at `path` with `content` as JSON, atomically (the flight records use it too)."""
    directory, name = os.path.split(os.fspath(path))
    fd, partial = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(content, out)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise


def read(path: Path) -> Record | None:
    """The record at `path`; None when there is none (the rank never failed in Python) or it is not one."""
    try:
        fields = json.loads(path.read_text())
        return Record(**fields)
    except (OSError, ValueError, TypeError):
        return None
