"""Ways a test's rank dies, each with how the launcher's summary and a survivor's PeerFailureError name
it. A survivor learns it from the kernel (the dead rank's pidfd, once its parent reaped it): Linux 6.15
tells it, older kernels do not, and the survivor says the status is unknown."""

from __future__ import annotations

import os
import re
from typing import NamedTuple


class Death(NamedTuple):
    code: str  # a Python statement that ends the process (with os and signal imported)
    launcher: str  # the launcher's summary: "rank 1 failed first (<this>)"
    survivor: str  # a survivor's PeerFailureError: "... (pid N <this>"


DEATHS = {
    "sigkill": Death(
        "os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL", "was killed by SIGKILL (signal 9; "
    ),
    "exit-3": Death("os._exit(3)", "exit code 3", "exited with code 3)"),
    "sigsegv": Death(
        "os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV", "was killed by SIGSEGV (signal 11"
    ),
}

UNKNOWN = "exited; its exit status is unknown ("


def kernel_tells_exit_status() -> bool:
    """Whether pidfds tell a reaped process's exit status here (`PIDFD_INFO_EXIT`, Linux 6.15)."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (6, 15)


def survivor_says(death: Death) -> str:
    """How a survivor names `death` on this kernel."""
    return death.survivor if kernel_tells_exit_status() else UNKNOWN
