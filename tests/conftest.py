import signal
import sys
from pathlib import Path

# The tests share the `reference` helpers next to this file.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config) -> None:
    # The Ctrl-C tests need Python's own SIGINT handler, here and in the processes they start. A runner
    # that starts pytest in the background of a non-interactive shell hands it SIGINT ignored; Python
    # then installs no handler, and every child inherits the ignore.
    signal.signal(signal.SIGINT, signal.default_int_handler)
