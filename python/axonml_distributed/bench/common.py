"""What the benchmarks share: the default message sizes, how sizes are printed, bus bandwidth, the
measured curves a size sweep hands to its chart, and the progress bar of a long run."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

# Defined beside the multi-process worker, which must import nothing else of the bench (see there).
from axonml_distributed.bench.procs_worker import busbw_factor

DEFAULT_SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Curve:
    """One implementation's time per call against message size, from one run of a size sweep.

    `kind` is "ours", "peer" (another library measured in the same run) or "bound" (a floor no
    implementation can beat here, such as a numpy copy of the bytes); `setting` tells apart sweeps of
    the same collective run otherwise (e.g. "busy", "async")."""

    label: str
    kind: str
    collective: str
    ranks: int
    sizes: list[int]
    seconds: list[float]
    dtype: str = "float32"
    setting: str = ""

    def busbw_gbps(self) -> list[float]:
        f = busbw_factor(self.collective, self.ranks)
        return [s / t * f / 1e9 for s, t in zip(self.sizes, self.seconds, strict=True)]


@contextlib.contextmanager
def progress(total: int, what: str) -> Iterator[Any]:
    """A progress bar on stderr while the block runs, shown only when stderr is a terminal (tqdm's
    disable=None) and gone once done. While it shows, this process's prints go above it, whole lines
    at a time, so a table line never lands in the middle of the bar."""
    with tqdm(total=total, desc=what, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True) as bar:
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
