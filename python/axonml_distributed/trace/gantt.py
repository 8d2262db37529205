"""A timeline drawn as a Gantt chart (``python -m axonml_distributed.trace plot TIMELINE.json OUT.png``):
one row per rank and track, in the trace's order, each call's phases (waiting for peers, moving data),
each gradient bucket's (queued, reducing) and the user's spans as bars along time. Needs matplotlib
(the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from axonml_distributed.bench.plot import pyplot
from axonml_distributed.trace.chrome import MOVING, WAITING
from axonml_distributed.trace.spans import QUEUED, REDUCING

# What each bar is, its colour and its legend's words: a phase by its name, a span without phases (the
# user's) apart.
_COLOURS = {
    WAITING: ("#c8c8c8", "waiting for peers"),
    MOVING: ("tab:blue", "moving data"),
    QUEUED: ("#f5d6a8", "bucket queued"),
    REDUCING: ("tab:orange", "bucket reducing"),
}
_USER = ("tab:green", "user span")
_NESTED = "#98df8a"  # a user span inside another


def draw(trace: dict[str, Any], path: str | Path) -> list[str]:
    """Draw the Chrome trace `trace` (a timeline's) to the image `path` (its suffix says the format);
    returns the rows' labels, top to bottom ("rank R: track")."""
    plt = pyplot()
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    rows = sorted(names)
    labels = [f"rank {pid}: {names[(pid, tid)]}" for pid, tid in rows]
    row_of = {key: i for i, key in enumerate(rows)}
    spans = [e for e in events if e["ph"] == "X"]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    shown: set[str] = set()
    # Spans inside spans of the same row (the user's, nested) are drawn thinner, over their parent.
    open_ends: dict[int, list[float]] = {}
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        row = row_of[(e["pid"], e["tid"])]
        start, width = e["ts"] / 1e3, e["dur"] / 1e3
        if e["cat"] != "phase" and e["cat"] != "user":
            # A call's or a bucket's outline; its phases fill it.
            ax.broken_barh(
                [(start, width)], (row - 0.35, 0.7), facecolors="none", edgecolors="black", linewidth=0.3
            )
            continue
        if e["cat"] == "phase":
            colour, label = _COLOURS.get(e["name"], ("tab:gray", e["name"]))
            depth = 0
        else:
            colour, label = _USER
            ends = open_ends.setdefault(row, [])
            while ends and ends[-1] <= start:
                ends.pop()
            depth = len(ends)
            ends.append(start + width)
        height = 0.7 * 0.6**depth
        bottom = row + 0.35 - height  # the y axis points down: a nested bar fills the lower part
        ax.broken_barh(
            [(start, width)],
            (bottom, height),
            facecolors=_NESTED if depth else colour,
            edgecolors="white" if depth else "none",
            linewidth=0.5,
            label=None if label in shown else label,
        )
        shown.add(label)
        if e["cat"] == "user":
            # Above its nested spans' bars: in the part of its own bar they leave free.
            y = bottom + 0.14 if height > 0.5 else bottom + height / 2
            ax.text(start, y, f" {e['name']}", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(rows), 1)),
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    ax.set_title("axonml-distributed timeline")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels
