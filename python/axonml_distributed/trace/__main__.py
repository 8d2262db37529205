"""``python -m axonml_distributed.trace analyze DIR_OR_FILE``: which rank was where in a job's flight
records, and the first call at which ranks diverged (`analysis`). ``python -m axonml_distributed.trace
plot TIMELINE.json OUT.png``: a timeline as a Gantt chart (`gantt`; needs matplotlib)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from axonml_distributed.trace import timeline_file
from axonml_distributed.trace.analysis import analyze
from axonml_distributed.trace.record import load


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m axonml_distributed.trace")
    commands = parser.add_subparsers(dest="command", required=True)
    read = commands.add_parser(
        "analyze", help="say which rank was where and the first call at which ranks diverged"
    )
    read.add_argument(
        "path", metavar="DIR_OR_FILE", help="a flight-record file, or a directory of them (merged)"
    )
    plot = commands.add_parser("plot", help="draw a timeline (AXONML_TIMELINE, timeline()) as a Gantt chart")
    plot.add_argument("timeline", metavar="TIMELINE", help="a timeline's JSON file")
    plot.add_argument("out", metavar="OUT", help="the image to write (PNG, SVG, PDF: by its suffix)")
    args = parser.parse_args(argv)
    timeline_file.cancel()  # a tool reading timelines records none (AXONML_TIMELINE may still be set)
    if args.command == "plot":
        from axonml_distributed.trace.gantt import draw

        try:
            with open(args.timeline) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rows = draw(trace, args.out)
        print(f"{args.out}: {len(rows)} tracks")
        return 0
    try:
        content = load(args.path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    analysis = analyze(content)
    print(analysis.summary())
    for line in analysis.lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
