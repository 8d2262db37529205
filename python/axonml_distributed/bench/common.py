"""What the benchmarks share: the default message sizes, how sizes are printed, bus bandwidth, and the
measured curves a size sweep hands to its chart (their progress bar: `axonml_distributed.progress`)."""

from __future__ import annotations

from dataclasses import dataclass

# Defined beside the multi-process worker, which must import nothing else of the bench (see there).
from axonml_distributed.bench.procs_worker import busbw_factor

DEFAULT_SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def csv_ints(text: str) -> list[int]:
    """An option's comma-separated integers ("8,4096"; empty items ignored)."""
    return [int(x) for x in text.split(",") if x]


def csv_names(text: str) -> list[str]:
    """An option's comma-separated names ("toy,resnet18"; empty items ignored, so "" is none)."""
    return [x for x in text.split(",") if x]


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
