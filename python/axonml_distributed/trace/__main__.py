"""``python -m axonml_distributed.trace analyze DIR_OR_FILE``: which rank was where in a job's flight
records, and the first call at which ranks diverged (`analysis`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    args = parser.parse_args(argv)
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
