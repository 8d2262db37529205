"""The progress bar of a long run (the benchmarks', the demo's): tqdm on stderr, only on a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm


@contextlib.contextmanager
def progress(total: int, what: str, *, enabled: bool = True) -> Iterator[Any]:
    """A progress bar on stderr while the block runs, shown only when stderr is a terminal (tqdm's
    disable=None) and `enabled`, and gone once done; the block gets the tqdm bar (``update``,
    ``set_description``: nothing, when not shown). While it shows, this process's prints go above it,
    whole lines at a time, so a table line never lands in the middle of the bar; lines for stderr go
    through `write_above`."""
    off = None if enabled else True  # None: tqdm looks whether stderr is a terminal
    with tqdm(total=total, desc=what, file=sys.stderr, disable=off, leave=False, dynamic_ncols=True) as bar:
        if bar.disable:
            yield bar
            return
        above = _LinesAboveBar(sys.stdout, sys.stderr)
        try:
            with contextlib.redirect_stdout(above):
                yield bar
        finally:
            above.write_pending()


class _LinesAboveBar:
    """stdout while a bar shows on stderr: each complete line is written with the bar cleared, then the
    bar redrawn under it (tqdm's own DummyTqdmFile clears only bars on the file it writes to)."""

    def __init__(self, out: Any, bar_file: Any) -> None:
        self.out, self.bar_file, self.pending = out, bar_file, ""

    def write(self, text: str) -> int:
        lines, newline, self.pending = (self.pending + text).rpartition("\n")
        if newline:
            with tqdm.external_write_mode(file=self.bar_file):
                self.out.write(lines + newline)
                self.out.flush()
        return len(text)

    def write_pending(self) -> None:
        self.out.write(self.pending)
        self.pending = ""

    def flush(self) -> None:
        """Lines are flushed as they complete; a partial line waits for its end."""


def write_above(line: str) -> None:
    """Write `line` to stderr, above a progress bar showing there (cleared, then drawn again)."""
    tqdm.write(line, file=sys.stderr)
