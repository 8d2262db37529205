"""How the torch jobs print: one write per line (or lines), since the ranks of a host share torchrun's
output and print's separate newline would let their lines run together."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
