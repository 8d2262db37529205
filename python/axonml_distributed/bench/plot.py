"""The charts of the benchmarks, the demo and the timeline (`trace.gantt`): the one way they open a
matplotlib figure and save it as a PNG, and the chart of a size sweep (bus bandwidth and latency
against message size, ours beside every peer measured in the same run).

matplotlib is optional (the ``plot`` extra), so it is imported by name when a chart is asked for, with
the Agg backend (no display needed); its objects are typed Any here.

Bus bandwidth follows nccl-tests: busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather,
reduce_scatter and all_to_all, x 1 for broadcast, with algbw = message bytes / time, so figures compare
with a link's rate whatever the collective and the world size.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from axonml_distributed.bench.common import Curve, human

INSTALL_HINT = 'plotting needs matplotlib: pip install "axonml-distributed[plot]"'
BUSBW_NOTE = (
    "busbw as nccl-tests: algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather / reduce_scatter / "
    "all_to_all, x 1 for broadcast"
)
DPI = 110  # pixels per inch of the saved PNGs
_STYLE = {"ours": "-", "peer": "--", "bound": ":"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; exits with what to install when matplotlib is missing."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None


def subplots(rows: int, cols: int, width: float, height: float) -> tuple[Any, Any]:
    """A new figure of rows x cols panels, `width` x `height` inches each; axes always a 2-D array."""
    # Constrained layout leaves room for a figure title of several lines, which tight_layout does not.
    size = (width * cols, height * rows)
    return pyplot().subplots(rows, cols, figsize=size, squeeze=False, layout="constrained")


def save(fig: Any, path: Path) -> None:
    """Write the figure as a PNG (its parent directory made as needed) and release it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    pyplot().close(fig)


def _group_title(c: Curve) -> str:
    setting = f", {c.setting}" if c.setting else ""
    return f"{c.dtype} {c.collective}, {c.ranks} ranks{setting}"


def sweep_figure(curves: Sequence[Curve], title: str) -> Any:
    """One row per (collective, dtype, ranks, setting): bus bandwidth (GB/s) and time per call (us)
    against message size, one line per curve: ours solid, peers dashed, bounds dotted."""
    groups: dict[tuple[str, str, int, str], list[Curve]] = {}
    for c in curves:
        if c.sizes:
            groups.setdefault((c.collective, c.dtype, c.ranks, c.setting), []).append(c)
    if not groups:
        raise ValueError("nothing measured to plot")
    fig, axes = subplots(len(groups), 2, 6.0, 3.6)
    ticker: Any = importlib.import_module("matplotlib.ticker")
    for (bw, lat), members in zip(axes, groups.values(), strict=True):
        for c in members:
            style = _STYLE[c.kind]
            line = bw.plot(c.sizes, c.busbw_gbps(), style, marker="o", ms=3, label=c.label)[0]
            us = [t * 1e6 for t in c.seconds]
            lat.plot(c.sizes, us, style, marker="o", ms=3, label=c.label, color=line.get_color())
        head = _group_title(members[0])
        bw.set_title(f"{head}: bus bandwidth")
        bw.set_ylabel("busbw (GB/s)")
        lat.set_title(f"{head}: latency")
        lat.set_ylabel("time per call (us)")
        lat.set_yscale("log")
        # Plain numbers (6, 20, 1e+04) rather than 6x10^0 on a range of less than a decade.
        lat.yaxis.set_major_formatter(ticker.LogFormatter())
        lat.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
        sizes = sorted({s for c in members for s in c.sizes})
        for ax in (bw, lat):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [human(s) for s in sizes], rotation=30, fontsize="small")
            ax.tick_params(axis="x", which="minor", bottom=False)
            ax.set_xlabel("message size (the larger buffer, as nccl-tests count it)")
            ax.grid(True, which="major", alpha=0.3)
        bw.legend(fontsize="small")
    fig.suptitle(f"{title}\n{BUSBW_NOTE}", fontsize="medium")
    return fig


def draw_sweep(curves: Sequence[Curve], path: Path, title: str) -> Any:
    """The sweep's chart (see `sweep_figure`) written to `path`; returns the figure."""
    fig = sweep_figure(curves, title)
    save(fig, path)
    return fig
