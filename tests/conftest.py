import os
import signal
import sys
from pathlib import Path

from hypothesis import settings

# The tests share the `reference` helpers next to this file.
sys.path.insert(0, str(Path(__file__).parent))

# The fixture of the tests that span simulated hosts, for every test module.
from simhosts_fixture import sim_hosts  # noqa: E402, F401

# Property tests that take their example count from the profile (the codec's fuzzing) run Hypothesis'
# 100 by default, a few seconds; HYPOTHESIS_PROFILE=long runs them for minutes.
settings.register_profile("long", max_examples=50_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config) -> None:
    # The Ctrl-C tests need Python's own SIGINT handler, here and in the processes they start. A runner
    # that starts pytest in the background of a non-interactive shell hands it SIGINT ignored; Python
    # then installs no handler, and every child inherits the ignore.
    signal.signal(signal.SIGINT, signal.default_int_handler)
